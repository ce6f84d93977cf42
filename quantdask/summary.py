"""Summaries computed from the results frames.

>>> device_summary(read_results("runs/demo"), read_device_samples("runs/demo"))  # doctest: +SKIP
"""

from __future__ import annotations

import polars as pl


def device_summary(results: pl.DataFrame, samples: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per (worker, device): jobs run, busy and idle seconds, utilization, peak memory.

    Busy time is the sum of the jobs' run times (started -> finished on the worker); idle time is
    the rest of the sweep's window (first start -> last finish over all workers), so a device
    that waited while others worked shows it. With ``samples``, the sampled utilization (mean)
    and memory (peak) are added.
    """
    ran = results.filter(pl.col("started_at").is_not_null() & pl.col("worker").is_not_null())
    if ran.is_empty():
        return pl.DataFrame(schema={"worker": pl.String, "device": pl.String, "jobs": pl.UInt32,
                                    "busy_s": pl.Float64, "idle_s": pl.Float64,
                                    "utilization": pl.Float64, "peak_device_mem_bytes": pl.Int64})
    window_s = (ran["finished_at"].max() - ran["started_at"].min()).total_seconds()
    summary = (
        ran.with_columns(
            ((pl.col("finished_at") - pl.col("started_at")).dt.total_microseconds() / 1e6)
            .alias("run_s"))
        .group_by("worker", "device")
        .agg(pl.len().alias("jobs"), pl.col("run_s").sum().alias("busy_s"),
             pl.col("peak_device_mem_bytes").max())
        .with_columns((window_s - pl.col("busy_s")).clip(lower_bound=0).alias("idle_s"),
                      (pl.col("busy_s") / window_s if window_s > 0 else pl.lit(1.0))
                      .alias("utilization"))
        .select("worker", "device", "jobs", "busy_s", "idle_s", "utilization",
                "peak_device_mem_bytes")
        .sort("worker")
    )
    if samples is not None and not samples.is_empty():
        sampled = samples.group_by("worker", "device").agg(
            pl.col("utilization_pct").mean().alias("sampled_utilization_pct"),
            pl.col("memory_used_bytes").max().alias("sampled_peak_memory_bytes"),
            pl.len().alias("samples"),
        )
        summary = summary.join(sampled, on=["worker", "device"], how="left")
    return summary
