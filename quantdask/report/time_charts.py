"""The run's time account as charts: the timeline of every task the run scheduled on a worker
(the jobs' attempts, the references, a search's probes), where each job's time went, and how
both phases of a sweep scaled with the workers (``quantdask scale``)."""

from __future__ import annotations

import altair as alt
import polars as pl

from quantdask.report.charts import JOB_TOOLTIP, UTC_TIME, _empty, _job_order
from quantdask.store.figures import with_job_label
from quantdask.store.summary import worker_spans
from quantdask.words import BASELINE, Status, WorkerTaskKind

PHASE_COLORS = alt.Scale(
    domain=["load", "calibrate", "quantize", "eval", "tasks", "speed", "other"],
    range=["#72b7b2", "#e45756", "#f58518", "#4c78a8", "#b279a2", "#54a24b", "#d3d3d3"])
KIND_COLORS = alt.Scale(domain=[kind.value for kind in WorkerTaskKind],
                        range=["#4c78a8", "#72b7b2", "#b279a2", "#eeca3b", "#f58518", "#54a24b"])
"""The timeline's colour per task kind; a task that did not finish is outlined in red."""


def _task_lanes(attempts: pl.DataFrame, results: pl.DataFrame,
                worker_tasks: pl.DataFrame | None) -> pl.DataFrame:
    """Every task that started (``store.summary.worker_spans``), each with its job's labels
    (a task other than an attempt: its model, and its kind for a config) and its lane."""
    labels = results.select("job_id", "model", "config_label", "backend", "config")
    return (worker_spans(attempts, worker_tasks).join(labels, on="job_id", how="left")
            .with_columns(
                pl.coalesce("model", "label").alias("model"),
                pl.coalesce("config_label", "kind").alias("config_label"),
                pl.concat_str(pl.col("worker").fill_null("?"), pl.lit(" · "),
                              pl.col("device").fill_null("?")).alias("lane"),
                (pl.col("status") != Status.DONE).alias("unfinished"),
                ((pl.col("finished_at") - pl.col("started_at")).dt.total_microseconds() / 1e6)
                .alias("seconds")))


def timeline_chart(attempts: pl.DataFrame, results: pl.DataFrame,
                   worker_tasks: pl.DataFrame | None = None) -> alt.Chart:
    """The run's task stream: one lane per worker and device, a bar per task coloured by its
    kind (a job's attempt; with ``worker_tasks``, the worker_tasks frame, also the references
    and a search's units, reference and probes), outlined in red where it did not finish.
    Drag to zoom in time."""
    data = _task_lanes(attempts, results, worker_tasks)
    if data.is_empty():
        return _empty("no task has started")
    zoom = alt.selection_interval(bind="scales", encodings=["x"])
    return alt.Chart(data).mark_bar(height={"band": 0.7}, strokeWidth=1.5).encode(
        x=alt.X("started_at:T", title="time (UTC)", scale=UTC_TIME,
                axis=alt.Axis(format="%H:%M:%S")),
        x2="finished_at:T",
        y=alt.Y("lane:N", title="worker · device"),
        color=alt.Color("kind:N", scale=KIND_COLORS, title="task"),
        stroke=alt.condition(alt.datum.unfinished, alt.value("#e45756"), alt.value("white")),
        tooltip=[*JOB_TOOLTIP, alt.Tooltip("kind:N", title="task"), alt.Tooltip("attempt:Q"),
                 alt.Tooltip("status:N"), alt.Tooltip("failure_class:N"),
                 alt.Tooltip("seconds:Q", format=".2f"),
                 alt.Tooltip("started_at:T", format="%H:%M:%S.%L UTC", formatType="utc"),
                 alt.Tooltip("finished_at:T", format="%H:%M:%S.%L UTC", formatType="utc")],
    ).add_params(zoom).properties(width=760, title="Timeline: every task on every worker")


