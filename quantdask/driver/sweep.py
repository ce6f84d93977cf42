"""Run a sweep on a Dask cluster: one future per job, results persisted as they arrive.

``run_sweep`` places the jobs, holds the run directory, writes the plan and the session's row,
and runs the driver's loop (``loop.SweepDriver``) over the jobs not finished yet.

>>> with start_cluster(workers=2) as cluster:  # doctest: +SKIP
...     results = run_sweep(load_sweep("data/demo_sweep.yaml"), "runs/demo", cluster.client)
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

import polars as pl
from distributed import Client

from quantdask.cluster.operations import cluster_capacity, live_workers
from quantdask.driver import LOG_CHANNEL
from quantdask.driver.artifacts import prune_to_pareto
from quantdask.driver.loop import SweepDriver
from quantdask.driver.placement import place_jobs
from quantdask.driver.progress import SweepProgress
from quantdask.spec.sweep import Sweep, expand_grid, plan_rows
from quantdask.store.run_store import RunStore
from quantdask.util import utcnow
from quantdask.worker.outcome import Status

log = logging.getLogger(LOG_CHANNEL)


def new_run_id() -> str:
    """A driver session's id: when it started (UTC, to the second) and 6 random hex digits."""
    return f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


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
        run_id = new_run_id()
        progress = SweepProgress(sweep.name, str(run_dir), total=len(jobs),
                                 dashboard_link=client.dashboard_link, slots=slots,
                                 workers=sorted(live_workers(client).values()), run_id=run_id)
        progress.already_finished([Status.DONE] * (len(jobs) - len(todo)))
        driver = SweepDriver(client, store, sweep, run_id, on_result, progress, on_progress,
                             placement)
        driver.recorder.restamp_gates()
        driver.show_progress(final=True)  # a watcher sees this session, not the last one
        session = {"run_id": run_id, "sweep": sweep.name, "started_at": utcnow(),
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
