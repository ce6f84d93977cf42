"""Altair charts of a sweep: each a function from the Polars frames of a run directory to a chart.

Every chart is interactive (tooltips carry the full config; drag to zoom where it helps) and
draws every job it is given. ``failures_table`` lists the jobs that did not finish.

>>> results, layers = read_results("runs/demo"), read_layers("runs/demo")  # doctest: +SKIP
>>> quality_chart(results) | layer_error_heatmap(results, layers)  # doctest: +SKIP
"""

from __future__ import annotations

import datetime as dt
from typing import cast

import altair as alt
import polars as pl

from quantdask.store.figures import with_job_label, with_quality_text
from quantdask.store.frontier import pareto_frontier
from quantdask.store.summary import device_summary
from quantdask.words import BASELINE, Status

MIB = 1024 * 1024
UTC_TIME = alt.Scale(type="utc")  # the frames hold UTC: show UTC whatever the reader's zone
# A sweep of a large model has thousands of per-layer rows; the charts inline them all (the
# sample series is thinned first), so Altair's 5000-row guard would only break big reports.
alt.data_transformers.disable_max_rows()
STATUS_COLORS = alt.Scale(domain=[status.value for status in Status],
                          range=["#4c78a8", "#e45756", "#bab0ac"])
PHASE_COLORS = alt.Scale(
    domain=["load", "calibrate", "quantize", "eval", "tasks", "speed", "other"],
    range=["#72b7b2", "#e45756", "#f58518", "#4c78a8", "#b279a2", "#54a24b", "#d3d3d3"])
JOB_TOOLTIP = [alt.Tooltip("model:N"), alt.Tooltip("config_label:N", title="config"),
               alt.Tooltip("backend:N"), alt.Tooltip("config:N", title="options"),
               alt.Tooltip("job_id:N")]


def _empty(message: str) -> alt.Chart:
    """A chart that says why there is nothing to draw (rather than a blank or broken one)."""
    return alt.Chart(pl.DataFrame({"message": [message]})).mark_text(
        fontSize=14, color="gray").encode(text="message:N").properties(width=400, height=40)


def _job_order(results: pl.DataFrame) -> list[str]:
    """Job labels per model, from the largest config to the smallest (baseline first)."""
    ordered = with_job_label(results).sort(
        pl.col("model"), pl.col("backend") != BASELINE, pl.col("bits_per_weight"),
        pl.col("config_label"), descending=[False, False, True, False], nulls_last=True)
    return list(dict.fromkeys(ordered["job"].to_list()))


QUALITY_TOOLTIP = [*JOB_TOOLTIP, alt.Tooltip("bits_per_weight:Q", format=".3f"),
                   alt.Tooltip("bits_per_quantized_weight:Q", format=".3f",
                               title="bits per quantized weight"),
                   alt.Tooltip("unquantized_dtypes:N", title="the rest is"),
                   alt.Tooltip("quantized_share:Q", title="share of weights quantized",
                               format=".1%"),
                   alt.Tooltip("size_mib:Q", title="size MiB", format=".2f"),
                   alt.Tooltip("ppl:N", title="perplexity"),
                   alt.Tooltip("kl:N", title="KL nats/token"),
                   alt.Tooltip("kl_kind:N", title="KL is"),
                   alt.Tooltip("top1:N", title="top-1 agreement"),
                   alt.Tooltip("kind:N"), alt.Tooltip("tied_with:N", title="tied on it with")]


def _with_error_bars(done: pl.DataFrame) -> pl.DataFrame:
    """``done`` with the quality text columns, the size in MiB, and each metric's error bar
    ends (``<metric>_lo``, ``<metric>_hi``): one standard error either side, ln PPL's on
    perplexity (so asymmetric there)."""
    ln_ppl_se, kl_se = pl.col("ln_ppl_se").fill_null(0), pl.col("kl_se").fill_null(0)
    return with_quality_text(done).with_columns(
        (pl.col("size_bytes") / MIB).alias("size_mib"),
        (pl.col("perplexity") * (-ln_ppl_se).exp()).alias("perplexity_lo"),
        (pl.col("perplexity") * ln_ppl_se.exp()).alias("perplexity_hi"),
        (pl.col("kl_divergence") - kl_se).clip(lower_bound=0).alias("kl_divergence_lo"),
        (pl.col("kl_divergence") + kl_se).alias("kl_divergence_hi"))


