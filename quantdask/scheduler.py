"""Run a sweep on a Dask cluster: one future per job, results persisted as they arrive.

>>> with start_cluster(workers=2) as cluster:  # doctest: +SKIP
...     results = run_sweep(load_sweep("data/demo_sweep.yaml"), "runs/demo", cluster.client)
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polars as pl
from distributed import Client, Future, as_completed

from quantdask.backends import get_backend
from quantdask.spec import Job, Sweep, expand_grid
from quantdask.store import RunStore
from quantdask.worker import run_job

log = logging.getLogger("quantdask.scheduler")


@dataclass
class _Attempt:
    job: Job
    number: int
    queued_at: dt.datetime


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


def _lost_record(error: BaseException) -> dict[str, Any]:
    """The record of an attempt whose future failed outside run_job (worker died, cancelled)."""
    return {
        "status": "failed", "error_class": type(error).__name__,
        "error_message": str(error) or type(error).__name__,
        "traceback": "".join(traceback.format_exception(error)),
        "finished_at": dt.datetime.now(dt.UTC), "log": "",
    }


def run_sweep(
    sweep: Sweep,
    run_dir: str | os.PathLike,
    client: Client,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> pl.DataFrame:
    """Run every job of ``sweep`` not already finished in ``run_dir``; return the sweep's results.

    Each finished job is written to ``run_dir`` as soon as it arrives, so an interrupted sweep
    resumes where it stopped. ``on_result(record)`` is called after each write.
    """
    store = RunStore(run_dir).create()
    jobs = expand_grid(sweep)
    store.write_plan(plan_rows(jobs))
    finished = store.finished_job_ids()
    todo = [job for job in jobs if job.id not in finished]
    log.info("sweep %s: %d jobs, %d already finished, %d to run", sweep.name, len(jobs),
             len(jobs) - len(todo), len(todo))
    attempts: dict[str, _Attempt] = {}

    def submit(job: Job, number: int) -> Future:
        key = attempt_key(job, number)
        attempts[key] = _Attempt(job, number, dt.datetime.now(dt.UTC))
        return client.submit(
            run_job, job, get_backend(job.backend), number, key=key,
            resources=job.resources, priority=job.priority, pure=False, retries=0,
        )

    pending = as_completed([submit(job, 1) for job in todo])
    for future in pending:
        attempt = attempts.pop(future.key)
        job = attempt.job
        try:
            record = future.result()
        except Exception as error:  # noqa: BLE001 - the attempt failed outside run_job
            record = _lost_record(error)
        future.release()
        _write_logs(store, job, attempt.number, record)
        if record["status"] == "failed" and attempt.number <= job.retries:
            log.warning("%s attempt %d failed (%s: %s); retrying", job.id, attempt.number,
                        record["error_class"], record["error_message"])
            pending.add(submit(job, attempt.number + 1))
            continue
        record.update(
            job_id=job.id, sweep=job.sweep, model=job.model.label, backend=job.backend,
            config=json.dumps(job.options, sort_keys=True), config_label=job.config_label,
            priority=job.priority, attempts=attempt.number, queued_at=attempt.queued_at,
        )
        store.write_result(record)
        log.info("%s %s %s: %s", job.id, job.model.label, job.config_label, record["status"])
        if on_result is not None:
            on_result(record)
    ids = [job.id for job in jobs]
    return store.read_results().filter(pl.col("job_id").is_in(ids))


def _write_logs(store: RunStore, job: Job, attempt: int, record: dict[str, Any]) -> None:
    text = record.pop("log", "") or (
        f"attempt {attempt} failed outside the job: {record.get('error_class')}: "
        f"{record.get('error_message')}\n"
    )
    store.append_job_log(job.id, text)
    store.append_worker_log(record.get("worker") or "unknown-worker", text)
