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
from quantdask.store.frontier import SIZE_BITS, pareto_frontier, with_size_bits
from quantdask.store.summary import device_summary
from quantdask.words import BASELINE, Status

MIB = 1024 * 1024
UTC_TIME = alt.Scale(type="utc")  # the frames hold UTC: show UTC whatever the reader's zone
# A sweep of a large model has thousands of per-layer rows; the charts inline them all (the
# sample series is thinned first), so Altair's 5000-row guard would only break big reports.
alt.data_transformers.disable_max_rows()
STATUS_COLORS = alt.Scale(domain=[status.value for status in Status],
                          range=["#4c78a8", "#e45756", "#bab0ac"])
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
    """``done`` with the quality text columns, the size in MiB and in the whole model's bits
    per weight as stored (``size_bits``), and each metric's
    error bar ends (``<metric>_lo``, ``<metric>_hi``): one standard error either side, ln
    PPL's on perplexity (so asymmetric there)."""
    ln_ppl_se, kl_se = pl.col("ln_ppl_se").fill_null(0), pl.col("kl_se").fill_null(0)
    return with_size_bits(with_quality_text(done)).with_columns(
        (pl.col("size_bytes") / MIB).alias("size_mib"),
        (pl.col("perplexity") * (-ln_ppl_se).exp()).alias("perplexity_lo"),
        (pl.col("perplexity") * ln_ppl_se.exp()).alias("perplexity_hi"),
        (pl.col("kl_divergence") - kl_se).clip(lower_bound=0).alias("kl_divergence_lo"),
        (pl.col("kl_divergence") + kl_se).alias("kl_divergence_hi"))


DECADES = 10.0
"""A metric whose finished values span more than this factor is drawn on a log scale: one
exploded config (a 2-bit perplexity of 828,605) must not flatten every other point."""


def metric_scale(values: pl.Series) -> alt.Scale:
    """A log scale where the positive ``values`` span more than ``DECADES``, else linear (no
    zero forced in). A log scale has no place for a zero (the baseline's KL: its rule is not
    drawn there)."""
    positive = values.drop_nulls().filter(values.drop_nulls() > 0)
    if positive.len() > 1 and positive.max() > DECADES * positive.min():  # type: ignore[operator]
        return alt.Scale(type="log", padding=12)
    return alt.Scale(zero=False, padding=12)