def quality_chart(results: pl.DataFrame,
                  windows: pl.DataFrame | None = None) -> alt.Chart | alt.VConcatChart:
    """Quality against size: bits per weight (the whole model as stored) against perplexity and
    against KL divergence, each point with its error bar (one standard error).

    The Pareto frontier (smallest size for its KL, tied configs not ranked, paired over the
    per-window rows ``windows`` when given: see ``pareto_frontier``) is drawn as a line through
    its configs, the unquantized baseline as a dashed rule; drag to pan, scroll to zoom.
    """
    data = _with_error_bars(results.filter(pl.col("status") == Status.DONE))
    if data.is_empty():
        return _empty("no finished jobs: nothing to compare")
    tooltip = QUALITY_TOOLTIP

    panels: list[str] = []

    def panel(data: pl.DataFrame, metric: str, title: str) -> alt.LayerChart | alt.FacetChart:
        # Each panel's frontier is its own: smallest size for its perplexity, or for its KL.
        # Perplexity is ranked by ln(PPL ratio): the same order within a model, with a paired
        # error over the windows (ties).
        ranked_by = "ln_ppl_ratio" if metric == "perplexity" else metric
        data = pareto_frontier(data, loss=ranked_by, windows=windows).with_columns(
            pl.when(pl.col("backend") == BASELINE).then(pl.lit("baseline"))
            .when(pl.col("pareto")).then(pl.lit("Pareto frontier"))
            .otherwise(pl.lit("dominated")).alias("kind"))
        base = alt.Chart(data).encode(
            x=alt.X("bits_per_weight:Q", title="bits per weight (whole model, as stored)",
                    scale=alt.Scale(zero=False, padding=12)))
        error_bars = base.mark_rule(strokeWidth=2, opacity=0.6).encode(
            y=f"{metric}_lo:Q", y2=f"{metric}_hi:Q", color=alt.Color("backend:N"),
            tooltip=tooltip)
        points = base.mark_point(size=90, filled=True).encode(
            y=alt.Y(f"{metric}:Q", title=title, scale=alt.Scale(zero=False, padding=12)),
            color=alt.Color("backend:N"),
            shape=alt.Shape("kind:N", scale=alt.Scale(
                domain=["baseline", "Pareto frontier", "dominated"],
                range=["diamond", "circle", "triangle-up"])),
            tooltip=tooltip,
        )
        frontier = base.transform_filter(alt.datum.kind != "dominated").mark_line(
            color="black", strokeDash=[4, 2], opacity=0.5).encode(
            y=f"{metric}:Q", detail="model:N", order="bits_per_weight:Q")
        baseline = alt.Chart(data.filter(pl.col("backend") == BASELINE)).mark_rule(
            color="gray", strokeDash=[6, 3]).encode(y=f"{metric}:Q", tooltip=tooltip)
        panels.append(metric)  # each panel zooms on its own: its selection has its own name
        zoom = alt.selection_interval(bind="scales", name=f"zoom_quality_{len(panels)}")
        model = data["model"][0]
        return alt.layer(frontier, baseline, error_bars, points.add_params(zoom)).properties(
            width=360, height=260, title=f"{model}: {title} vs bits per weight")

    # One row of panels per model: perplexities of different models do not share a scale.
    return alt.vconcat(*[
        alt.hconcat(panel(model_data, "perplexity", "perplexity (no unit)"),
                    panel(model_data, "kl_divergence", "KL divergence (nats/token)"))
        for _, model_data in data.group_by("model", maintain_order=True)
    ]).properties(title="Quality vs size (lower left is better)")


