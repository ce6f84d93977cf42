"""The driver's loop over one sweep session: submit every attempt, collect outcomes as they
complete, and act on what the policy (``policy``, ``retry``) decides, with the attempts in an
``AttemptTable`` and every record written by the ``Recorder``. Dask's scheduler places the
attempts by resources and priority; this loop only does the client and disk I/O."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import Any

import cloudpickle
from distributed import Client, Future, as_completed

from quantdask.backends import get_backend
from quantdask.cluster.operations import (
    cluster_capacity,
    live_workers,
    restart_worker,
    retire_worker,
)
from quantdask.job.job import run_job
from quantdask.job.outcome import JobOutcome
from quantdask.plan.health import DeviceHealth
from quantdask.plan.memory_kills import NANNY_MEMORY_TOPIC, MemoryKill, MemoryKills
from quantdask.plan.placement import Placement, most_room, workers_with_room
from quantdask.plan.policy import (
    Grace,
    Requeues,
    WorkerWatch,
    outcome_of_error,
    past_deadline,
    stranded,
    worker_went_away,
)
from quantdask.plan.references import ModelReferences
from quantdask.plan.retry import RetryQueue, after_failure
from quantdask.process.devices import TELEMETRY_TOPIC, DeviceSampler, drain_this_worker
from quantdask.process.live_log import JOB_LOG_TOPIC
from quantdask.process.runtime import JOB_START_TOPIC
from quantdask.run import LOG_CHANNEL, topics
from quantdask.run.attempts import Attempt, AttemptTable, label
from quantdask.run.progress import SweepProgress
from quantdask.run.recorder import Recorder
from quantdask.store.run_store import RunStore
from quantdask.sweepfile.sweep import Job, Sweep
from quantdask.util import utcnow
from quantdask.words import FailureClass, Status

log = logging.getLogger(LOG_CHANNEL)

POLL_S = 0.05
"""How often the driver checks deadlines and due retries while no result is ready."""

PROGRESS_EVERY_S = 0.25
"""How often the live progress is shown (and written, at most once a second)."""

NO_WORKERS_GRACE_S = 120.0
"""How long a sweep waits for workers to come back when none is left before failing the rest."""

MAX_REQUEUES = 10
"""Times a job may be put back in the queue, uncounted, because the worker it waited on died
(other jobs' crashes spend it too, so it is generous; it only bounds a job that kills its
worker before its start is announced)."""


class SweepDriver:
    """The driver's loop for one sweep: submit, collect, retry, enforce deadlines, persist."""

    def __init__(self, client: Client, store: RunStore, sweep: Sweep, run_id: str, on_result,
                 progress: SweepProgress, on_progress, placement: Placement,
                 clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.clock = clock  # every deadline, backoff and grace is measured on it
        self.placement = placement
        self.store = store
        self.sweep = sweep
        self.on_result = on_result
        self.progress = progress
        self.on_progress = on_progress
        self._progress_shown = 0.0
        self.run_id = run_id
        self.attempts = AttemptTable(tag=run_id)
        self.recorder = Recorder(store, self.run_id, sweep.checked_gates)
        self.references = ModelReferences(client, self.run_id, self._reference_resources,
                                          clock, slots=lambda: cluster_capacity(
                                              client, sweep.jobs_per_gpu)[1])
        self.delayed = RetryQueue()
        self.health = DeviceHealth(limit=sweep.exclude_device_after)
        self.pending = as_completed(loop=client.loop, with_results=True, raise_errors=False)
        self.requeues = Requeues(MAX_REQUEUES)
        self._backends: dict[str, bytes] = {}
        self._next_stranded_check = 0.0
        self._workers = WorkerWatch(NO_WORKERS_GRACE_S)
        self._unfit = Grace(NO_WORKERS_GRACE_S)  # attempts and references no worker has room for
        self.kills = MemoryKills()  # workers their nanny killed for memory, attempts waiting
        self.stop = threading.Event()  # set by SweepHandle.cancel(): submit nothing more
        self.cancelled: list[str] = []  # jobs whose running attempts were cancelled

    def _reference_resources(self, job: Job) -> dict[str, float]:
        return self.placement.reference_resources(job)  # the placement a search may replace

    def _pickled_backend(self, name: str) -> bytes:
        if name not in self._backends:
            self._backends[name] = cloudpickle.dumps(get_backend(name))
        return self._backends[name]

    def submit(self, job: Job, number: int, avoid: str | None = None) -> None:
        """Submit an attempt of ``job``; a retry runs on workers other than ``avoid`` (the one
        its last attempt failed on) when there are others with room for it.

        An attempt whose model reference is still being computed waits here until it is done
        (see ``_release_parked``)."""
        job = self.placement.capped(job)
        reference = self.references.future_for(job)
        self.progress.job_queued(job.id, label(job), job.priority)
        if not reference.done():
            self.references.park(job, number, avoid, reference)
            return
        self._submit_attempt(job, number, avoid, reference)

    def _release_parked(self) -> None:
        """Submit the attempts whose reference is done (see ``ModelReferences.unpark_done``),
        the reference copied first to the workers with room for the smallest of them."""
        def with_room(jobs: list[Job]) -> list[str]:
            return list(workers_with_room(self.client,
                                          min(j.device_memory_bytes for j in jobs)))

        for job, number, avoid, reference in self.references.unpark_done(with_room):
            self._submit_attempt(job, number, avoid, reference)

    def _submit_attempt(self, job: Job, number: int, avoid: str | None,
                        reference: Future) -> None:
        key = self.attempts.new_key(job.id)
        elsewhere = ([a for a, name in workers_with_room(
            self.client, job.device_memory_bytes).items() if name != avoid] if avoid else [])
        self.attempts.add(Attempt(job, number, utcnow(), key, restricted_to=elsewhere,
                                  reference_key=str(reference.key)))
        self.pending.add(self.client.submit(
            run_job, job, self._pickled_backend(job.backend), number, reference,
            self.references.prepared_for(job), key=key, resources=job.resources,
            priority=job.priority, pure=False, retries=0, workers=elsewhere or None))

    def _on_job_start(self, event) -> None:
        # Runs on the client's event loop thread: only note when and where a task began (again,
        # if a scheduler of its own re-ran it after a worker died).
        _, message = event
        attempt = self.attempts.note_start(message["key"], self.clock(), message["address"],
                                           message["name"])
        self.placement.note_slot(message["name"], message.get("slot"))
        if attempt is not None:
            self.progress.job_started(attempt.key, attempt.job.id, label(attempt.job),
                                      attempt.job.priority, attempt.number, message["name"])
        else:
            self.references.started(message["key"], message["address"])

    def run(self, jobs: list[Job]) -> None:
        self.client.register_plugin(DeviceSampler())
        alone = topics.subscribers(self.client, TELEMETRY_TOPIC) == 0
        if alone:  # samples from before this sweep are not its own (nor another sweep's)
            self.client.run(drain_this_worker, on_error="ignore")
        listened = ((JOB_START_TOPIC, self._on_job_start), (TELEMETRY_TOPIC, self._on_telemetry),
                    (JOB_LOG_TOPIC, self.recorder.live.on_event),
                    (NANNY_MEMORY_TOPIC, self.kills.on_event))
        for topic, handler in listened:
            topics.subscribe(self.client, topic, handler)
        try:
            for job in jobs:
                self.submit(job, 1)
            while not self.stop.is_set() and (not self.pending.is_empty() or self.delayed
                                              or self.references.parked or self.kills):
                ready = self.pending.next_batch(block=False) if self.pending.has_ready() else []
                for future, result in ready:
                    self._collect(future, result)
                self.recorder.live.write(self.attempts.get)  # running attempts' lines so far
                for attempt, error in self.kills.settled(self.clock()):  # lost, or killed
                    self._finish_lost(attempt, error, True, False)
                self._release_parked()
                self._enforce_deadlines()
                self._submit_due_retries()
                self._release_stranded()
                self._give_up_without_workers()
                self.show_progress()
                if not ready:
                    time.sleep(POLL_S)
            if self.stop.is_set():
                self._cancel_the_rest()
        except BaseException:
            # On an error (or an interrupt in a notebook) nothing may keep running unseen.
            self._take_and_cancel(list)
            self.client.cancel(self.references.all_futures())
            raise
        finally:
            for topic, handler in listened:
                topics.unsubscribe(self.client, topic, handler)
            self.recorder.live.close()
            self.references.release()
        if topics.subscribers(self.client, TELEMETRY_TOPIC) == 0:
            # The idle time since each worker's last job (another sweep's, while one runs).
            for samples in self.client.run(drain_this_worker, on_error="ignore").values():
                self.recorder.samples(samples)

    def _cancel_the_rest(self) -> None:
        """After ``stop``: cancel every attempt and reference, record the attempts that had
        started as cancelled (their jobs have no result, so the next run of the sweep runs
        them), and forget the waiting retries and parked attempts."""
        taken = self._take_and_cancel(list)
        self.client.cancel(self.references.all_futures())
        self.delayed.take_all()
        self.references.take_parked()
        for key, attempt in taken:
            self.progress.attempt_dropped(key)
            if attempt.started is None:
                continue
            self.cancelled.append(attempt.job.id)
            self.recorder.attempt(attempt, JobOutcome.cancelled(attempt.job.id, attempt.number,
                                                                attempt.worker_name))
        log.warning("sweep %s cancelled: %d running attempts stopped", self.sweep.name,
                    len(self.cancelled))

    def _take_and_cancel(self, select) -> list[tuple[str, Attempt]]:
        """Take the attempts ``select`` picks out of the table and cancel their futures."""
        taken = self.attempts.take(select)
        if taken:
            self.client.cancel([Future(key, self.client) for key, _ in taken])
        return taken

    def _on_telemetry(self, event) -> None:
        _, sample = event  # on the client's event loop thread: note it, nothing more
        self.progress.telemetry(sample["name"], sample["device"], sample.get("job_id"),
                                sample.get("memory_used_bytes"), sample.get("host_rss_bytes"),
                                sample.get("host_memory_limit_bytes"))

    def show_progress(self, final: bool = False) -> None:
        """Write ``progress.json`` and call ``on_progress``, a few times a second at most."""
        now = self.clock()
        if not final and now - self._progress_shown < PROGRESS_EVERY_S:
            return
        self._progress_shown = now
        try:
            self.progress.write(force=final)
            if self.on_progress is not None:
                # A copy: the view may read it from its own thread while this one goes on.
                self.on_progress(self.progress.snapshot())
        except Exception as error:  # noqa: BLE001 - a view must never stop the sweep
            log.error("progress not shown: %s", error)

    def _release_stranded(self) -> None:
        """Resubmit, unrestricted, a waiting retry whose allowed workers are all gone (a worker
        restarted under a new address): Dask would hold it forever."""
        now = self.clock()
        if now < self._next_stranded_check:
            return
        self._next_stranded_check = now + 2.0
        alive = set(live_workers(self.client))
        self._workers.observe(len(alive), now)
        lost = self._take_and_cancel(lambda table: stranded(
            {k: a.restricted_to for k, a in table.items() if a.started is None}, alive))
        for key, attempt in lost:
            self.progress.attempt_dropped(key)
            self.submit(attempt.job, attempt.number)
        self._fail_unfit(now)

    def _fail_unfit(self, now: float) -> None:
        """Fail what no live worker has the device memory for (its large worker left): a
        waiting attempt, or a model reference with the attempts parked on it, after
        NO_WORKERS_GRACE_S for such a worker to come (back)."""
        if not self.placement.largest:
            return
        room = most_room(self.client)
        waiting = {k: a for k, a in self.attempts.waiting().items()
                   if a.job.device_memory_bytes > room}
        unfit_references = self.references.unfit(room)
        overdue = self._unfit.overdue([*waiting, *unfit_references], now)

        def failed(what: str, need: float) -> JobOutcome:
            message = (f"{what} {int(need):,} bytes of device memory; no worker has had that "
                       f"much for {NO_WORKERS_GRACE_S:g}s (the most now: {int(room):,})")
            return JobOutcome.outside(FailureClass.WORKER_LOST, "NoWorkerFits", message)

        for key, attempt in self._take_and_cancel(lambda table: overdue & set(waiting)):
            log.error("%s: no worker has room for it", key)
            self._finish(attempt, failed("needs", attempt.job.device_memory_bytes), final=True)
        for key in overdue & set(unfit_references):
            log.error("reference %s: no worker has room for it", key)
            for job, number, _, _ in self.references.abandon(key):
                self._finish(Attempt.unsubmitted(job, number),
                             failed("its model's reference needs", unfit_references[key]),
                             final=True)

    def _submit_due_retries(self) -> None:
        for retry in self.delayed.pop_due(self.clock()):
            self.submit(retry.job, retry.attempt, avoid=retry.failed_on)

    def _collect(self, future: Future, result: Any) -> None:
        """Handle one completed future; ``result`` was gathered on the client's event loop (so a
        result whose worker dies meanwhile never blocks this loop)."""
        attempt = self.attempts.pop(str(future.key))
        # Read the status before releasing: releasing the last reference marks it cancelled.
        status = future.status
        future.release()
        if attempt is None:  # an attempt already given up on (timed out) and cancelled
            return
        if status == "finished" and isinstance(result, JobOutcome):
            self._finish(attempt, result)
            return
        error = result[1] if status == "error" else CancelledError(
            f"{future.key} was cancelled")
        job = attempt.job
        lost = worker_went_away(error)
        cut = self.references.was_cut(attempt.reference_key)
        if self.requeues.take(job.id, lost=lost, cut=cut, started=attempt.started is not None,
                              cancelled=isinstance(error, CancelledError)):
            # The worker it was queued on (or its reference's) died before it began, or the
            # scheduler dropped it (a cancellation quantdask did not make): not an attempt of
            # this job, so it is requeued uncounted.
            log.info("%s was dropped before it started (%s); resubmitting", job.id,
                     type(error).__name__)
            self.progress.attempt_dropped(str(future.key))
            self.submit(job, attempt.number)
            return
        if lost and not cut and attempt.worker_name in self.placement.slots:
            # Its nanny's memory event may come after the news of the loss.
            self.kills.await_event((attempt, error), attempt.worker_address, self.clock())
            return
        self._finish_lost(attempt, error, lost, cut)

    def _finish_lost(self, attempt: Attempt, error: BaseException, lost: bool,
                     cut: bool) -> None:
        """An attempt ended without an outcome: killed for memory by its nanny, or ``error``'s."""
        rss = self.kills.rss(attempt.worker_address) if lost else None
        if rss is not None:
            kill = MemoryKill(rss, self.placement.slot(attempt.worker_name, self.client))
            self._finish(attempt, kill.outcome(attempt.worker_name), kill=kill)
            return
        self._finish(attempt, outcome_of_error(
            error, attempt.job, lost=lost, cut=cut, worker=attempt.worker_name,
            in_reference=self.references.failed(attempt.job, attempt.reference_key)))

    def _enforce_deadlines(self) -> None:
        for _, address in self.references.overdue():
            restart_worker(self.client, address, wait=False)
        now = self.clock()
        late = self._take_and_cancel(lambda table: past_deadline(
            {k: (a.started, a.job.timeout_s) for k, a in table.items() if a.started is not None},
            now))
        for key, attempt in late:
            message = (f"no result after timeout_s={attempt.job.timeout_s:g}s on worker "
                       f"{attempt.worker_name}; the worker was restarted")
            log.warning("%s: %s", key, message)
            restart_worker(self.client, attempt.worker_address, wait=False)
            self._finish(attempt, JobOutcome.outside(FailureClass.TIMEOUT, "JobTimeout", message,
                                                     worker=attempt.worker_name))

    def _exclude(self, name: str) -> None:
        """Take a worker whose device keeps failing out of rotation, unless it is the last."""
        reason = self.health.excluded[name]
        if retire_worker(self.client, name):
            log.error("worker %s %s: taken out of rotation", name, reason)
            self.recorder.excluded(name, reason)
        else:
            log.error("worker %s %s, but it is the last one (or gone): kept", name, reason)

    def _give_up_without_workers(self) -> None:
        """With no worker left for NO_WORKERS_GRACE_S, fail what is left instead of waiting."""
        if not self._workers.gone(self.clock()):
            return
        left = self._take_and_cancel(list)
        left += [(r.job.id, Attempt.unsubmitted(r.job, r.attempt))
                 for r in self.delayed.take_all()]
        left += [(attempt_job.id, Attempt.unsubmitted(attempt_job, number))
                 for attempt_job, number, _, _ in self.references.take_parked()]
        message = f"no worker left for {NO_WORKERS_GRACE_S:g}s; the cluster is gone"
        log.error("%s: failing %d jobs", message, len(left))
        for _, attempt in left:
            self._finish(attempt, JobOutcome.outside(FailureClass.WORKER_LOST, "NoWorkers",
                                                     message), final=True)

    def _finish(self, attempt: Attempt, outcome: JobOutcome, final: bool = False,
                kill: MemoryKill | None = None) -> None:
        """Settle an attempt: record it; then retry it (a failure its class retries: see
        ``retry.after_failure``, with the nanny's ``kill`` for memory), or record the job's
        result."""
        job, record = attempt.job, outcome.record
        samples = outcome.device_samples
        self.recorder.attempt(attempt, outcome)
        worker = record.get("worker") or attempt.worker_name
        if outcome.status == Status.FAILED:
            # A failed record always carries its class (the results schema requires it).
            failure = outcome.failure_class or FailureClass.JOB_ERROR
            if worker:
                self.health.failed(worker, job.id, failure)
            decision = after_failure(job, attempt.number, failure, self.sweep.retry_backoff_s,
                                     final, kill, self.placement.room(self.client) if kill else 0)
            self.recorder.decision(attempt, failure, decision.reason)
            if decision.retry and decision.job is not None:
                log.warning("%s attempt %d failed (%s: %s: %s); %s", job.id, attempt.number,
                            outcome.failure_class, record["error_class"],
                            record["error_message"], decision.reason)
                self.delayed.add(self.clock(), decision.delay_s, decision.job,
                                 attempt.number + 1, worker)
                self.progress.attempt_ended(attempt.key, job.id, label(job), attempt.number,
                                            record, final=False)
                self.recorder.samples(samples)
                return
        record = self.recorder.result(attempt, outcome)
        if record["status"] == Status.DONE and worker:  # after the result is safe on disk
            for bad in self.health.succeeded(worker, job.id):
                try:
                    self._exclude(bad)
                except Exception as error:  # noqa: BLE001 - the sweep goes on regardless
                    log.error("could not take worker %s out of rotation: %s", bad, error)
        self.recorder.samples(samples)
        self.progress.attempt_ended(attempt.key, job.id, label(job), attempt.number, record,
                                    final=True)
        if self.on_result is not None:
            self.on_result(record)
