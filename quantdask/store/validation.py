"""Checks of records and rows against the frames' schemas (``store.schema``): a record that does
not fit is an error, never a null."""

from __future__ import annotations

import datetime as dt
from typing import Any

import polars as pl

from quantdask.errors import SchemaError
from quantdask.store.schema import FAILURE_CLASSES, RESULT_SCHEMA, STATUSES
from quantdask.words import Status

ALWAYS_REQUIRED = ("job_id", "sweep", "model", "backend", "config", "config_label", "status",
                   "attempts", "priority", "queued_at", "finished_at")
METRICS = ("worker", "host", "device", "started_at", "wall_s", "load_s", "quantize_s", "eval_s",
           "source_cached", "peak_device_mem_bytes", "peak_device_reserved_bytes",
           "peak_host_rss_bytes", "param_count", "size_bytes", "bits_per_weight",
           "quantized_bytes", "unquantized_bytes", "unquantized_dtypes", "quantized_params",
           "quantized_share", "perplexity", "kl_divergence",
           "kl_tail_mass", "top1_agreement", "eval_tokens", "kl_kind", "kl_median", "kl_p90",
           "kl_p99", "kl_p999", "kl_max", "top1_agreement_se", "delta_p_mean", "delta_p_rms",
           "delta_p_p01", "delta_p_p05", "delta_p_median", "delta_p_p95", "delta_p_p99",
           "ln_ppl_ratio")
REQUIRED_BY_STATUS = {
    Status.DONE: ALWAYS_REQUIRED + METRICS,
    Status.FAILED: ALWAYS_REQUIRED + ("failure_class", "error_class", "error_message"),
    Status.SKIPPED: ALWAYS_REQUIRED + ("failure_class", "error_class", "error_message"),
}

_PYTHON_TYPES: dict[type, tuple[type, ...]] = {
    pl.String: (str,),
    pl.Int64: (int,),
    pl.Float64: (float, int),
    pl.Boolean: (bool,),
    pl.Datetime: (dt.datetime,),
}


def _check_types(record: dict[str, Any], schema: dict[str, pl.DataType], what: str) -> None:
    unknown = sorted(set(record) - set(schema))
    if unknown:
        raise SchemaError(f"unknown {what} columns: {', '.join(unknown)}")
    for column, dtype in schema.items():
        value = record.get(column)
        if value is None:
            continue
        allowed = _PYTHON_TYPES[type(dtype)]
        if isinstance(value, bool) and bool not in allowed or not isinstance(value, allowed):
            raise SchemaError(f"{column} must be {dtype}, got {type(value).__name__} {value!r}")
        if isinstance(value, dt.datetime) and value.tzinfo is None:
            raise SchemaError(f"{column} must be timezone-aware (UTC), got {value!r}")


def validate_record(record: dict[str, Any]) -> dict[str, Any]:
    """Check ``record`` against the results schema; return it with every column present.

    Raises :class:`SchemaError` for an unknown column, a wrong type, or a metric missing for the
    record's status.
    """
    status = record.get("status")
    if status not in STATUSES:
        raise SchemaError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
    missing = [c for c in REQUIRED_BY_STATUS[status] if record.get(c) is None]
    if missing:
        raise SchemaError(f"{status} record {record.get('job_id')!r} lacks {', '.join(missing)}")
    if record.get("failure_class") not in (None, *FAILURE_CLASSES):
        raise SchemaError(f"failure_class must be one of {', '.join(FAILURE_CLASSES)}, "
                          f"got {record['failure_class']!r}")
    _check_types(record, RESULT_SCHEMA, "result")
    return {column: record.get(column) for column in RESULT_SCHEMA}


def rows_to_frame(rows: list[dict[str, Any]], schema: dict[str, pl.DataType], what: str,
                  optional: tuple[str, ...] = ()) -> pl.DataFrame:
    """Rows of a secondary frame (layers, device samples) checked against ``schema``: every
    column but ``optional`` is required in every row."""
    for row in rows:
        missing = [c for c in schema if c not in optional and row.get(c) is None]
        if missing:
            raise SchemaError(f"{what} row lacks {', '.join(missing)}: {row!r}")
        _check_types(row, schema, what)
    return pl.DataFrame(rows, schema=schema)


def empty_frame(schema: dict[str, pl.DataType]) -> pl.DataFrame:
    return pl.DataFrame(schema=schema)


def records_to_frame(records: list[dict[str, Any]]) -> pl.DataFrame:
    return pl.DataFrame([validate_record(r) for r in records], schema=RESULT_SCHEMA)
