"""Run a sweep on a Dask cluster: one future per job, results persisted as they arrive.

``submit_sweep`` places the jobs, holds the run directory, writes the plan and the session's
row (``start_session``), and runs the driver's loop (``loop.SweepDriver``) over the jobs not
finished yet in a background thread, behind a :class:`~quantdask.run.handle.SweepHandle`;
``run_sweep`` is ``submit_sweep(...).wait()``.

>>> with start_cluster(workers=2) as cluster:  # doctest: +SKIP
...     results = run_sweep(load_sweep("data/demo_sweep.yaml"), "runs/demo", cluster.client)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polars as pl
from distributed import Client

from quantdask.cluster.operations import cluster_capacity, live_workers, workers_elsewhere
from quantdask.plan.lengths import check_lengths
from quantdask.plan.module_names import check_module_names
from quantdask.plan.placement import place_jobs
from quantdask.plan.runtime_tasks import check_runtime_tasks
from quantdask.process.runtime import JOB_START_TOPIC, TASK_END_TOPIC
from quantdask.records import SessionRow
from quantdask.run import LOG_CHANNEL, topics
from quantdask.run.artifacts import prune_to_pareto
from quantdask.run.environment import record_environment
from quantdask.run.handle import Listeners, SweepHandle
from quantdask.run.loop import SweepDriver
from quantdask.run.progress import SweepProgress
from quantdask.run.stages import PreJobStage, StageWatch, stages_for
from quantdask.run.widget import progress_view
from quantdask.run.worker_tasks import WorkerTaskLog
from quantdask.store.run_store import RunStore
from quantdask.sweepfile.sweep import Job, Sweep, expand_grid, plan_rows
from quantdask.util import utcnow
from quantdask.words import ArtifactKeep, Status

log = logging.getLogger(LOG_CHANNEL)


def new_run_id() -> str:
    """A driver session's id: when it started (UTC, to the second) and 6 random hex digits."""
    return f"{dt.datetime.now(dt.UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:6]}"


@dataclass
class SweepSession:
    """One driver session of a sweep on its run directory: prepared (jobs placed, plan and
    session row written, the directory locked) by :func:`start_session`; :meth:`run` runs it
    to its end, records that end and releases the lock."""

    sweep: Sweep
    store: RunStore
    jobs: list[Job]
    todo: list[Job]
    driver: SweepDriver
    row: SessionRow  # the sessions frame's row, as last written
    lock: contextlib.ExitStack

    def run(self) -> None:
        driver, artifacts = self.driver, self.sweep.artifacts
        account = WorkerTaskLog(self.store, self.row.run_id)  # tasks beside the jobs' tries
        topics.subscribe(driver.client, TASK_END_TOPIC, account.on_event)
        topics.subscribe(driver.client, JOB_START_TOPIC, account.on_start)
        ended = threading.Event()
        watcher = account.watch(lambda: live_workers(driver.client), ended)
        try:
            for stage in stages_for(self.sweep):
                if not driver.stop.is_set():
                    self._run_stage(stage)
            if not driver.stop.is_set():  # not cancelled while a search probed
                driver.run(self.todo)
            self.row = dataclasses.replace(self.row, completed=not driver.stop.is_set())
            if (self.row.completed and artifacts is not None
                    and artifacts.keep == ArtifactKeep.PARETO):
                prune_to_pareto(self.store, artifacts)
        finally:
            ended.set()
            watcher.join(timeout=10)
            topics.unsubscribe(driver.client, TASK_END_TOPIC, account.on_event)
            topics.unsubscribe(driver.client, JOB_START_TOPIC, account.on_start)
            try:
                self.store.write_session(dataclasses.replace(self.row, finished_at=utcnow()))
                driver.progress.finish(completed=self.row.completed)
                driver.show_progress(final=True)
            finally:
                self.lock.close()

    def _run_stage(self, stage: PreJobStage) -> None:
        """Run a stage before the jobs (``run.stages``: a search's probes on the cluster,
        watched and cancelled through the driver), then place its jobs beside the others and
        write the plan again: the driver then runs them all."""
        driver = self.driver
        watch = StageWatch(driver.stop, driver.progress, driver.show_progress, self.row.run_id)
        added = stage.run(self.sweep, self.store, driver.client, self.jobs, watch)
        if added is None:  # cancelled while it ran
            return
        finished = self.store.finished_job_ids()
        placement = place_jobs(with_stage_jobs(self.jobs, added), driver.client,
                               self.store.root, finished=finished, stream=self.sweep.stream)
        driver.placement = placement
        known = {job.id for job in self.jobs}
        self.jobs = placement.jobs
        self.store.write_plan(plan_rows(self.jobs))
        self.todo = [job for job in self.jobs if job.id not in finished]
        driver.progress.jobs_added(len(self.jobs))
        driver.progress.already_finished([Status.DONE] * sum(
            job.id in finished and job.id not in known for job in self.jobs))
        self.row = dataclasses.replace(self.row, jobs_planned=len(self.jobs),
                                       jobs_run=len(self.todo))
        self.store.write_session(self.row)

    def results(self) -> pl.DataFrame:
        """The recorded results of this sweep's jobs (those finished so far)."""
        ids = [job.id for job in self.jobs]
        return self.store.read_results().filter(pl.col("job_id").is_in(ids))


