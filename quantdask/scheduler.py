"""Run a sweep on a Dask cluster: one future per job, results persisted as they arrive.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polars as pl
from distributed import Client, Future, as_completed

from quantdask.backends import get_backend
from quantdask.devices import DeviceSampler, drain_this_worker
from quantdask.reference import compute_reference, reference_key
from quantdask.spec import Job, Sweep, expand_grid
from quantdask.store import RunStore
from quantdask.worker import JOB_START_TOPIC, run_job

log = logging.getLogger("quantdask.scheduler")

POLL_S = 0.05
"""How often the driver checks deadlines while no result is ready."""


@dataclass
class _Attempt:
    job: Job
    number: int
    queued_at: dt.datetime
    started: float | None = None  # driver's monotonic clock when the worker began it
    worker_address: str | None = None
    worker_name: str | None = None


def plan_rows(jobs: list[Job]) -> list[dict[str, Any]]:
    """Plain rows describing planned jobs (what ``quantdask plan`` prints and jobs.json holds)."""
    return [
        {"job_id": j.id, "model": j.model.label, "backend": j.backend,
         "config_label": j.config_label, "config": json.dumps(j.options, sort_keys=True),
         "priority": j.priority, "gpu_share": j.gpu_share}
        for j in sorted(jobs, key=lambda j: -j.priority)
    ]


def attempt_key(job: Job, attempt: int) -> str:
    # A Dask key names one computation: a retry needs a key of its own, or Dask hands back the
    # first attempt's (failed) result.
    return job.id if attempt == 1 else f"{job.id}-attempt{attempt}"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _failed_outside(error_class: str, message: str, tb: str = "") -> dict[str, Any]:
    """The record of an attempt that ended outside run_job (worker lost, cancelled, timed out)."""
    return {"status": "failed", "error_class": error_class, "error_message": message,
            "traceback": tb or None, "finished_at": _now(), "log": ""}


class _SweepDriver:
    """The driver's loop for one sweep: submit, collect, retry, enforce deadlines, persist."""

    def __init__(self, client: Client, store: RunStore, on_result):
        self.client = client
        self.store = store
        self.on_result = on_result
        self.attempts: dict[str, _Attempt] = {}
        self.references: dict[str, Future] = {}
        self.pending = as_completed()
        self._lock = threading.Lock()
        self._reference_tries: dict[str, int] = {}
        self._eval_texts: dict[str, str] = {}

    def _reference(self, job: Job) -> Future:
        """The future of ``job``'s model reference: submitted once per model, again only if the
        previous one failed (a job's retry must not inherit a failed dependency)."""
        key = reference_key(job.model, job.eval)
        future = self.references.get(key)
        if future is None or future.status in ("error", "cancelled"):
            tries = self._reference_tries[key] = self._reference_tries.get(key, 0) + 1
            if job.eval.text_path not in self._eval_texts:
                with open(job.eval.text_path, encoding="utf-8") as f:
                    self._eval_texts[job.eval.text_path] = f.read()
            future = self.client.submit(
                compute_reference, job.model, job.eval, self._eval_texts[job.eval.text_path],
                key=key if tries == 1 else f"{key}-retry{tries}", resources=job.resources,
                priority=job.priority + 10, pure=False, retries=0,
            )
            self.references[key] = future
        return future

    def submit(self, job: Job, number: int) -> None:
        key = attempt_key(job, number)
        with self._lock:
            self.attempts[key] = _Attempt(job, number, _now())
        self.pending.add(self.client.submit(
            run_job, job, get_backend(job.backend), number, self._reference(job), key=key,
            resources=job.resources, priority=job.priority, pure=False, retries=0,
        ))

    def _on_job_start(self, event) -> None:
        # Runs on the client's event loop thread: only note when and where the attempt began.
        _, message = event
        with self._lock:
            attempt = self.attempts.get(message["key"])
            if attempt is not None and attempt.started is None:
                attempt.started = time.monotonic()
                attempt.worker_address = message["address"]
                attempt.worker_name = message["name"]

    def run(self, jobs: list[Job]) -> None:
        self.client.register_plugin(DeviceSampler())
        self.client.subscribe_topic(JOB_START_TOPIC, self._on_job_start)
        try:
            for job in jobs:
                self.submit(job, 1)
            while not self.pending.is_empty():
                ready = self.pending.next_batch(block=False) if self.pending.has_ready() else []
                for future in ready:
                    self._collect(future)
                if not ready:
                    self._enforce_deadlines()
                    time.sleep(POLL_S)
        finally:
            self.client.unsubscribe_topic(JOB_START_TOPIC)
        # The idle time since each worker's last job.
        for samples in self.client.run(drain_this_worker).values():
            self.store.write_samples(samples)

    def _collect(self, future: Future) -> None:
        with self._lock:
            attempt = self.attempts.pop(future.key, None)
        if attempt is None:  # an attempt already given up on (timed out) and cancelled
            return
        try:
            record = future.result()
        except Exception as error:  # noqa: BLE001 - the attempt failed outside run_job
            record = _failed_outside(type(error).__name__, str(error) or type(error).__name__,
                                     "".join(traceback.format_exception(error)))
        future.release()
        self._finish(attempt, record)

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [(key, a) for key, a in self.attempts.items()
                    if a.started is not None and now - a.started > a.job.timeout_s]
            for key, _ in late:
                del self.attempts[key]
        for key, attempt in late:
            message = (f"no result after timeout_s={attempt.job.timeout_s:g}s on worker "
                       f"{attempt.worker_name}; the worker was restarted")
            log.warning("%s: %s", key, message)
            Future(key, self.client).cancel()
            self._replace_worker(attempt.worker_address)
            self._finish(attempt, {**_failed_outside("timeout", message),
                                   "worker": attempt.worker_name})

    def _replace_worker(self, address: str | None) -> None:
        # A hung Python thread cannot be interrupted: only a new worker process frees the device.
        try:
            self.client.restart_workers([address], timeout=60)
        except Exception as error:  # noqa: BLE001 - e.g. a worker without a nanny
            log.error("could not restart worker %s after a timeout: %s", address, error)

    def _finish(self, attempt: _Attempt, record: dict[str, Any]) -> None:
        job = attempt.job
        self.store.write_samples(record.pop("device_samples", None) or [])
        _write_logs(self.store, job, attempt.number, record)
        if record["status"] == "failed" and attempt.number <= job.retries:
            log.warning("%s attempt %d failed (%s: %s); retrying", job.id, attempt.number,
                        record["error_class"], record["error_message"])
            self.submit(job, attempt.number + 1)
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
        if self.on_result is not None:
            self.on_result(record)


