"""The results schema: one row per job. A record that does not fit is an error, never a null."""

from __future__ import annotations

import datetime as dt
from typing import Any

import polars as pl

from quantdask.errors import SchemaError

STATUSES = ("done", "failed", "skipped")

_UTC = pl.Datetime("us", "UTC")

RESULT_SCHEMA: dict[str, pl.DataType] = {
    "job_id": pl.String(),
    "sweep": pl.String(),
    "model": pl.String(),
    "backend": pl.String(),
    "config": pl.String(),  # canonical JSON of the options
    "config_label": pl.String(),
    "status": pl.String(),
    "attempts": pl.Int64(),
    "priority": pl.Int64(),
    "worker": pl.String(),
    "host": pl.String(),
    "device": pl.String(),
    "queued_at": _UTC,
    "started_at": _UTC,
    "finished_at": _UTC,
    "wall_s": pl.Float64(),
    "load_s": pl.Float64(),
    "quantize_s": pl.Float64(),
    "eval_s": pl.Float64(),
    "source_cached": pl.Boolean(),
    "peak_device_mem_bytes": pl.Int64(),
    "peak_device_reserved_bytes": pl.Int64(),
    "peak_host_rss_bytes": pl.Int64(),
    "param_count": pl.Int64(),
    "size_bytes": pl.Int64(),
    "bits_per_weight": pl.Float64(),
    "perplexity": pl.Float64(),
    "eval_tokens": pl.Int64(),
    "error_class": pl.String(),
    "error_message": pl.String(),
    "traceback": pl.String(),
}

ALWAYS_REQUIRED = ("job_id", "sweep", "model", "backend", "config", "config_label", "status",
                   "attempts", "priority", "queued_at", "finished_at")
METRICS = ("worker", "host", "device", "started_at", "wall_s", "load_s", "quantize_s", "eval_s",
           "source_cached", "peak_device_mem_bytes", "peak_device_reserved_bytes",
           "peak_host_rss_bytes", "param_count", "size_bytes", "bits_per_weight", "perplexity",
           "eval_tokens")
REQUIRED_BY_STATUS = {
    "done": ALWAYS_REQUIRED + METRICS,
    "failed": ALWAYS_REQUIRED + ("error_class", "error_message"),
    "skipped": ALWAYS_REQUIRED + ("error_class", "error_message"),
}

_PYTHON_TYPES: dict[type, tuple[type, ...]] = {
    pl.String: (str,),
    pl.Int64: (int,),
    pl.Float64: (float, int),
    pl.Boolean: (bool,),
    pl.Datetime: (dt.datetime,),
}


def validate_record(record: dict[str, Any]) -> dict[str, Any]:
    """Check ``record`` against the schema; return it with every column present.

    Raises :class:`SchemaError` for an unknown column, a wrong type, or a metric missing for the
    record's status.
    """
    unknown = sorted(set(record) - set(RESULT_SCHEMA))
    if unknown:
        raise SchemaError(f"unknown result columns: {', '.join(unknown)}")
    status = record.get("status")
    if status not in STATUSES:
        raise SchemaError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    missing = [c for c in REQUIRED_BY_STATUS[status] if record.get(c) is None]
    if missing:
        raise SchemaError(f"{status} record {record.get('job_id')!r} lacks {', '.join(missing)}")
    for column, dtype in RESULT_SCHEMA.items():
        value = record.get(column)
        if value is None:
            continue
        allowed = _PYTHON_TYPES[type(dtype)]
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            raise SchemaError(f"{column} must be {dtype}, got {type(value).__name__} {value!r}")
        if isinstance(value, dt.datetime) and value.tzinfo is None:
            raise SchemaError(f"{column} must be timezone-aware (UTC), got {value!r}")
    return {column: record.get(column) for column in RESULT_SCHEMA}


def empty_results() -> pl.DataFrame:
    return pl.DataFrame(schema=RESULT_SCHEMA)


def records_to_frame(records: list[dict[str, Any]]) -> pl.DataFrame:
    return pl.DataFrame([validate_record(r) for r in records], schema=RESULT_SCHEMA)