def layer_error_heatmap(results: pl.DataFrame,
                        layers: pl.DataFrame) -> alt.Chart | alt.VConcatChart:
    """Per-layer error, layer x config: pick the weight or output relative error."""
    data = layers.join(results.select("job_id", "model", "config_label", "backend", "config"),
                       on="job_id", how="inner")
    if data.is_empty():
        return _empty("no per-layer errors recorded")
    metrics = ["weight_rel_error", "output_rel_error"]
    long = data.unpivot(index=[c for c in data.columns if c not in metrics],
                        on=metrics, variable_name="metric", value_name="error").filter(
        pl.col("error").is_not_null())
    metric = alt.param(name="layer_metric", value="weight_rel_error", bind=alt.binding_select(
        options=metrics, labels=["weight rel. error", "output rel. error"], name="error: "))
    layer_order = (data.group_by("layer").agg(pl.col("position").min())
                   .sort("position")["layer"].to_list())

    def heatmap(model_long: pl.DataFrame) -> alt.Chart:
        # Every column named by its config's label, none dropped for lack of room.
        return alt.Chart(model_long).mark_rect().encode(
            x=alt.X("config_label:N", title="config",
                    sort=_job_order(results.filter(pl.col("model") == model_long["model"][0])),
                    axis=alt.Axis(labelAngle=-35, labelOverlap=False, labelLimit=240,
                                  orient="bottom")),
            y=alt.Y("layer:N", sort=layer_order, title="layer (in network order)"),
            color=alt.Color("error:Q", title="relative error (‖Δ‖ / ‖·‖, no unit)",
                            scale=alt.Scale(scheme="orangered")),
            tooltip=[alt.Tooltip("layer:N"), alt.Tooltip("in_features:Q"),
                     alt.Tooltip("out_features:Q"), alt.Tooltip("metric:N"),
                     alt.Tooltip("error:Q", format=".4g"),
                     alt.Tooltip("weight_sqnr_db:Q", title="weight SQNR dB", format=".1f"),
                     *JOB_TOOLTIP],
        ).transform_filter(alt.datum.metric == metric).properties(
            title=f"{model_long['model'][0]}: per-layer error (pick the metric below)")

    # One heatmap per model (their layers differ); the metric picker is shared.
    return alt.vconcat(*[heatmap(model_long) for _, model_long
                         in long.group_by("model", maintain_order=True)]).add_params(metric)


def _attempt_lanes(attempts: pl.DataFrame, results: pl.DataFrame) -> pl.DataFrame:
    labels = results.select("job_id", "model", "config_label", "backend", "config")
    return (attempts.filter(pl.col("started_at").is_not_null())
            .join(labels, on="job_id", how="left")
            .with_columns(
                pl.concat_str(pl.col("worker").fill_null("?"), pl.lit(" · "),
                              pl.col("device").fill_null("?")).alias("lane"),
                ((pl.col("finished_at") - pl.col("started_at")).dt.total_microseconds() / 1e6)
                .alias("seconds")))


def timeline_chart(attempts: pl.DataFrame, results: pl.DataFrame) -> alt.Chart:
    """The sweep's task stream: one lane per worker and device, a bar per attempt coloured by
    how it ended. Drag to zoom in time."""
    data = _attempt_lanes(attempts, results)
    if data.is_empty():
        return _empty("no attempt has started")
    zoom = alt.selection_interval(bind="scales", encodings=["x"])
    return alt.Chart(data).mark_bar(height={"band": 0.7}, stroke="white", strokeWidth=0.5).encode(
        x=alt.X("started_at:T", title="time (UTC)", scale=UTC_TIME,
                axis=alt.Axis(format="%H:%M:%S")),
        x2="finished_at:T",
        y=alt.Y("lane:N", title="worker · device"),
        color=alt.Color("status:N", scale=STATUS_COLORS),
        tooltip=[*JOB_TOOLTIP, alt.Tooltip("attempt:Q"), alt.Tooltip("status:N"),
                 alt.Tooltip("failure_class:N"), alt.Tooltip("seconds:Q", format=".2f"),
                 alt.Tooltip("started_at:T", format="%H:%M:%S.%L UTC", formatType="utc"),
                 alt.Tooltip("finished_at:T", format="%H:%M:%S.%L UTC", formatType="utc")],
    ).add_params(zoom).properties(width=760, title="Timeline: every attempt on every worker")


