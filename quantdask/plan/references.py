"""The driver's side of a sweep's references: each model's reference is submitted once, in
parts that every slot computes at once and one small task joins (see
:mod:`quantdask.measure.reference`), and its future is handed to each of that model's jobs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from quantdask.backends import get_backend
from quantdask.backends.capabilities import OwnRuntime
from quantdask.measure.reference import (
    combine_reference,
    compute_baseline_tasks,
    compute_reference_shard,
    reference_key,
    shard_rows,
)
from quantdask.sweepfile.sweep import DEVICE_MEMORY, start_rank

if TYPE_CHECKING:
    from distributed import Client, Future

    from quantdask.sweepfile.sweep import Job


log = logging.getLogger("quantdask.reference")


class Parked(NamedTuple):
    """An attempt waiting for its model's reference before it is submitted."""

    job: Job
    number: int  # the attempt's number
    avoid: str | None  # the worker its last attempt failed on, for a retry
    reference: Future


@dataclass
class ModelReferences:
    """The driver's side of one sweep's references: one future per model (submitted again
    only after a failure, so a retry never inherits a failed dependency), the attempts waiting
    for one (``parked``), and a deadline on each part like a job's.

    A reference is computed in parts (:func:`shard_rows`, one per slot ``slots()`` counts) that
    one small task combines: every worker computes from the start instead of one computing
    while the others wait. ``resources_for(job)`` is what each part of the reference of
    ``job``'s model asks Dask for; ``clock`` reads the time its deadlines are measured on (a
    fake one in tests).
    """

    client: Client
    run_id: str
    resources_for: Callable[[Job], dict[str, float]]
    clock: Callable[[], float] = time.monotonic
    slots: Callable[[], int] = lambda: 1
    futures: dict[str, Future] = field(default_factory=dict)  # reference_key -> current future
    # Attempts waiting for their model's reference: Dask key -> [(job, attempt, avoid, future)].
    parked: dict[str, list[Parked]] = field(default_factory=dict)
    _parts: dict[str, list[Future]] = field(default_factory=dict)  # Dask key -> its parts
    _whole: dict[str, str] = field(default_factory=dict)  # a part's Dask key -> the reference's
    _deadlines: dict[str, float] = field(default_factory=dict)  # part's Dask key -> timeout_s
    _starts: dict[str, tuple[float, str]] = field(default_factory=dict)  # key -> (t, address)
    _cut: set[str] = field(default_factory=set)
    _requests: dict[str, float] = field(default_factory=dict)  # part -> DEVICE_MEMORY asked
    _texts: dict[str, str] = field(default_factory=dict)  # text_sha256 -> eval/calibration text
    _submitted: int = 0
    # What jobs of a runtime of their own need made first: Preparation.name -> its future.
    prepared: dict[str, Future] = field(default_factory=dict)

    def future_for(self, job: Job) -> Future:
        """The future of ``job``'s model reference, submitted now if there is none (or the last
        one failed)."""
        key = reference_key(job.model, job.eval, job.calibration, job.tasks)
        self._settle()
        future = self.futures.get(key)
        if future is None or future.status in ("error", "cancelled"):
            self._submitted += 1
            # The Dask key is this driver's own: a key is an identity across clients, and a
            # cancellation of another sweep's reference must never reach this one.
            dask_key = f"{key}-{self.run_id}-{self._submitted}"
            resources = self.resources_for(job)
            shards = []
            for start, stop in shard_rows(job.eval.samples, job.eval.batch_size, self.slots()):
                shards.append(self._submit_part(
                    f"{dask_key}-windows-{start}-{stop}", dask_key, job, resources,
                    compute_reference_shard, job.model, job.eval, self._text(job.eval),
                    (start, stop), job.timeout_s, job.streamed))
            # The baseline's task scores: one more part, beside the log-probs.
            # (None for a streamed model: scoring tasks needs it resident.)
            tasks = job.tasks and not job.streamed and self._submit_part(
                f"{dask_key}-tasks", dask_key, job, resources, compute_baseline_tasks,
                job.model, job.tasks, job.timeout_s)
            self._parts[dask_key] = [*shards, *([tasks] if tasks else [])]
            calibration = job.calibration
            future = self.client.submit(
                combine_reference, job.model, job.eval, *shards, calibration=calibration,
                calibration_text=calibration and self._text(calibration), tasks=job.tasks,
                baseline_tasks=tasks, key=dask_key, priority=job.priority + 10, pure=False,
                retries=0)
            self.futures[key] = future
        return future

    def prepared_for(self, job: Job) -> Future | None:
        """The future of what ``job``'s backend makes once before its jobs run
        (``OwnRuntime.prepare``: a model converted to its runtime's format), submitted now if
        there is none (or the last one failed); None for a job that needs nothing made."""
        own = get_backend(job.backend).has(OwnRuntime)
        preparation = own.prepare(job) if own is not None and own.prepare is not None else None
        if preparation is None:
            return None
        future = self.prepared.get(preparation.name)
        if future is None or future.status in ("error", "cancelled"):
            self._submitted += 1
            future = self.client.submit(
                preparation.function, *preparation.args, resources=self.resources_for(job),
                key=f"{preparation.name}-{self.run_id}-{self._submitted}",
                priority=job.priority + 10, pure=False, retries=0)
            self.prepared[preparation.name] = future
        return future

    def _submit_part(self, part_key: str, dask_key: str, job: Job,
                     resources: dict[str, float], function, *args) -> Future:
        """Submit one part of the reference ``dask_key``, with a deadline like a job's."""
        self._deadlines[part_key] = job.timeout_s  # before its start is announced
        self._requests[part_key] = resources.get(DEVICE_MEMORY, 0)
        self._whole[part_key] = dask_key
        return self.client.submit(function, *args, key=part_key, resources=resources,
                                  priority=job.priority + 10, pure=False, retries=0)

    def _text(self, source) -> str:
        """The text of an eval or calibration source, read once per sweep."""
        if source.text_sha256 not in self._texts:
            self._texts[source.text_sha256] = source.read_text()
        return self._texts[source.text_sha256]

    def all_futures(self) -> list[Future]:
        """Every current reference and its parts (to cancel them all)."""
        return [*self.futures.values(), *self.prepared.values(),
                *(part for f in self.futures.values() for part in self._parts.get(str(f.key), []))]

    def release(self) -> None:
        """Let go of every future: Dask forgets them once no client holds them."""
        self.futures.clear()
        self._parts.clear()
        self.prepared.clear()

    def failed(self, job: Job, dask_key: str) -> bool:
        """Whether ``dask_key`` is the current reference of ``job``'s model and it failed."""
        future = self.futures.get(reference_key(job.model, job.eval, job.calibration, job.tasks))
        return future is not None and future.key == dask_key and future.status == "error"

    def park(self, job: Job, attempt: int, avoid: str | None, future: Future) -> None:
        self.parked.setdefault(str(future.key), []).append(Parked(job, attempt, avoid, future))

    def unpark_done(self, spread_to: Callable[[list[Job]], list[str]]
                    ) -> list[Parked]:
        """The parked attempts whose reference is done, in start order (``start_rank``: the
        plan's order), after copying a finished reference to the workers ``spread_to(jobs)``
        names.

        Dask starts a task where its dependencies are: submitted while the reference is on one
        worker, a model's jobs would all be queued there and spread only by work stealing.
        With the reference copied to every worker that can take them, Dask places each job by
        the workers' load and room. (A failed reference goes to the jobs as it is: each records
        the error.)
        """
        ready = []
        for key, entries in list(self.parked.items()):
            future = entries[0].reference
            if not future.done():
                continue
            del self.parked[key]
            if future.status == "finished":
                try:
                    self.client.replicate([future],
                                          workers=spread_to([e.job for e in entries]) or None)
                except Exception as error:  # noqa: BLE001 - a worker left meanwhile: the jobs
                    log.info("reference %s not copied to every worker (%s)", key, error)
            ready += sorted(entries, key=lambda e: start_rank(e.job))
        return ready

    def take_parked(self) -> list[Parked]:
        """Every parked attempt, no longer parked."""
        taken = [entry for entries in self.parked.values() for entry in entries]
        self.parked = {}
        return taken

    def started(self, dask_key: str, address: str) -> bool:
        """Note that a worker began the part ``dask_key``; False if it is no part of a
        reference of this sweep."""
        if dask_key not in self._deadlines:
            return False
        self._starts[dask_key] = (self.clock(), address)
        return True

    def overdue(self) -> list[tuple[str, str]]:
        """Cut every reference with a part running past its deadline: (Dask key of the part,
        worker address) of each of its running parts, for the caller to restart those workers
        (a cancelled task keeps its thread and device until it returns; a hung one never does).
        A hung reference would hold every job of its model; its jobs then fail (an attempt
        each) and their retries get a new reference."""
        self._settle()
        now, cut = self.clock(), []
        live = {part.key: part for part in self.all_futures()}
        for key in [k for k in self._starts if k not in live or live[k].done()]:
            del self._starts[key]
        late = {self._whole[key]: key for key, (started, _) in self._starts.items()
                if now - started > self._deadlines[key]}
        for whole, key in late.items():
            log.warning("reference %s: no result after %gs; restarting the workers of its "
                        "running parts", key, self._deadlines[key])
            for part in [k for k in self._starts if self._whole[k] == whole]:
                cut.append((part, self._starts.pop(part)[1]))
                self._cut.add(part)
            self._cut.add(whole)
            self._cancel(whole)
        return cut

    def _settle(self) -> None:
        """Let go of the parts of every reference that is done: a finished one holds what they
        computed (so their results need not stay on the workers), and a failed one's
        unfinished parts would only keep workers busy. Released, not cancelled: Dask cancels
        a cancelled key's dependents too, so cancelling a part cancelled the failed reference
        and every attempt already submitted on it (each then requeued on a cancelled
        dependency until it counted as worker_lost, instead of failing with the reference's
        error); a released part no one wants is dropped by the scheduler all the same."""
        for whole in self.futures.values():
            if whole.done():
                for part in self._parts.pop(str(whole.key), []):
                    if not part.done():
                        part.release()

    def was_cut(self, dask_key: str) -> bool:
        return dask_key in self._cut

    def unfit(self, room: float) -> dict[str, float]:
        """The parts of references waiting to start that ask for more device memory than
        ``room``: Dask key -> bytes asked."""
        return {part.key: self._requests[part.key] for part in self.all_futures()
                if part.key in self._requests and not part.done()
                and part.key not in self._starts and self._requests[part.key] > room}

    def abandon(self, dask_key: str) -> list[Parked]:
        """Cancel the reference that ``dask_key`` (a part of it) belongs to; return the
        attempts that were parked on it."""
        whole = self._whole.get(dask_key, dask_key)
        self._cancel(whole)
        return self.parked.pop(whole, [])

    def _cancel(self, whole: str) -> None:
        for part in self._parts.get(whole, []):
            part.cancel()
        for future in self.futures.values():
            if future.key == whole:
                future.cancel()