def time_breakdown_chart(results: pl.DataFrame) -> alt.Chart:
    """Where each finished job's time went: load, calibrate (a calibrated backend's tuning on
    data), the rest of quantizing, eval, task accuracy, generation speed (and the rest). The
    baseline's eval and tasks ran with its model's reference: their time is shown there."""
    calibrate = pl.col("calibrate_s").fill_null(0.0)
    tasks = pl.col("tasks_s").fill_null(0.0) * (pl.col("backend") != BASELINE)
    speed = pl.col("speed_s").fill_null(0.0)
    data = with_job_label(results).filter(pl.col("status") == Status.DONE).with_columns(
        pl.col("load_s").alias("load"), calibrate.alias("calibrate"),
        (pl.col("quantize_s") - calibrate).clip(lower_bound=0).alias("quantize"),
        pl.col("eval_s").alias("eval"), tasks.alias("tasks"), speed.alias("speed"),
        (pl.col("wall_s") - pl.col("load_s") - pl.col("quantize_s") - pl.col("eval_s") - tasks
         - speed).clip(lower_bound=0).alias("other"))
    if data.is_empty():
        return _empty("no finished jobs: no time breakdown")
    long = data.unpivot(index=["job_id", "job", "model", "config_label", "backend", "config",
                               "wall_s", "source_cached"], on=PHASE_COLORS.domain,
                        variable_name="phase", value_name="seconds")
    return alt.Chart(long).mark_bar().encode(
        y=alt.Y("job:N", sort=_job_order(results), title="job"),
        x=alt.X("seconds:Q", title="time (s)", stack="zero"),
        color=alt.Color("phase:N", scale=PHASE_COLORS, sort=PHASE_COLORS.domain),
        order=alt.Order("phase_order:Q"),
        tooltip=[*JOB_TOOLTIP, alt.Tooltip("phase:N"), alt.Tooltip("seconds:Q", format=".3f"),
                 alt.Tooltip("wall_s:Q", title="job wall s", format=".2f"),
                 alt.Tooltip("source_cached:N", title="model source cached")],
    ).transform_calculate(
        phase_order=f"indexof({PHASE_COLORS.domain!r}, datum.phase)"
    ).properties(width=560, title="Time per job")


PHASES = {"jobs": "jobs (attempts, references)", "search": "search probing"}
"""The phases of a sweep the scaling chart compares, by their columns' prefix."""


