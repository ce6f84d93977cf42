"""Speed and memory in a comparison: ratios B / A with each side's spread.

Decode speed has a spread (each run's median and 90th-percentile decode step): B is slower
only when both timings held their device alone (``exclusive``, no other CPU slot busy: else
not testable, the timing includes another job's load), the ratio is beyond the tolerance and
B's median step is beyond A's p90 (faster: A's median beyond B's p90). Prefill has one
median a side: its ratio is shown, with no verdict.
Peak device memory and size are single measurements: a verdict when beyond the tolerance, on
a GPU only (a CPU slot's peak is its process's RSS, which carries what the worker ran before)
and where no other job shared the peak.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from quantdask.comparison.runs import RunFrames
from quantdask.comparison.verdicts import (
    BETTER,
    NO_DIFFERENCE,
    NOT_TESTABLE,
    WORSE,
    Tolerance,
)

SLOWER, FASTER, MORE, LESS = WORSE, BETTER, WORSE, BETTER


def speed_rows(a: RunFrames, b: RunFrames, done: pl.DataFrame, tolerance: Tolerance
               ) -> pl.DataFrame:
    """One row per (job done in both, batch size) both runs timed: decode and prefill tokens/s
    in each, their ratios B / A, each side's decode step median and p90, whether both held
    their device alone (``testable``), the devices, and the decode verdict (worse: slower)."""
    rows = []
    for job in done.iter_rows(named=True):
        sa = a.speed.filter(pl.col("job_id") == job["job_id_a"])
        sb = b.speed.filter(pl.col("job_id") == job["job_id_b"])
        for r in sa.join(sb, on="batch_size", suffix="_b").iter_rows(named=True):
            rows.append({"model": job["model"], "config_label": job["config_label"],
                         "batch_size": r["batch_size"], **_speed(r)})
    frame = pl.DataFrame(rows, schema=SPEED_SCHEMA)
    return frame.with_columns(pl.Series("verdict", [speed_verdict(r, tolerance) for r in
                                                    frame.iter_rows(named=True)],
                                        dtype=pl.String))


SPEED_SCHEMA = {
    "model": pl.String, "config_label": pl.String, "batch_size": pl.Int64,
    "decode_tokens_per_s_a": pl.Float64, "decode_tokens_per_s_b": pl.Float64,
    "decode_ratio": pl.Float64, "decode_s_p50_a": pl.Float64, "decode_s_p90_a": pl.Float64,
    "decode_s_p50_b": pl.Float64, "decode_s_p90_b": pl.Float64,
    "prefill_tokens_per_s_a": pl.Float64, "prefill_tokens_per_s_b": pl.Float64,
    "prefill_ratio": pl.Float64, "device_a": pl.String, "device_b": pl.String,
    "testable": pl.Boolean}


def _speed(r: dict[str, Any]) -> dict[str, Any]:
    a, b = r["decode_tokens_per_s"], r["decode_tokens_per_s_b"]
    alone = bool(r["exclusive"] and r["exclusive_b"]) and not (
        r["other_slots_busy"] or r["other_slots_busy_b"])
    return {"decode_tokens_per_s_a": a, "decode_tokens_per_s_b": b,
            "decode_ratio": b / a if a and b is not None else None,
            "decode_s_p50_a": r["decode_s_p50"], "decode_s_p90_a": r["decode_s_p90"],
            "decode_s_p50_b": r["decode_s_p50_b"], "decode_s_p90_b": r["decode_s_p90_b"],
            "prefill_tokens_per_s_a": r["prefill_tokens_per_s"],
            "prefill_tokens_per_s_b": r["prefill_tokens_per_s_b"],
            "prefill_ratio": r["prefill_tokens_per_s_b"] / r["prefill_tokens_per_s"],
            "device_a": r["device"], "device_b": r["device_b"], "testable": alone}


def speed_verdict(row: dict[str, Any], tolerance: Tolerance) -> str:
    """A speed row's decode verdict under ``tolerance`` (relative to A's tokens/s, or in
    tokens/s): not testable unless both timings held their device alone and have a spread;
    slower when beyond the tolerance and B's median step is beyond A's p90 (faster: A's
    median beyond B's p90)."""
    steps = (row["decode_s_p50_a"], row["decode_s_p90_a"], row["decode_s_p50_b"],
             row["decode_s_p90_b"])
    a, b = row["decode_tokens_per_s_a"], row["decode_tokens_per_s_b"]
    if not row["testable"] or None in steps or a is None or b is None:
        return NOT_TESTABLE
    a50, a90, b50, b90 = steps
    if not tolerance.exceeds(b - a, a):
        return NO_DIFFERENCE
    if b50 > a90:
        return SLOWER
    return FASTER if a50 > b90 else NO_DIFFERENCE


MEMORY_COLUMNS = ("peak_device_mem_bytes", "peak_host_rss_bytes", "size_bytes", "wall_s")


def memory_rows(a: RunFrames, b: RunFrames, done: pl.DataFrame, tolerance: Tolerance
                ) -> pl.DataFrame:
    """One row per job done in both: its peak device memory, peak RSS, size and wall time in
    each run with the ratios B / A, whether its peaks compare (``testable``: both on a GPU, no
    other job sharing the peak), and the verdict on peak device memory (worse: more)."""
    cols = list(MEMORY_COLUMNS)
    extra = ["device", "peak_shared"]
    left = done.select("model", "config_label", "job_id_a", "job_id_b")
    joined = (left.join(a.results.select(pl.col("job_id").alias("job_id_a"), *cols, *extra),
                        on="job_id_a")
              .join(b.results.select(pl.col("job_id").alias("job_id_b"), *cols, *extra),
                    on="job_id_b", suffix="_b"))
    on_gpus = (pl.col("device").fill_null("").str.starts_with("cuda")
               & pl.col("device_b").fill_null("").str.starts_with("cuda"))
    frame = joined.select(
        "model", "config_label",
        *[e for c in cols for e in (pl.col(c).alias(f"{c}_a"), pl.col(f"{c}_b"),
                                    (pl.col(f"{c}_b") / pl.col(c)).alias(f"{c}_ratio"))],
        (on_gpus & ~pl.col("peak_shared").fill_null(False)
         & ~pl.col("peak_shared_b").fill_null(False)).alias("testable"))
    return frame.with_columns(pl.Series("verdict", [memory_verdict(r, tolerance) for r in
                                                    frame.iter_rows(named=True)],
                                        dtype=pl.String))


def memory_verdict(row: dict[str, Any], tolerance: Tolerance) -> str:
    """A memory row's verdict on peak device memory under ``tolerance`` (of A's bytes, or in
    bytes): not testable off GPUs or with a shared peak."""
    a, b = row["peak_device_mem_bytes_a"], row["peak_device_mem_bytes_b"]
    if not row["testable"] or a is None or b is None:
        return NOT_TESTABLE
    if not tolerance.exceeds(b - a, a):
        return NO_DIFFERENCE
    return MORE if b > a else LESS
