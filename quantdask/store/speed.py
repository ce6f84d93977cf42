"""The speed frame as read: each job's generation speed beside its model's baseline.

The rows are written as each job measured them (``RunStore.write_speed``); the baseline's
figures and the speed-ups are added here, when read, since a config may finish before its
model's baseline does.

>>> read_speed("runs/demo").select("config_label", "batch_size", "decode_speedup")  # doctest: +SKIP
"""

from __future__ import annotations

import os

import polars as pl

from quantdask.store.run_store import RunStore
from quantdask.store.schema import SPEED_MEASURED, SPEED_SCHEMA


def read_speed(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Generation speed of every done job of ``run_dir``: one row per (job, batch size), with
    the baseline's decode tokens/s for the same model and batch size and the speed-ups
    (decode and prefill tokens/s over the baseline's; null where the baseline has no row).
    Empty for a sweep without a speed block."""
    store = RunStore(run_dir)
    rows = store.read_speed_rows().select(SPEED_MEASURED)
    jobs = store.read_results().select("job_id", "model", "backend")
    mine = rows.join(jobs, on="job_id", how="left")
    baseline = mine.filter(pl.col("backend") == "none").select(
        "model", "batch_size",
        pl.col("decode_tokens_per_s").alias("baseline_decode_tokens_per_s"),
        pl.col("prefill_tokens_per_s").alias("baseline_prefill_tokens_per_s"))
    joined = mine.join(baseline, on=["model", "batch_size"], how="left")
    return joined.with_columns(
        (pl.col("decode_tokens_per_s") / pl.col("baseline_decode_tokens_per_s"))
        .alias("decode_speedup"),
        (pl.col("prefill_tokens_per_s") / pl.col("baseline_prefill_tokens_per_s"))
        .alias("prefill_speedup"),
    ).select([pl.col(c).cast(t) for c, t in SPEED_SCHEMA.items()]).sort("job_id", "batch_size")