def job_memory_chart(results: pl.DataFrame) -> alt.Chart:
    """Peak device memory (and host RSS) of each finished job."""
    data = with_job_label(results).filter(pl.col("status") == Status.DONE).with_columns(
        (pl.col("peak_device_mem_bytes") / MIB).alias("device MiB"),
        (pl.col("peak_host_rss_bytes") / MIB).alias("host RSS MiB"))
    if data.is_empty():
        return _empty("no finished jobs: no memory peaks")
    long = data.unpivot(index=["job_id", "job", "model", "config_label", "backend", "config",
                               "device", "worker"], on=["device MiB", "host RSS MiB"],
                        variable_name="memory", value_name="MiB")
    return alt.Chart(long).mark_bar().encode(
        y=alt.Y("job:N", sort=_job_order(results), title="job"),
        yOffset="memory:N",
        x=alt.X("MiB:Q", title="peak memory (MiB)"),
        color=alt.Color("memory:N", title=None),
        tooltip=[*JOB_TOOLTIP, alt.Tooltip("worker:N"), alt.Tooltip("device:N"),
                 alt.Tooltip("memory:N"), alt.Tooltip("MiB:Q", format=".1f")],
    ).properties(width=360, title="Peak memory per job")


def device_memory_chart(results: pl.DataFrame, samples: pl.DataFrame) -> alt.Chart:
    """Peak memory per worker and device (from its jobs and its samples)."""
    summary = device_summary(results, samples)
    if summary.is_empty():
        return _empty("no jobs ran: no per-device memory")
    peak = pl.col("peak_device_mem_bytes")
    if "sampled_peak_memory_bytes" in summary.columns:
        peak = pl.max_horizontal(peak, pl.col("sampled_peak_memory_bytes"))
    data = summary.with_columns(
        (peak / MIB).alias("peak MiB"),
        pl.concat_str("worker", pl.lit(" · "), "device").alias("lane"))
    return alt.Chart(data).mark_bar().encode(
        y=alt.Y("lane:N", title="worker · device"),
        x=alt.X("peak MiB:Q", title="peak memory (MiB)"),
        tooltip=[alt.Tooltip("worker:N"), alt.Tooltip("device:N"), alt.Tooltip("jobs:Q"),
                 alt.Tooltip("busy_s:Q", format=".1f"), alt.Tooltip("idle_s:Q", format=".1f"),
                 alt.Tooltip("utilization:Q", format=".0%"),
                 alt.Tooltip("peak MiB:Q", format=".1f")],
    ).properties(width=360, title="Peak memory per device")


def _thin(samples: pl.DataFrame, max_rows: int = 4000) -> pl.DataFrame:
    """At most about ``max_rows`` samples: the peak of each time bucket, per worker."""
    if samples.height <= max_rows:
        return samples
    workers = max(1, samples["worker"].n_unique())
    # polars types a column's max as any scalar; "time" is a datetime column, here not empty
    last, first = (cast(dt.datetime, samples["time"].max()),
                   cast(dt.datetime, samples["time"].min()))
    span_us = (last - first).total_seconds() * 1e6
    every = f"{max(1, int(span_us * workers / max_rows))}us"
    return (samples.sort("time").group_by_dynamic("time", every=every, group_by=["worker",
                                                                                  "device"])
            .agg(pl.col("memory_used_bytes").max(), pl.col("utilization_pct").mean(),
                 pl.col("job_id").drop_nulls().first()))


def memory_timeline_chart(samples: pl.DataFrame) -> alt.Chart:
    """Sampled device memory (GPU: NVML; CPU slot: the worker's RSS) over time, per worker."""
    if samples.is_empty():
        return _empty("no device samples recorded")
    data = _thin(samples).with_columns((pl.col("memory_used_bytes") / MIB).alias("MiB"),
                                       pl.concat_str("worker", pl.lit(" · "), "device")
                                       .alias("lane"))
    zoom = alt.selection_interval(bind="scales", encodings=["x"])
    return alt.Chart(data).mark_line(interpolate="step-after").encode(
        x=alt.X("time:T", title="time (UTC)", scale=UTC_TIME, axis=alt.Axis(format="%H:%M:%S")),
        y=alt.Y("MiB:Q", title="memory used (MiB)"),
        color=alt.Color("lane:N", title="worker · device"),
        tooltip=[alt.Tooltip("lane:N", title="worker · device"),
                 alt.Tooltip("time:T", format="%H:%M:%S.%L UTC", formatType="utc"),
                 alt.Tooltip("job_id:N"),
                 alt.Tooltip("MiB:Q", format=".1f"),
                 alt.Tooltip("utilization_pct:Q", title="utilization %", format=".0f")],
    ).add_params(zoom).properties(width=760, title="Memory over time")


