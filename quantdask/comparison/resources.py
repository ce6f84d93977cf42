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
    in each, their ratios B / A, each side's decode step median and p90, the devices, and the
    decode verdict (worse: slower)."""
    rows = []
    for job in done.iter_rows(named=True):
        sa = a.speed.filter(pl.col("job_id") == job["job_id_a"])
        sb = b.speed.filter(pl.col("job_id") == job["job_id_b"])
        for r in sa.join(sb, on="batch_size", suffix="_b").iter_rows(named=True):
            rows.append({"model": job["model"], "config_label": job["config_label"],
                         "batch_size": r["batch_size"], **_speed(r, tolerance)})
    return pl.DataFrame(rows, schema=SPEED_SCHEMA)


SPEED_SCHEMA = {
    "model": pl.String, "config_label": pl.String, "batch_size": pl.Int64,
    "decode_tokens_per_s_a": pl.Float64, "decode_tokens_per_s_b": pl.Float64,
    "decode_ratio": pl.Float64, "decode_step_s_a": pl.String, "decode_step_s_b": pl.String,
    "prefill_tokens_per_s_a": pl.Float64, "prefill_tokens_per_s_b": pl.Float64,
    "prefill_ratio": pl.Float64, "device_a": pl.String, "device_b": pl.String,
    "verdict": pl.String}


def _speed(r: dict[str, Any], tolerance: Tolerance) -> dict[str, Any]:
    a, b = r["decode_tokens_per_s"], r["decode_tokens_per_s_b"]
    ratio = b / a if a and b is not None else None
    steps = [(r["decode_s_p50"], r["decode_s_p90"]), (r["decode_s_p50_b"], r["decode_s_p90_b"])]
    shared = not (r["exclusive"] and r["exclusive_b"]) or bool(
        r["other_slots_busy"] or r["other_slots_busy_b"])
    verdict = NOT_TESTABLE if shared else NO_DIFFERENCE
    if not shared and ratio is not None and None not in (*steps[0], *steps[1]) and \
            tolerance.exceeds(ratio - 1.0, 1.0):
        (a50, a90), (b50, b90) = steps
        if b50 > a90:  # B's median step beyond A's p90
            verdict = SLOWER
        elif a50 > b90:
            verdict = FASTER
    return {"decode_tokens_per_s_a": a, "decode_tokens_per_s_b": b, "decode_ratio": ratio,
            "decode_step_s_a": _spread(*steps[0]), "decode_step_s_b": _spread(*steps[1]),
            "prefill_tokens_per_s_a": r["prefill_tokens_per_s"],
            "prefill_tokens_per_s_b": r["prefill_tokens_per_s_b"],
            "prefill_ratio": r["prefill_tokens_per_s_b"] / r["prefill_tokens_per_s"],
            "device_a": r["device"], "device_b": r["device_b"], "verdict": verdict}


def _spread(p50: float | None, p90: float | None) -> str | None:
    return None if p50 is None or p90 is None else f"{p50:.4g} (p90 {p90:.4g})"


MEMORY_COLUMNS = ("peak_device_mem_bytes", "peak_host_rss_bytes", "size_bytes", "wall_s")


def memory_rows(a: RunFrames, b: RunFrames, done: pl.DataFrame, tolerance: Tolerance
                ) -> pl.DataFrame:
    """One row per job done in both: its peak device memory, peak RSS, size and wall time in
    each run with the ratios B / A, and the verdict on peak device memory (worse: more)."""
    cols = list(MEMORY_COLUMNS)
    extra = ["device", "peak_shared"]
    left = done.select("model", "config_label", "job_id_a", "job_id_b")
    joined = (left.join(a.results.select(pl.col("job_id").alias("job_id_a"), *cols, *extra),
                        on="job_id_a")
              .join(b.results.select(pl.col("job_id").alias("job_id_b"), *cols, *extra),
                    on="job_id_b", suffix="_b"))
    frame = joined.select(
        "model", "config_label",
        *[e for c in cols for e in (pl.col(c).alias(f"{c}_a"), pl.col(f"{c}_b"),
                                    (pl.col(f"{c}_b") / pl.col(c)).alias(f"{c}_ratio"))])
    testable = (joined["device"].str.starts_with("cuda") & joined["device_b"].str.starts_with(
        "cuda") & ~joined["peak_shared"].fill_null(False)
        & ~joined["peak_shared_b"].fill_null(False))
    verdicts = [_memory_verdict(x, y, tolerance) if ok else NOT_TESTABLE for x, y, ok in zip(
        frame["peak_device_mem_bytes_a"], frame["peak_device_mem_bytes_b"], testable)]
    return frame.with_columns(pl.Series("verdict", verdicts, dtype=pl.String))


def _memory_verdict(a: int | None, b: int | None, tolerance: Tolerance) -> str:
    if a is None or b is None or not tolerance.exceeds(b - a, a):
        return NO_DIFFERENCE
    return MORE if b > a else LESS