def refuse_early(sweep: Sweep) -> list[Job]:
    """``sweep``'s jobs, once what its file and its models' files alone rule out is refused
    (a ``SpecError``): lengths a model cannot take (``lengths.check_lengths``), a config's
    ``modules`` naming a module its model lacks (``module_names.check_module_names``), a task
    a config's own runtime cannot score (``runtime_tasks.check_runtime_tasks``) and each
    stage's own checks (a search's budget below the least its shapes allow)."""
    check_lengths(sweep)
    jobs = expand_grid(sweep)
    check_module_names(jobs)
    check_runtime_tasks(jobs)
    for stage in stages_for(sweep):
        if stage.check is not None:
            stage.check(sweep)
    return jobs


def start_session(sweep: Sweep, run_dir: str | os.PathLike, client: Client,
                  on_result: Callable[[dict[str, Any]], None] | None = None,
                  on_progress: Callable[[SweepProgress], None] | None = None) -> SweepSession:
    """Place ``sweep``'s jobs, lock ``run_dir`` and write the plan and the session's row;
    nothing is submitted yet. Raises before anything is written when the sweep does not suit
    where ``client``'s workers run (``Sweep.check_workers``), when it asks a model for more
    positions than it takes, names a module its model lacks or searches below what its shapes
    allow (:func:`refuse_early`), when a job fits on no worker, and when another driver holds
    the directory."""
    sweep.check_workers(workers_elsewhere(client))
    jobs = refuse_early(sweep)
    finished_before = RunStore(run_dir).finished_job_ids() if os.path.isdir(run_dir) else set()
    placement = place_jobs(jobs, client, run_dir, finished=finished_before, stream=sweep.stream)
    sweep.check_searches_resident(placement.jobs)
    store = RunStore(run_dir).create()
    lock = contextlib.ExitStack()
    lock.enter_context(store.lock())
    try:
        jobs = placement.jobs  # a search's jobs join once it has probed (SweepSession.run)
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
        row = SessionRow(run_id=run_id, sweep=sweep.name, started_at=utcnow(),
                         finished_at=None, completed=False, workers=workers, slots=slots,
                         jobs_planned=len(jobs), jobs_run=len(todo))
        store.write_session(row)
        record_environment(store, run_id, client)
    except BaseException:
        lock.close()
        raise
    return SweepSession(sweep, store, jobs, todo, driver, row, lock)


def with_stage_jobs(jobs: list[Job], added: list[Job]) -> list[Job]:
    """The sweep's jobs and those a stage added (a search's job that is also one of the
    sweep's configs is that config, with its search role)."""
    by_id = {job.id: job for job in jobs}
    for job in added:
        known = by_id.get(job.id)
        by_id[job.id] = job if known is None else dataclasses.replace(known, search=job.search)
    return list(by_id.values())


def submit_sweep(sweep: Sweep, run_dir: str | os.PathLike, client: Client,
                 on_result: Callable[[dict[str, Any]], None] | None = None,
                 on_progress: Callable[[SweepProgress], None] | None = None,
                 reporter: Callable[..., Any] | None = None) -> SweepHandle:
    """Start every job of ``sweep`` not already finished in ``run_dir`` and return at once: a
    :class:`~quantdask.run.handle.SweepHandle` on the sweep, which runs in a background
    thread of this process (as long as the process lives: a script waits with ``.wait()``).

    Each finished job is written to ``run_dir`` as soon as it arrives, so an interrupted sweep
    resumes where it stopped (a second driver on the same run directory is refused, before
    this returns). Failed attempts are retried by failure class up to ``sweep.retries`` times;
    an attempt running past ``sweep.timeout_s`` fails as ``timeout`` and its worker is
    restarted; a worker that fails ``sweep.exclude_device_after`` different jobs in a row is
    retired. Every attempt is recorded (``read_attempts``). ``on_result(record)`` is called
    (from the sweep's thread) after each result is written; ``on_progress(progress)`` a few
    times a second with the live :class:`SweepProgress`, which is also written to
    ``RUN_DIR/progress.json`` for ``quantdask status --watch``. Several sweeps may run on one
    client at once, each on its own run directory. ``reporter`` writes ``handle.report()``
    (``qd.submit_sweep`` passes ``qd.write_report``).
    """
    listeners = Listeners(on_result, on_progress)
    session = start_session(sweep, run_dir, client, listeners.result, listeners.progress)
    return SweepHandle(session, listeners, reporter, view=progress_view).start()


def run_sweep(sweep: Sweep, run_dir: str | os.PathLike, client: Client,
              on_result: Callable[[dict[str, Any]], None] | None = None,
              on_progress: Callable[[SweepProgress], None] | None = None) -> pl.DataFrame:
    """``submit_sweep(...).wait()``: run the sweep to its end here and return its results. An
    interrupt (Ctrl-C) cancels it: nothing keeps running unseen, and the next run resumes."""
    handle = submit_sweep(sweep, run_dir, client, on_result, on_progress)
    try:
        return handle.wait()
    except KeyboardInterrupt:
        handle.cancel()
        raise
