"""Summaries computed from the results frames: per device and per sweep.

>>> device_summary(read_results("runs/demo"), read_device_samples("runs/demo"))  # doctest: +SKIP
>>> sweep_summary(read_attempts("runs/demo"), read_sessions("runs/demo"))  # doctest: +SKIP
"""

from __future__ import annotations

import os

import polars as pl

from quantdask.store.run_store import RunStore
from quantdask.words import Status, WorkerTaskKind

DEVICE_SUMMARY_SCHEMA = {
    "worker": pl.String, "device": pl.String, "jobs": pl.UInt32, "attempts": pl.UInt32,
    "tasks": pl.UInt32, "busy_s": pl.Float64, "idle_s": pl.Float64, "utilization": pl.Float64,
    "peak_device_mem_bytes": pl.Int64,
}

SPAN_SCHEMA: dict[str, pl.DataType] = {
    "run_id": pl.String(), "kind": pl.String(), "key": pl.String(), "job_id": pl.String(),
    "attempt": pl.Int64(), "label": pl.String(), "worker": pl.String(), "device": pl.String(),
    "started_at": pl.Datetime("us", "UTC"), "finished_at": pl.Datetime("us", "UTC"),
    "status": pl.String(), "failure_class": pl.String(),
}
"""``worker_spans``' columns: a job's attempt has its ``job_id`` and ``attempt``, another task
its ``label`` (its model)."""

SEARCH_KINDS = (WorkerTaskKind.SEARCH_UNITS, WorkerTaskKind.SEARCH_REFERENCE,
                WorkerTaskKind.PROBE, WorkerTaskKind.FISHER_PASS, WorkerTaskKind.OFFSPRING)
"""The tasks of a search's probing phase (before its jobs)."""


def worker_spans(attempts: pl.DataFrame,
                 worker_tasks: pl.DataFrame | None = None) -> pl.DataFrame:
    """Every task the run kept a worker busy with, one row each (``SPAN_SCHEMA``): the jobs'
    attempts (kind ``job``) and, from the worker_tasks frame, the references, baseline tasks
    and a search's units, reference and probes (``words.WorkerTaskKind``). Those that
    started only."""
    jobs = _spans(attempts.filter(pl.col("started_at").is_not_null())
                  .with_columns(pl.lit(WorkerTaskKind.JOB.value).alias("kind")))
    if worker_tasks is None or worker_tasks.is_empty():
        return jobs
    return pl.concat([jobs, _spans(worker_tasks)]).sort("started_at")


