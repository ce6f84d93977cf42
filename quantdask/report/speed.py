"""The report's generation speed: quality against decode speed (the frontier a serving
engineer looks for) and the speed-up table.

>>> results, speed = read_results("runs/demo"), read_speed("runs/demo")  # doctest: +SKIP
>>> speed_chart(results, speed)  # doctest: +SKIP
"""

from __future__ import annotations

import altair as alt
import polars as pl

from quantdask.report.charts import JOB_TOOLTIP, _empty, with_job_label
from quantdask.words import BASELINE, Status


def _speed_frame(results: pl.DataFrame, speed: pl.DataFrame) -> pl.DataFrame:
    jobs = with_job_label(results.filter(pl.col("status") == Status.DONE)).select(
        "job_id", "job", "model", "config_label", "backend", "config", "bits_per_weight",
        "kl_divergence")
    return speed.join(jobs, on="job_id")


def speed_chart(results: pl.DataFrame, speed: pl.DataFrame) -> alt.Chart | alt.VConcatChart:
    """KL divergence against decode tokens/s, one panel per (model, batch size): every done
    job, the unquantized baseline's speed as a dashed rule (right of it is faster than the
    unquantized model, lower is closer to it). Each panel names its device."""
    if speed.is_empty():
        return _empty("no speed figures (a sweep's speed: block adds them)")
    data = _speed_frame(results, speed)
    tooltip = [*JOB_TOOLTIP, alt.Tooltip("batch_size:Q"), alt.Tooltip("device:N"),
               alt.Tooltip("decode_tokens_per_s:Q", format=".1f", title="decode tokens/s"),
               alt.Tooltip("decode_speedup:Q", format=".2f", title="decode speed-up"),
               alt.Tooltip("ttft_s:Q", format=".4f", title="time to first token s"),
               alt.Tooltip("kl_divergence:Q", format=".3g", title="KL nats/token"),
               alt.Tooltip("exclusive:N", title="device held alone")]
    panels = []
    for (model, batch), part in data.group_by("model", "batch_size", maintain_order=True):
        devices = ", ".join(sorted(set(part["device"])))
        base = alt.Chart(part).encode(
            x=alt.X("decode_tokens_per_s:Q", title="decode tokens/s",
                    scale=alt.Scale(zero=False, padding=12)))
        points = base.mark_point(size=90, filled=True).encode(
            y=alt.Y("kl_divergence:Q", title="KL divergence (nats/token)",
                    scale=alt.Scale(zero=False, padding=12)),
            color="backend:N", tooltip=tooltip)
        labels = base.mark_text(dx=8, align="left", fontSize=10).encode(
            y="kl_divergence:Q", text="config_label:N")
        rule = alt.Chart(part.filter(pl.col("backend") == BASELINE)).mark_rule(
            color="gray", strokeDash=[6, 3]).encode(x="decode_tokens_per_s:Q", tooltip=tooltip)
        panels.append(alt.layer(rule, points, labels).properties(
            width=360, height=240, title=f"{model}: batch {batch} on {devices}"))
    rows = [alt.hconcat(*panels[i:i + 2]) for i in range(0, len(panels), 2)]
    return alt.vconcat(*rows).properties(
        title="Quality vs decode speed (lower right is better)")


def speedup_table(results: pl.DataFrame, speed: pl.DataFrame) -> pl.DataFrame:
    """Per config and batch size: time to first token, decode step p50 / p90 (ms), decode
    tokens/s and the speed-ups against the model's baseline, fastest first per model."""
    if speed.is_empty():
        return pl.DataFrame()
    return _speed_frame(results, speed).sort(
        "model", "batch_size", "decode_tokens_per_s", descending=[False, False, True]).select(
        "model", pl.col("config_label").alias("config"), "batch_size", "device", "exclusive",
        (pl.col("ttft_s") * 1000).round(2).alias("ttft_ms"),
        (pl.col("decode_s_p50") * 1000).round(2).alias("decode_ms_p50"),
        (pl.col("decode_s_p90") * 1000).round(2).alias("decode_ms_p90"),
        pl.col("decode_tokens_per_s").round(1), pl.col("decode_speedup").round(2),
        pl.col("prefill_speedup").round(2), "job_id")