def memory_chart(results: pl.DataFrame, samples: pl.DataFrame) -> alt.VConcatChart:
    """Peak memory per job and per device, and the sampled memory over time."""
    return alt.vconcat(alt.hconcat(job_memory_chart(results),
                                   device_memory_chart(results, samples)),
                       memory_timeline_chart(samples)).resolve_scale(color="independent")


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


def scaling_chart(scaling: pl.DataFrame) -> alt.Chart | alt.HConcatChart:
    """Throughput and efficiency against the number of workers, with the ideal (linear) line."""
    if scaling.is_empty():
        return _empty("no scaling runs recorded")
    data = scaling.sort("workers")
    base_workers, base_throughput = data["workers"][0], data["throughput_jobs_per_min"][0]
    data = data.with_columns((pl.lit(base_throughput) * pl.col("workers") / base_workers)
                             .alias("ideal_jobs_per_min"))
    tooltip = [alt.Tooltip("workers:Q"), alt.Tooltip("jobs:Q"),
               alt.Tooltip("wall_s:Q", title="wall s", format=".1f"),
               alt.Tooltip("makespan_s:Q", title="makespan s", format=".1f"),
               alt.Tooltip("throughput_jobs_per_min:Q", title="jobs/min", format=".2f"),
               alt.Tooltip("scaling_speedup:Q", title="speedup", format=".2f"),
               alt.Tooltip("scaling_efficiency:Q", title="efficiency", format=".0%")]
    x = alt.X("workers:Q", title="workers",
              axis=alt.Axis(values=data["workers"].to_list(), format="d"),
              scale=alt.Scale(zero=False, padding=20))
    base = alt.Chart(data).encode(x=x)
    measured = base.mark_line(point=True).encode(
        y=alt.Y("throughput_jobs_per_min:Q", title="throughput (jobs per minute)"),
        tooltip=tooltip)
    ideal = base.mark_line(strokeDash=[5, 3], color="gray").encode(
        y="ideal_jobs_per_min:Q", tooltip=[alt.Tooltip("ideal_jobs_per_min:Q", format=".2f")])
    efficiency = base.mark_line(point=True, color="#f58518").encode(
        y=alt.Y("scaling_efficiency:Q", title="scaling efficiency (%)",
                axis=alt.Axis(format="%"),
                scale=alt.Scale(domain=[0, 1.1])), tooltip=tooltip)
    one = alt.Chart(pl.DataFrame({"y": [1.0]})).mark_rule(color="gray", strokeDash=[5, 3]) \
        .encode(y="y:Q")
    return alt.hconcat(
        alt.layer(ideal, measured).properties(width=320, height=240,
                                              title="Throughput (dashed: ideal)"),
        alt.layer(one, efficiency).properties(width=320, height=240,
                                              title="Scaling efficiency"),
    ).properties(title="Scaling")


def artifacts_table(results: pl.DataFrame) -> pl.DataFrame:
    """The saved models (``artifacts:``): kept or deleted, size, the reload check and any save
    failure, per job that made or tried one."""
    made = results.filter(pl.col("artifact_uri").is_not_null()
                          | pl.col("artifact_error").is_not_null())
    return made.sort("model", pl.col("artifact_kept").not_(), "size_bytes", nulls_last=True) \
        .select("model", "config_label", "artifact_kept", "artifact_bytes", "kl_divergence",
                "reload_kl_delta", "artifact_error", "artifact_uri",
                pl.col("artifact_sha256").str.slice(0, 16).alias("sha256 (first 16)"), "job_id")


def jobs_table(results: pl.DataFrame, windows: pl.DataFrame | None = None) -> pl.DataFrame:
    """Every job in one table, best quality first per model: the report's full listing, each
    quality figure with its standard error, and the configs each is tied with on KL (paired
    over ``windows``, the per-window rows, when given)."""
    tied = pareto_frontier(results, windows=windows).select("job_id", "tied_with")
    return with_quality_text(results).join(tied, on="job_id", how="left").sort(
        pl.col("model"), pl.col("status") != Status.DONE, pl.col("kl_divergence"),
        nulls_last=True).select(
        "model", "config_label", "status", "attempts", "worker", "bits_per_weight",
        "bits_per_quantized_weight", "quantized_share", "unquantized_dtypes", "full_precision",
        "size_bytes", "ppl", "vs_baseline", "kl", "tied_with", "kl_p99", "top1", "delta_p",
        "wall_s", "peak_device_mem_bytes",
        "failure_class", "job_id")

