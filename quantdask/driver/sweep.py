"""Run a sweep on a Dask cluster: one future per job, results persisted as they arrive.

The driver submits every job at once (Dask's scheduler places them by resources and priority),
collects results as they complete, records every attempt, retries failures by class (see
``retry``), enforces per-attempt deadlines and takes failing devices out of rotation.

>>> with start_cluster(workers=2) as cluster:  # doctest: +SKIP
...     results = run_sweep(load_sweep("data/demo_sweep.yaml"), "runs/demo", cluster.client)
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import polars as pl
from distributed import Client, Future, as_completed
from distributed.scheduler import KilledWorker

from quantdask.backends import get_backend
from quantdask.cluster.operations import (
    cluster_capacity,
    live_workers,
    restart_worker,
    retire_worker,
)
from quantdask.driver.artifacts import prune_to_pareto
from quantdask.driver.placement import Placement, advertised_memory, place_jobs, workers_with_room
from quantdask.driver.policy import (
    Grace,
    RetryQueue,
    WorkerWatch,
    past_deadline,
    requeue_uncounted,
    stranded,
)
from quantdask.driver.progress import SweepProgress
from quantdask.driver.references import ModelReferences
from quantdask.driver.retry import DeviceHealth, RetryDecision, decide
from quantdask.errors import UnsupportedHere
from quantdask.spec.sweep import Job, Sweep, expand_grid, plan_rows
from quantdask.store.run_store import RunStore
from quantdask.util import utcnow
from quantdask.worker.devices import TELEMETRY_TOPIC, DeviceSampler, drain_this_worker
from quantdask.worker.job import failure_class_of, run_job
from quantdask.worker.runtime import JOB_START_TOPIC

log = logging.getLogger("quantdask.scheduler")

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


@dataclass
class _Attempt:
    job: Job
    number: int
    queued_at: dt.datetime
    key: str
    started: float | None = None  # driver's monotonic clock when the worker began it
    started_at: dt.datetime | None = None
    worker_address: str | None = None
    worker_name: str | None = None
    restricted_to: list[str] = field(default_factory=list)  # worker addresses it may run on
    reference_key: str = ""  # the Dask key of the reference it depends on


def _label(job: Job) -> str:
    return f"{job.model.label} {job.config_label}"



def _failed_outside(failure_class: str, error_class: str, message: str,
                    tb: str = "") -> dict[str, Any]:
    """The record of an attempt that ended outside run_job (worker lost, timed out)."""
    return {"status": "failed", "failure_class": failure_class, "error_class": error_class,
            "error_message": message, "traceback": tb or None, "finished_at": utcnow(), "log": ""}


class _SweepDriver:
    """The driver's loop for one sweep: submit, collect, retry, enforce deadlines, persist."""

    def __init__(self, client: Client, store: RunStore, sweep: Sweep, on_result,
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
        self.run_id = f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"
        self.attempts: dict[str, _Attempt] = {}
        self.references = ModelReferences(client, self.run_id, placement.reference_resources,
                                          clock, slots=lambda: cluster_capacity(
                                              client, sweep.jobs_per_gpu)[1])
        self.delayed = RetryQueue()
        self.health = DeviceHealth(limit=sweep.exclude_device_after)
        self.pending = as_completed(loop=client.loop, with_results=True, raise_errors=False)
        self.requeues: dict[str, int] = {}
        self._lock = threading.Lock()
        self._submissions = 0
        self._backends: dict[str, bytes] = {}
        self._next_stranded_check = 0.0
        self._workers = WorkerWatch(NO_WORKERS_GRACE_S)
        self._submitted: set[str] = set()
        self._unfit = Grace(NO_WORKERS_GRACE_S)  # attempts and references no worker has room for

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
        self.progress.job_queued(job.id, _label(job), job.priority)
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
        # A Dask key names one computation: each resubmission needs a key of its own, or Dask
        # hands back the earlier (failed) result.
        self._submissions += 1
        key = job.id if job.id not in self._submitted else f"{job.id}-{self._submissions}"
        self._submitted.add(job.id)
        elsewhere = ([a for a, name in workers_with_room(
            self.client, job.device_memory_bytes).items() if name != avoid] if avoid else [])
        with self._lock:
            self.attempts[key] = _Attempt(job, number, utcnow(), key, restricted_to=elsewhere,
                                          reference_key=reference.key)
        self.pending.add(self.client.submit(
            run_job, job, self._pickled_backend(job.backend), number, reference, key=key,
            resources=job.resources, priority=job.priority, pure=False, retries=0,
            workers=elsewhere or None,
        ))

    def _on_job_start(self, event) -> None:
        # Runs on the client's event loop thread: only note when and where a task began (again,
        # if a scheduler of its own re-ran it after a worker died).
        _, message = event
        with self._lock:
            attempt = self.attempts.get(message["key"])
            if attempt is not None:
                attempt.started = self.clock()
                attempt.started_at = utcnow()
                attempt.worker_address = message["address"]
                attempt.worker_name = message["name"]
                self.progress.job_started(attempt.key, attempt.job.id, _label(attempt.job),
                                          attempt.job.priority, attempt.number, message["name"])
            else:
                self.references.started(message["key"], message["address"])

    def run(self, jobs: list[Job]) -> None:
        self.client.register_plugin(DeviceSampler())
        # Samples from before this sweep are not its own.
        self.client.run(drain_this_worker, on_error="ignore")
        self.client.subscribe_topic(JOB_START_TOPIC, self._on_job_start)
        self.client.subscribe_topic(TELEMETRY_TOPIC, self._on_telemetry)
        try:
            for job in jobs:
                self.submit(job, 1)
            while not self.pending.is_empty() or self.delayed or self.references.parked:
                ready = self.pending.next_batch(block=False) if self.pending.has_ready() else []
                for future, result in ready:
                    self._collect(future, result)
                self._release_parked()
                self._enforce_deadlines()
                self._submit_due_retries()
                self._release_stranded()
                self._give_up_without_workers()
                self.show_progress()
                if not ready:
                    time.sleep(POLL_S)
        except BaseException:
            # On an error (or an interrupt in a notebook) nothing may keep running unseen.
            with self._lock:
                keys = list(self.attempts)
                self.attempts.clear()
            self.client.cancel([Future(k, self.client) for k in keys]
                               + self.references.all_futures())
            raise
        finally:
            self.client.unsubscribe_topic(JOB_START_TOPIC)
            self.client.unsubscribe_topic(TELEMETRY_TOPIC)
            self.references.release()
        # The idle time since each worker's last job.
        for samples in self.client.run(drain_this_worker, on_error="ignore").values():
            self._write_samples(samples)

    def _on_telemetry(self, event) -> None:
        _, sample = event  # on the client's event loop thread: note it, nothing more
        self.progress.telemetry(sample["name"], sample["device"], sample.get("job_id"),
                                sample.get("memory_used_bytes"))

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
        with self._lock:
            keys = stranded({k: a.restricted_to for k, a in self.attempts.items()
                             if a.started is None}, alive)
            lost = [(key, self.attempts.pop(key)) for key in keys]
        for key, attempt in lost:
            Future(key, self.client).cancel()
            self.progress.attempt_dropped(key)
            self.submit(attempt.job, attempt.number)
        self._fail_unfit(now)

    def _fail_unfit(self, now: float) -> None:
        """Fail what no live worker has the device memory for (its large worker left): a
        waiting attempt, or a model reference with the attempts parked on it, after
        NO_WORKERS_GRACE_S for such a worker to come (back)."""
        if not self.placement.largest:
            return
        room = max((m or 0 for m in advertised_memory(self.client).values()), default=0)
        with self._lock:
            waiting = {k: a for k, a in self.attempts.items()
                       if a.started is None and a.job.device_memory_bytes > room}
        unfit_references = self.references.unfit(room)
        overdue = self._unfit.overdue([*waiting, *unfit_references], now)

        def failed(what: str, need: float) -> dict[str, Any]:
            message = (f"{what} {int(need):,} bytes of device memory; no worker has had that "
                       f"much for {NO_WORKERS_GRACE_S:g}s (the most now: {int(room):,})")
            return _failed_outside("worker_lost", "NoWorkerFits", message)

        for key in overdue & set(waiting):
            with self._lock:
                attempt = self.attempts.pop(key, None)
            if attempt is not None:
                Future(key, self.client).cancel()
                log.error("%s: no worker has room for it", key)
                self._finish(attempt, failed("needs", attempt.job.device_memory_bytes),
                             final=True)
        for key in overdue & set(unfit_references):
            log.error("reference %s: no worker has room for it", key)
            for job, number, _, _ in self.references.abandon(key):
                self._finish(_Attempt(job, number, utcnow(), job.id),
                             failed("its model's reference needs", unfit_references[key]),
                             final=True)

    def _submit_due_retries(self) -> None:
        for retry in self.delayed.pop_due(self.clock()):
            self.submit(retry.job, retry.attempt, avoid=retry.failed_on)

    def _collect(self, future: Future, result: Any) -> None:
        """Handle one completed future; ``result`` was gathered on the client's event loop (so a
        result whose worker dies meanwhile never blocks this loop)."""
        with self._lock:
            attempt = self.attempts.pop(future.key, None)
        # Read the status before releasing: releasing the last reference marks it cancelled.
        status = future.status
        future.release()
        if attempt is None:  # an attempt already given up on (timed out) and cancelled
            return
        if status == "finished" and isinstance(result, dict):
            self._finish(attempt, result)
            return
        error = result[1] if status == "error" else CancelledError(
            f"{future.key} was cancelled")
        job = attempt.job
        lost = isinstance(error, (KilledWorker, CancelledError)) \
            or "CommClosed" in type(error).__name__
        cut = self.references.was_cut(attempt.reference_key)
        if requeue_uncounted(lost, cut, started=attempt.started is not None,
                             cancelled=isinstance(error, CancelledError),
                             requeues=self.requeues.get(job.id, 0), max_requeues=MAX_REQUEUES):
            # The worker it was queued on (or its reference's) died before it began, or the
            # scheduler dropped it (a cancellation quantdask did not make): not an attempt of
            # this job, so it is requeued uncounted.
            self.requeues[job.id] = self.requeues.get(job.id, 0) + 1
            log.info("%s was dropped before it started (%s); resubmitting", job.id,
                     type(error).__name__)
            self.progress.attempt_dropped(future.key)
            self.submit(job, attempt.number)
            return
        if cut:
            record = _failed_outside(
                "timeout", "JobTimeout", f"its model's reference (eval windows and baseline "
                f"log-probs) ran past timeout_s={job.timeout_s:g}s; its worker was restarted")
        elif isinstance(error, UnsupportedHere):
            record = {**_failed_outside("unsupported", type(error).__name__, str(error)),
                      "status": "skipped"}
        else:
            # A failed reference fails each of its model's jobs: one failed attempt each.
            where = ("in its model's reference: "
                     if self.references.failed(job, attempt.reference_key) else "")
            record = _failed_outside(
                "worker_lost" if lost else failure_class_of(error), type(error).__name__,
                where + (str(error) or type(error).__name__),
                "".join(traceback.format_exception(error)))
        record["worker"] = attempt.worker_name
        self._finish(attempt, record)

    def _enforce_deadlines(self) -> None:
        for _, address in self.references.overdue():
            restart_worker(self.client, address, wait=False)
        with self._lock:
            keys = past_deadline({k: (a.started, a.job.timeout_s)
                                  for k, a in self.attempts.items() if a.started is not None},
                                 self.clock())
            late = [(key, self.attempts.pop(key)) for key in keys]
        for key, attempt in late:
            message = (f"no result after timeout_s={attempt.job.timeout_s:g}s on worker "
                       f"{attempt.worker_name}; the worker was restarted")
            log.warning("%s: %s", key, message)
            Future(key, self.client).cancel()
            restart_worker(self.client, attempt.worker_address, wait=False)
            self._finish(attempt, {**_failed_outside("timeout", "JobTimeout", message),
                                   "worker": attempt.worker_name})

    def _exclude(self, name: str) -> None:
        """Take a worker whose device keeps failing out of rotation, unless it is the last."""
        reason = self.health.excluded[name]
        if retire_worker(self.client, name):
            log.error("worker %s %s: taken out of rotation", name, reason)
            self.store.record_excluded_worker(name, reason)
        else:
            log.error("worker %s %s, but it is the last one (or gone): kept", name, reason)

    def _give_up_without_workers(self) -> None:
        """With no worker left for NO_WORKERS_GRACE_S, fail what is left instead of waiting."""
        if not self._workers.gone(self.clock()):
            return
        with self._lock:
            left = list(self.attempts.items())
            self.attempts.clear()
        left += [(r.job.id, _Attempt(r.job, r.attempt, utcnow(), r.job.id))
                 for r in self.delayed.take_all()]
        left += [(attempt_job.id, _Attempt(attempt_job, number, utcnow(), attempt_job.id))
                 for attempt_job, number, _, _ in self.references.take_parked()]
        self.client.cancel([Future(k, self.client) for k, _ in left])
        message = f"no worker left for {NO_WORKERS_GRACE_S:g}s; the cluster is gone"
        log.error("%s: failing %d jobs", message, len(left))
        for _, attempt in left:
            self._finish(attempt, _failed_outside("worker_lost", "NoWorkers", message),
                         final=True)

    def _finish(self, attempt: _Attempt, record: dict[str, Any], final: bool = False) -> None:
        job = attempt.job
        samples = record.pop("device_samples", None) or []
        self.store.append_attempt_log(job.id, attempt.number, record)
        self.store.write_attempt({
            "run_id": self.run_id, "job_id": job.id, "attempt": attempt.number,
            "key": attempt.key, "worker": record.get("worker"),
            "device": record.get("device"), "started_at": record.get("started_at")
            or attempt.started_at, "finished_at": record["finished_at"],
            "status": record["status"], "failure_class": record.get("failure_class"),
            "error_class": record.get("error_class"), "error_message": record.get("error_message"),
            # What this try ran with: an out-of-memory retry asks for more room.
            "eval_batch_size": job.eval.batch_size, "gpu_share": job.gpu_share,
            "device_memory_request_bytes": job.device_memory_bytes or None,
        })
        worker = record.get("worker") or attempt.worker_name
        if record["status"] == "failed":
            if worker:
                self.health.failed(worker, job.id, record["failure_class"])
            decision = decide(job, attempt.number, record["failure_class"],
                              self.sweep.retry_backoff_s)
            if final:
                decision = RetryDecision(False, reason="not retried: no worker left")
            note = (f"{utcnow().isoformat()} WARNING {job.id} attempt={attempt.number} "
                    f"{record['failure_class']}: {decision.reason}\n")
            self.store.append_job_log(job.id, note)
            if decision.retry:
                log.warning("%s attempt %d failed (%s: %s: %s); %s", job.id, attempt.number,
                            record["failure_class"], record["error_class"],
                            record["error_message"], decision.reason)
                self.delayed.add(self.clock(), decision.delay_s, decision.job,
                                 attempt.number + 1, worker)
                self.progress.attempt_ended(attempt.key, job.id, _label(job), attempt.number,
                                            record, final=False)
                self._write_samples(samples)
                return
        record.update(
            job_id=job.id, sweep=job.sweep, model=job.model.label, backend=job.backend,
            config=json.dumps(job.options, sort_keys=True), config_label=job.config_label,
            priority=job.priority, attempts=attempt.number, queued_at=attempt.queued_at,
        )
        layers = record.pop("layers", None) or []
        if record["status"] == "done":
            self.store.write_layers(job.id, layers)
        self.store.write_result(record)
        log.info("%s %s %s: %s", job.id, job.model.label, job.config_label, record["status"])
        if record["status"] == "done" and worker:  # after the result is safe on disk
            for bad in self.health.succeeded(worker, job.id):
                try:
                    self._exclude(bad)
                except Exception as error:  # noqa: BLE001 - the sweep goes on regardless
                    log.error("could not take worker %s out of rotation: %s", bad, error)
        self._write_samples(samples)
        self.progress.attempt_ended(attempt.key, job.id, _label(job), attempt.number, record,
                                    final=True)
        if self.on_result is not None:
            self.on_result(record)

    def _write_samples(self, samples: list[dict[str, Any]]) -> None:
        # Telemetry must never cost a result: a bad batch is logged and dropped.
        try:
            self.store.write_samples(samples)
        except Exception as error:  # noqa: BLE001
            log.error("dropped %d device samples: %s", len(samples), error)


def run_sweep(
    sweep: Sweep,
    run_dir: str | os.PathLike,
    client: Client,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    on_progress: Callable[[SweepProgress], None] | None = None,
) -> pl.DataFrame:
    """Run every job of ``sweep`` not already finished in ``run_dir``; return the sweep's results.

    Each finished job is written to ``run_dir`` as soon as it arrives, so an interrupted sweep
    resumes where it stopped (a second driver on the same run directory is refused). Failed
    attempts are retried by failure class up to ``sweep.retries`` times; an attempt running
    past ``sweep.timeout_s`` fails as ``timeout`` and its worker is restarted; a worker that
    fails ``sweep.exclude_device_after`` different jobs in a row is retired. Every attempt is
    recorded (``read_attempts``). ``on_result(record)`` is called after each result is written;
    ``on_progress(progress)`` a few times a second with the live :class:`SweepProgress`, which
    is also written to ``RUN_DIR/progress.json`` for ``quantdask status --watch``.
    """
    # Before anything is written: a job to run that fits on no worker refuses the whole sweep.
    finished_before = RunStore(run_dir).finished_job_ids() if os.path.isdir(run_dir) else set()
    placement = place_jobs(expand_grid(sweep), client, run_dir, finished=finished_before)
    jobs = placement.jobs
    store = RunStore(run_dir).create()
    with store.lock():
        store.set_aside_unreadable()
        store.write_plan(plan_rows(jobs))
        finished = store.finished_job_ids()
        todo = [job for job in jobs if job.id not in finished]
        log.info("sweep %s: %d jobs, %d already finished, %d to run", sweep.name, len(jobs),
                 len(jobs) - len(todo), len(todo))
        workers, slots = cluster_capacity(client, sweep.jobs_per_gpu)
        progress = SweepProgress(sweep.name, str(run_dir), total=len(jobs),
                                 dashboard_link=client.dashboard_link, slots=slots,
                                 workers=sorted(live_workers(client).values()))
        progress.already_finished(["done"] * (len(jobs) - len(todo)))
        driver = _SweepDriver(client, store, sweep, on_result, progress, on_progress,
                              placement)
        progress.run_id = driver.run_id
        driver.show_progress(final=True)  # a watcher sees this session, not the last one
        session = {"run_id": driver.run_id, "sweep": sweep.name, "started_at": utcnow(),
                   "finished_at": None, "completed": False, "workers": workers, "slots": slots,
                   "jobs_planned": len(jobs), "jobs_run": len(todo)}
        store.write_session(session)
        try:
            driver.run(todo)
            session["completed"] = True
            if sweep.artifacts is not None and sweep.artifacts.keep == "pareto":
                prune_to_pareto(store, sweep.artifacts)
        finally:
            store.write_session({**session, "finished_at": utcnow()})
            progress.finish(completed=session["completed"])
            driver.show_progress(final=True)
        ids = [job.id for job in jobs]
        return store.read_results().filter(pl.col("job_id").is_in(ids))