def _quality_panel(data: pl.DataFrame, metric: str, title: str, windows: pl.DataFrame | None,
                   number: int) -> alt.LayerChart | alt.FacetChart:
    """One model's ``metric`` against its size (see ``quality_chart``); ``number`` names its
    zoom."""
    tooltip = QUALITY_TOOLTIP
    # Each panel's frontier is its own: smallest size for its perplexity, or for its KL.
    # Perplexity is ranked by ln(PPL ratio): the same order within a model, with a paired
    # error over the windows (ties).
    ranked_by = "ln_ppl_ratio" if metric == "perplexity" else metric
    data = pareto_frontier(data, loss=ranked_by, windows=windows)
    data = data.with_columns(
        pl.when(pl.col("backend") == BASELINE).then(pl.lit("baseline"))
        .when(pl.col("pareto")).then(pl.lit("Pareto frontier"))
        .otherwise(pl.lit("dominated")).alias("kind"))
    scale = metric_scale(data[metric])
    if scale.type == "log":  # a zero (the baseline's KL), or a bar down to it, has no place
        data = data.filter(pl.col(metric) > 0).with_columns(pl.max_horizontal(
            f"{metric}_lo", pl.col(metric).min() / 2).alias(f"{metric}_lo"))
        title += " (log scale; zero not drawn)"
    baseline = data.filter(pl.col("backend") == BASELINE)  # none on a log scale of KL
    # The baseline is its rule alone: a point at its 16 or 32 bits would stretch the axis and
    # squeeze every quantized config into a corner of it.
    quantized = data.filter(pl.col("backend") != BASELINE)
    base = alt.Chart(quantized).encode(
        x=alt.X(f"{SIZE_BITS}:Q", scale=alt.Scale(zero=False, padding=12),
                title="bits per weight, whole model as stored (the file that ships)"))
    error_bars = base.mark_rule(strokeWidth=2, opacity=0.6).encode(
        y=alt.Y(f"{metric}_lo:Q", scale=scale), y2=f"{metric}_hi:Q",
        color=alt.Color("backend:N"), tooltip=tooltip)
    points = base.mark_point(size=90, filled=True).encode(
        y=alt.Y(f"{metric}:Q", title=title, scale=scale),
        color=alt.Color("backend:N"),
        shape=alt.Shape("kind:N", scale=alt.Scale(
            domain=["Pareto frontier", "dominated"], range=["circle", "triangle-up"])),
        tooltip=tooltip,
    )
    frontier = base.transform_filter(alt.datum.kind != "dominated").mark_line(
        color="black", strokeDash=[4, 2], opacity=0.5).encode(
        y=f"{metric}:Q", detail="model:N", order=f"{SIZE_BITS}:Q")
    rule = [alt.Chart(baseline).mark_rule(color="gray", strokeDash=[6, 3]).encode(
        y=f"{metric}:Q", tooltip=tooltip)] if baseline.height else []
    zoom = alt.selection_interval(bind="scales", name=f"zoom_quality_{number}")
    model = data["model"][0]
    return alt.layer(frontier, *rule, error_bars, points.add_params(zoom)).properties(
        width=360, height=260, title=f"{model}: {title} vs whole-model bits per weight")


def quality_chart(results: pl.DataFrame,
                  windows: pl.DataFrame | None = None) -> alt.Chart | alt.VConcatChart:
    """Quality against size: the whole model's bits per weight as stored (the file that ships;
    bits per quantized weight, the quantized layers' weights with their scales and zero points,
    and the file's MiB in the tooltip)
    against perplexity and against KL divergence, each point with its error bar (one standard
    error). A metric whose values span decades is drawn on a log scale (``metric_scale``).

    The Pareto frontier (smallest size for its KL, tied configs not ranked, paired over the
    per-window rows ``windows`` when given: see ``pareto_frontier``) is drawn as a line through
    its configs, the unquantized baseline as a dashed rule; drag to pan, scroll to zoom.
    """
    data = _with_error_bars(results.filter(pl.col("status") == Status.DONE))
    if data.is_empty():
        return _empty("no finished jobs: nothing to compare")
    # One row of panels per model: perplexities of different models do not share a scale.
    # Each panel zooms on its own: its selection has its own name (its number).
    return alt.vconcat(*[
        alt.hconcat(_quality_panel(model_data, "perplexity", "perplexity (no unit)", windows,
                                   2 * index + 1),
                    _quality_panel(model_data, "kl_divergence", "KL divergence (nats/token)",
                                   windows, 2 * index + 2))
        for index, (_, model_data) in enumerate(data.group_by("model", maintain_order=True))
    ]).properties(title="Quality vs size (lower left is better)")


LARGEST = "(largest in the block)"
"""The heatmap's default pick: each block's largest error over its linears."""

SCREEN_PX = 720
"""The most a heatmap's rows take, whatever the depth (its rows shrink to fit, 4 to 16 px)."""


