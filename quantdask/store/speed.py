"""The speed frame as read: each job's generation speed beside its model's baseline.

The rows are written as each job measured them; the baseline's figures and the speed-ups are
added when read (``FRAME["speed"].complete``), since a config may finish before its model's
baseline does.

>>> read_speed("runs/demo").select("config_label", "batch_size", "decode_speedup")  # doctest: +SKIP
"""

from __future__ import annotations

import polars as pl

from quantdask.records import SpeedAsRead, SpeedRow
from quantdask.words import BASELINE

DERIVED = tuple(c for c in SpeedAsRead.column_names() if c not in SpeedRow.column_names())
"""The speed frame's columns added when read (``records.SpeedAsRead``)."""


def with_baseline_speed(rows: pl.DataFrame, results: pl.DataFrame) -> pl.DataFrame:
    """``rows`` (the speed frame as stored) with the baseline's decode tokens/s for the same
    model and batch size and the speed-ups (decode and prefill tokens/s over the baseline's;
    null where the baseline has no row), in ``rows``' column order."""
    mine = rows.drop(DERIVED).join(results.select("job_id", "model", "backend"), on="job_id",
                                   how="left")
    baseline = mine.filter(pl.col("backend") == BASELINE).select(
        "model", "batch_size",
        pl.col("decode_tokens_per_s").alias("baseline_decode_tokens_per_s"),
        pl.col("prefill_tokens_per_s").alias("baseline_prefill_tokens_per_s"))
    joined = mine.join(baseline, on=["model", "batch_size"], how="left")
    return joined.with_columns(
        (pl.col("decode_tokens_per_s") / pl.col("baseline_decode_tokens_per_s"))
        .alias("decode_speedup"),
        (pl.col("prefill_tokens_per_s") / pl.col("baseline_prefill_tokens_per_s"))
        .alias("prefill_speedup"),
    ).select([pl.col(c).cast(rows.schema[c]) for c in rows.columns])