def _spans(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` in ``SPAN_SCHEMA``: the columns it lacks null."""
    return frame.with_columns(pl.lit(None, kind).alias(name) for name, kind in SPAN_SCHEMA.items()
                              if name not in frame.columns
                              ).select(list(SPAN_SCHEMA)).cast(SPAN_SCHEMA)  # type: ignore[arg-type]


def _busy_seconds(intervals: list[tuple]) -> float:
    """The length of the union of (start, end) intervals: jobs sharing a device at once
    (``jobs_per_gpu`` > 1) keep it busy once, not twice."""
    busy, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            busy += (end - start).total_seconds()
            reach = end
        elif end > reach:
            busy += (end - reach).total_seconds()
            reach = end
    return busy


def device_summary(results: pl.DataFrame, samples: pl.DataFrame | None = None,
                   attempts: pl.DataFrame | None = None,
                   worker_tasks: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per (worker, device): jobs, attempts and other tasks run, busy and idle seconds,
    utilization, peak memory.

    Busy time is the time the device ran at least one task: with ``attempts``, every try
    (failed ones too) and every other task the run scheduled on it (``worker_tasks``: the
    references, a search's probes); else each job's recorded run. Idle time is the rest of the
    sweep's window: per driver session, first start -> last finish over all workers and
    tasks, so a device that waited while others worked shows it, and the hours between two
    sessions of a resumed run do not count. With ``samples``, the sampled utilization (mean)
    and memory (peak) are added.
    """
    if attempts is not None and not attempts.is_empty():
        source = worker_spans(attempts, worker_tasks)
    else:
        source = results.with_columns(pl.lit(WorkerTaskKind.JOB.value).alias("kind"))
        if "run_id" not in source.columns:
            source = source.with_columns(pl.lit("").alias("run_id"))
    ran = source.filter(pl.col("started_at").is_not_null() & pl.col("worker").is_not_null())
    if ran.is_empty():
        return pl.DataFrame(schema=DEVICE_SUMMARY_SCHEMA)
    windows = ran.group_by("run_id").agg(pl.col("started_at").min(),
                                         pl.col("finished_at").max())
    window_s = sum((end - start).total_seconds() for start, end
                   in windows.select("started_at", "finished_at").iter_rows())
    rows = []
    for (worker, device), group in ran.group_by("worker", "device"):
        busy = sum(_busy_seconds(list(run.select("started_at", "finished_at").iter_rows()))
                   for _, run in group.group_by("run_id"))
        is_job = pl.col("kind") == WorkerTaskKind.JOB
        rows.append({"worker": worker, "device": device,
                     "jobs": group.filter(is_job)["job_id"].n_unique(),
                     "attempts": group.filter(is_job).height,
                     "tasks": group.filter(~is_job).height, "busy_s": busy,
                     "idle_s": max(0.0, window_s - busy),
                     "utilization": busy / window_s if window_s > 0 else 1.0})
    peaks = results.filter(pl.col("worker").is_not_null()).group_by("worker", "device").agg(
        pl.col("peak_device_mem_bytes").max())
    summary = (pl.DataFrame(rows, schema={k: v for k, v in DEVICE_SUMMARY_SCHEMA.items()
                                          if k != "peak_device_mem_bytes"})
               .join(peaks, on=["worker", "device"], how="left")
               .select(list(DEVICE_SUMMARY_SCHEMA))
               # polars types cast's Mapping with a union key type, which no dict[str, ...] meets
               .cast(DEVICE_SUMMARY_SCHEMA)  # type: ignore[arg-type]
               .sort("worker"))
    if samples is not None and not samples.is_empty():
        sampled = samples.group_by("worker", "device").agg(
            pl.col("utilization_pct").mean().alias("sampled_utilization_pct"),
            pl.col("memory_used_bytes").max().alias("sampled_peak_memory_bytes"),
            pl.len().alias("samples"),
        )
        summary = summary.join(sampled, on=["worker", "device"], how="left")
    return summary


def _seconds(end: str | pl.Expr, start: str | pl.Expr) -> pl.Expr:
    """Seconds from ``start`` to ``end`` (columns, by name or expression)."""
    end, start = (pl.col(c) if isinstance(c, str) else c for c in (end, start))
    return (end - start).dt.total_microseconds() / 1e6


SWEEP_SUMMARY_SCHEMA = {
    "run_id": pl.String, "workers": pl.Int64, "slots": pl.Int64, "jobs": pl.UInt32,
    "done": pl.UInt32, "attempts": pl.UInt32, "tasks": pl.UInt32, "wall_s": pl.Float64,
    "makespan_s": pl.Float64, "work_s": pl.Float64, "longest_task_s": pl.Float64,
    "throughput_jobs_per_min": pl.Float64, "speedup": pl.Float64, "efficiency": pl.Float64,
    "lower_bound_s": pl.Float64, "makespan_vs_lower_bound": pl.Float64,
    "search_work_s": pl.Float64, "search_makespan_s": pl.Float64, "search_speedup": pl.Float64,
    "jobs_work_s": pl.Float64, "jobs_makespan_s": pl.Float64, "jobs_speedup": pl.Float64,
}


def _phase(spans: pl.DataFrame, name: str, searching: pl.Expr) -> pl.DataFrame:
    """Per session: the work, makespan and speedup of the spans ``searching`` picks."""
    return (spans.filter(searching).group_by("run_id").agg(
        pl.col("run_s").sum().alias(f"{name}_work_s"),
        _seconds(pl.col("finished_at").max(), pl.col("started_at").min())
        .alias(f"{name}_makespan_s"))
        .with_columns((pl.col(f"{name}_work_s") / pl.col(f"{name}_makespan_s"))
                      .alias(f"{name}_speedup")))


def _with_sessions(per_run: pl.DataFrame, sessions: pl.DataFrame | None) -> pl.DataFrame:
    """``per_run`` with each session's workers, slots, start and end (null where unrecorded)."""
    if sessions is not None and not sessions.is_empty():
        return per_run.join(
            sessions.select("run_id", "workers", "slots", "started_at", "finished_at"),
            on="run_id", how="left")
    return per_run.with_columns(
        pl.lit(None, pl.Int64).alias(c) for c in ("workers", "slots")).with_columns(
        pl.lit(None, pl.Datetime("us", "UTC")).alias(c) for c in ("started_at", "finished_at"))


def sweep_summary(attempts: pl.DataFrame, sessions: pl.DataFrame | None = None,
                  worker_tasks: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per driver session that ran tasks: how well the cluster was used. Every task
    the session kept a worker busy with counts: the jobs' attempts, and with ``worker_tasks``
    (the worker_tasks frame) the references and a search's units, reference and probes.

    - ``makespan_s``: first task started -> last task finished;
    - ``wall_s``: what the user waited, ``run_sweep`` called -> returned (so also the driver's
      own start and end); the makespan when the session was not recorded;
    - ``work_s``: the sum of every task's run time (failed tries are work too);
    - ``throughput_jobs_per_min``: jobs tried (done, failed or skipped) per minute of wall time;
    - ``speedup`` = work / makespan; ``efficiency`` = speedup / slots;
    - ``lower_bound_s`` = max(longest task, work / slots): no schedule can beat it, so
      ``makespan_vs_lower_bound`` (>= 1) says how far from perfect packing the sweep ran;
    - ``search_*``: the same for a search's probing alone (null without one), ``jobs_*`` for
      the rest (attempts, references): each phase's own speedup beside the other's.
    """
    spans = worker_spans(attempts, worker_tasks).with_columns(
        _seconds("finished_at", "started_at").alias("run_s"))
    if spans.is_empty():
        return pl.DataFrame(schema=SWEEP_SUMMARY_SCHEMA)
    is_job = pl.col("kind") == WorkerTaskKind.JOB
    per_run = spans.group_by("run_id").agg(
        pl.col("job_id").filter(is_job).n_unique().alias("jobs"),
        pl.col("job_id").filter(is_job & (pl.col("status") == Status.DONE)).n_unique()
        .alias("done"),
        is_job.sum().alias("attempts"),
        (~is_job).sum().alias("tasks"),
        pl.col("run_s").sum().alias("work_s"),
        pl.col("run_s").max().alias("longest_task_s"),
        pl.col("started_at").min().alias("first_start"),
        pl.col("finished_at").max().alias("last_finish"),
        pl.col("worker").n_unique().alias("workers_seen"),
    )
    searching = pl.col("kind").is_in([kind.value for kind in SEARCH_KINDS])
    for name, picked in (("search", searching), ("jobs", ~searching)):
        per_run = per_run.join(_phase(spans, name, picked), on="run_id", how="left")
    per_run = _with_sessions(per_run, sessions)
    makespan = _seconds("last_finish", "first_start")
    wall = pl.when(pl.col("finished_at").is_not_null()).then(
        _seconds("finished_at", "started_at")).otherwise(makespan)
    return (
        per_run.with_columns(
            # Workers that joined after the session started (an external cluster still
            # scaling up) ran jobs too: never count fewer slots than workers seen.
            pl.max_horizontal("workers", pl.col("workers_seen").cast(pl.Int64)),
            pl.max_horizontal("slots", pl.col("workers_seen").cast(pl.Int64)),
            makespan.alias("makespan_s"), wall.alias("wall_s"))
        .with_columns(
            (pl.col("jobs") / pl.col("wall_s") * 60).alias("throughput_jobs_per_min"),
            (pl.col("work_s") / pl.col("makespan_s")).alias("speedup"),
            pl.max_horizontal("longest_task_s", pl.col("work_s") / pl.col("slots"))
            .alias("lower_bound_s"))
        .with_columns(
            (pl.col("speedup") / pl.col("slots")).alias("efficiency"),
            (pl.col("makespan_s") / pl.col("lower_bound_s")).alias("makespan_vs_lower_bound"))
        .sort("first_start")
        .select(list(SWEEP_SUMMARY_SCHEMA))
        .cast(SWEEP_SUMMARY_SCHEMA)  # type: ignore[arg-type]  # polars' Mapping key (above)
    )


def job_status(run_dir: str | os.PathLike) -> pl.DataFrame:
    """One row per planned job of ``run_dir`` with its status (``pending`` when not recorded)."""
    store = RunStore(run_dir)
    plan = store.read_plan()
    results = store.read_results().select("job_id", "status", "attempts", "worker", "wall_s",
                                          "perplexity", "failure_class", "error_message")
    if not plan:
        return results.with_columns(pl.lit(None, pl.String).alias("config_label"))
    planned = pl.DataFrame(plan).select("job_id", "model", "backend", "config_label", "priority")
    return (planned.join(results, on="job_id", how="left")
            .with_columns(pl.col("status").fill_null("pending")))


def failures_table(results: pl.DataFrame) -> pl.DataFrame:
    """The jobs that did not finish: status, class, attempts and the first line of the error."""
    return (results.filter(pl.col("status") != Status.DONE)
            .select("job_id", "model", "config_label", "status", "failure_class", "attempts",
                    "error_class",
                    pl.col("error_message").str.split("\n").list.first().alias("reason"))
            .sort("status", "model", "config_label"))


def phases_table(results: pl.DataFrame, phases: pl.DataFrame) -> pl.DataFrame:
    """Where each done job spent its time, from the phases frame: one row per job, the seconds
    of each phase in a column of its own (in the jobs' order; null where a job did not run
    it), and the phase that set the job's peak device memory with that peak.

    >>> phases_table(read_results("runs/demo"), read_frame("runs/demo", "phases"))  # doctest: +SKIP
    """
    if phases.is_empty():
        return pl.DataFrame(schema={"model": pl.String, "config_label": pl.String})
    order = phases.group_by("phase").agg(pl.col("position").min()).sort("position")["phase"]
    seconds = phases.pivot(on="phase", index="job_id", values="seconds")
    peak = (phases.sort("peak_device_mem_bytes", descending=True, nulls_last=True)
            .group_by("job_id", maintain_order=True).first()
            .select("job_id", pl.col("phase").alias("peak_phase"), "peak_device_mem_bytes"))
    jobs = results.select("job_id", "model", "config_label", "wall_s")
    return (jobs.join(seconds, on="job_id").join(peak, on="job_id")
            .select("model", "config_label", "wall_s", *order, "peak_phase",
                    "peak_device_mem_bytes")
            .sort("model", "config_label"))