def run_sweep(
    sweep: Sweep,
    run_dir: str | os.PathLike,
    client: Client,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> pl.DataFrame:
    """Run every job of ``sweep`` not already finished in ``run_dir``; return the sweep's results.

    Each finished job is written to ``run_dir`` as soon as it arrives, so an interrupted sweep
    resumes where it stopped. A failed attempt is retried up to ``sweep.retries`` times under a
    new key; an attempt running past ``sweep.timeout_s`` fails as ``timeout`` and its worker is
    restarted. ``on_result(record)`` is called after each write.
    """
    store = RunStore(run_dir).create()
    jobs = expand_grid(sweep)
    store.write_plan(plan_rows(jobs))
    finished = store.finished_job_ids()
    todo = [job for job in jobs if job.id not in finished]
    log.info("sweep %s: %d jobs, %d already finished, %d to run", sweep.name, len(jobs),
             len(jobs) - len(todo), len(todo))
    _SweepDriver(client, store, on_result).run(todo)
    ids = [job.id for job in jobs]
    return store.read_results().filter(pl.col("job_id").is_in(ids))


def _write_logs(store: RunStore, job: Job, attempt: int, record: dict[str, Any]) -> None:
    text = record.pop("log", "") or (
        f"{_now().isoformat()} ERROR {job.id} attempt={attempt} failed outside the job: "
        f"{record.get('error_class')}: {record.get('error_message')}\n"
    )
    store.append_job_log(job.id, text)
    store.append_worker_log(record.get("worker") or "unknown-worker", text)