def scaling_chart(scaling: pl.DataFrame) -> alt.Chart | alt.HConcatChart:
    """Throughput and efficiency against the number of workers, each run a point and the line
    through each count's median, with the ideal (linear) line; and each phase's own median
    speedup with its spread over the runs (the jobs', and a search's probing where the sweep
    searched)."""
    from quantdask.run.scaling import scaling_summary

    if scaling.is_empty():
        return _empty("no scaling runs recorded")
    summary = scaling_summary(scaling)
    base_workers, base_throughput = summary["workers"][0], summary["throughput_jobs_per_min"][0]
    medians = summary.with_columns(
        (pl.lit(base_throughput) * pl.col("workers") / base_workers).alias("ideal_jobs_per_min"),
        (pl.col("scaling_speedup") / (pl.col("workers") / base_workers))
        .alias("scaling_efficiency"))
    runs = scaling.sort("workers", "repeat") if "repeat" in scaling.columns else scaling
    tooltip = [alt.Tooltip("workers:Q"), alt.Tooltip("jobs:Q"),
               alt.Tooltip("wall_s:Q", title="wall s", format=".1f"),
               alt.Tooltip("makespan_s:Q", title="makespan s", format=".1f"),
               alt.Tooltip("throughput_jobs_per_min:Q", title="jobs/min", format=".2f"),
               alt.Tooltip("scaling_speedup:Q", title="speedup", format=".2f"),
               alt.Tooltip("scaling_efficiency:Q", title="efficiency", format=".0%"),
               *([alt.Tooltip("repeat:Q", title="run"),
                  alt.Tooltip("load_average:Q", title="load average", format=".2f"),
                  alt.Tooltip("other_cpu_share:Q", title="other processes' CPU",
                              format=".0%")] if "load_average" in runs.columns else [])]
    x = alt.X("workers:Q", title="workers",
              axis=alt.Axis(values=summary["workers"].to_list(), format="d"),
              scale=alt.Scale(zero=False, padding=20))
    points = alt.Chart(runs).mark_point(opacity=0.6).encode(x=x, tooltip=tooltip)
    lines = alt.Chart(medians).encode(x=x)
    throughput = alt.Y("throughput_jobs_per_min:Q", title="throughput (jobs per minute)")
    measured = lines.mark_line().encode(y=throughput)
    ideal = lines.mark_line(strokeDash=[5, 3], color="gray").encode(
        y="ideal_jobs_per_min:Q", tooltip=[alt.Tooltip("ideal_jobs_per_min:Q", format=".2f")])
    efficiency = alt.Y("scaling_efficiency:Q", title="scaling efficiency (%)",
                       axis=alt.Axis(format="%"), scale=alt.Scale(domain=[0, 1.1]))
    one = alt.Chart(pl.DataFrame({"y": [1.0]})).mark_rule(color="gray", strokeDash=[5, 3]) \
        .encode(y="y:Q")
    return alt.hconcat(
        alt.layer(ideal, measured, points.encode(y=throughput)).properties(
            width=320, height=240, title="Throughput (points: runs; line: median; dashed: "
                                         "ideal)"),
        alt.layer(one, lines.mark_line(color="#f58518").encode(y=efficiency),
                  points.mark_point(color="#f58518", opacity=0.6).encode(y=efficiency))
        .properties(width=320, height=240, title="Scaling efficiency"),
        _phase_speedup_chart(summary),
    ).properties(title="Scaling")


def _phase_speedup_chart(summary: pl.DataFrame) -> alt.LayerChart | alt.Chart:
    """Each phase's makespan at the fewest workers over its makespan at each count: the median
    over the runs, and a bar from their least to their most."""
    rows = [{"workers": row["workers"], "phase": label,
             "speedup": row[f"{prefix}_scaling_speedup"],
             "least": row[f"{prefix}_scaling_speedup_min"],
             "most": row[f"{prefix}_scaling_speedup_max"],
             "verdict": row[f"{prefix}_scaling_verdict"], "runs": row["runs"]}
            for row in summary.iter_rows(named=True) for prefix, label in PHASES.items()
            if row.get(f"{prefix}_scaling_speedup") is not None]
    if not rows:
        return _empty("no phase recorded its makespan")
    ideal = [{"workers": n, "phase": "ideal", "speedup": n / summary["workers"][0],
              "least": None, "most": None, "verdict": None, "runs": None}
             for n in summary["workers"].to_list()]
    data = alt.Chart(pl.DataFrame(rows + ideal))
    x = alt.X("workers:Q", title="workers", axis=alt.Axis(format="d"),
              scale=alt.Scale(zero=False, padding=20))
    color = alt.Color("phase:N", title="phase")
    line = data.mark_line(point=True).encode(
        x=x, y=alt.Y("speedup:Q", title="speedup of the phase's makespan (median)"),
        color=color,
        strokeDash=alt.condition(alt.datum.phase == "ideal", alt.value([5, 3]), alt.value([1, 0])),
        tooltip=[alt.Tooltip("workers:Q"), alt.Tooltip("phase:N"),
                 alt.Tooltip("speedup:Q", title="median", format=".2f"),
                 alt.Tooltip("least:Q", format=".2f"), alt.Tooltip("most:Q", format=".2f"),
                 alt.Tooltip("runs:Q"), alt.Tooltip("verdict:N")])
    spread = data.transform_filter(alt.datum.least != None).mark_rule().encode(  # noqa: E711
        x=x, y="least:Q", y2="most:Q", color=color)
    return alt.LayerChart(layer=[line, spread]).properties(
        width=320, height=240, title="Speedup per phase (bars: spread over runs; dashed: ideal)")