def _by_block(layers: pl.DataFrame) -> pl.DataFrame:
    """``layers`` with each module's decoder block (``block``: the first number in its name,
    null outside the blocks: the head, embeddings) and its name inside the block
    (``linear``: ``self_attn.q_proj``); and per (job, block, metric) the largest error as a
    linear of its own (``LARGEST``)."""
    parts = pl.col("layer").str.extract_groups(r"^(?:.*?\.)?(\d+)\.(.+)$")
    named = layers.with_columns(
        parts.struct.field("1").cast(pl.Int64, strict=False).alias("block"),
        pl.coalesce(parts.struct.field("2"), pl.col("layer")).alias("linear"))
    largest = (named.filter(pl.col("block").is_not_null())
               .sort("error", descending=True)
               .group_by("job_id", "block", "metric", maintain_order=True).first()
               .with_columns(pl.lit(LARGEST).alias("linear")))
    return pl.concat([named, largest.select(named.columns)]).with_columns(
        pl.when(pl.col("block").is_null()).then(pl.col("layer"))
        .otherwise(pl.format("block {}", pl.col("block"))).alias("row"))


def layer_error_heatmap(results: pl.DataFrame,
                        layers: pl.DataFrame) -> alt.Chart | alt.VConcatChart:
    """Per-layer error, one row per decoder block (and one per module outside the blocks: the
    head) x config: pick the weight or output relative error, and the linear of the block
    shown (by default each block's largest), so an 80-block model fits one screen."""
    data = layers.join(results.select("job_id", "model", "config_label", "backend", "config"),
                       on="job_id", how="inner")
    if data.is_empty():
        return _empty("no per-layer errors recorded")
    metrics = ["weight_rel_error", "output_rel_error"]
    long = _by_block(data.unpivot(index=[c for c in data.columns if c not in metrics],
                                  on=metrics, variable_name="metric", value_name="error")
                     .filter(pl.col("error").is_not_null()))
    metric = alt.param(name="layer_metric", value="weight_rel_error", bind=alt.binding_select(
        options=metrics, labels=["weight rel. error", "output rel. error"], name="error: "))
    in_blocks = long.filter(pl.col("block").is_not_null())
    linears = [LARGEST] + (in_blocks.filter(pl.col("linear") != LARGEST)
                           .group_by("linear").agg(pl.col("position").min())
                           .sort("position")["linear"].to_list())
    linear = alt.param(name="block_linear", value=LARGEST, bind=alt.binding_select(
        options=linears, name="linear: "))

    def heatmap(model_long: pl.DataFrame) -> alt.Chart:
        rows = (model_long.group_by("row").agg(pl.col("position").min())
                .sort("position")["row"].to_list())
        step = max(4, min(16, SCREEN_PX // max(1, len(rows))))
        # Every column named by its config's label, none dropped for lack of room.
        return alt.Chart(model_long).mark_rect().encode(
            x=alt.X("config_label:N", title="config",
                    sort=_job_order(results.filter(pl.col("model") == model_long["model"][0])),
                    axis=alt.Axis(labelAngle=-35, labelOverlap=False, labelLimit=240,
                                  orient="bottom")),
            y=alt.Y("row:N", sort=rows, title="decoder block (in network order)",
                    axis=alt.Axis(labelOverlap=True)),
            color=alt.Color("error:Q", title="relative error (‖Δ‖ / ‖·‖, no unit)",
                            scale=alt.Scale(scheme="orangered")),
            tooltip=[alt.Tooltip("layer:N"), alt.Tooltip("in_features:Q"),
                     alt.Tooltip("out_features:Q"), alt.Tooltip("metric:N"),
                     alt.Tooltip("error:Q", format=".4g"),
                     alt.Tooltip("weight_sqnr_db:Q", title="weight SQNR dB", format=".1f"),
                     *JOB_TOOLTIP],
        ).transform_filter(alt.datum.metric == metric).transform_filter(
            (alt.datum.linear == linear) | (alt.datum.block == None)  # noqa: E711 (Vega)
        ).properties(height=alt.Step(step), title=(
            f"{model_long['model'][0]}: per-layer error by decoder block "
            "(pick the metric and the linear below)"))

    # One heatmap per model (their layers differ); the pickers are shared.
    return alt.vconcat(*[heatmap(model_long) for _, model_long
                         in long.group_by("model", maintain_order=True)]).add_params(metric,
                                                                                     linear)


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

