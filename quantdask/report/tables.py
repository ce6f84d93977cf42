"""Tables for people: any of the report's frames as a Great Tables table (Polars'
``DataFrame.style``), in the report and the notebooks.

Formats follow the column names quantdask uses: ``*_bytes`` in MiB / GiB, ``*_s`` in s or min,
shares in %, other figures to 4 significant digits, counts with thousands separators; labels in
words; statuses coloured; the baseline's row set apart; long text on one line, whole on hover.
No dtype row, no quotes, nothing fetched from the network.

>>> table(report.jobs_table(results))  # doctest: +SKIP
"""

from __future__ import annotations

import html
import re

import polars as pl

from quantdask.words import Status

LONG_TEXT = 48
"""Characters of a cell shown before it is collapsed (the whole text on hover)."""
SHARES = {"quantized_share", "utilization", "efficiency", "scaling_efficiency", "recovery",
          "top1"}
"""Fractions shown as percentages (besides columns named ``*_share``)."""
LABELS = {
    "config_label": "config", "bits_per_weight": "bits / weight",
    "bits_per_quantized_weight": "bits / quantized weight", "quantized_share": "quantized",
    "unquantized_dtypes": "the rest is", "full_precision": "left in full precision",
    "size_bytes": "size", "ppl": "perplexity", "vs_baseline": "ln PPL ratio",
    "kl": "KL (nats/token)", "kl_p99": "KL p99 (nats/token)", "top1": "top-1 agreement",
    "delta_p": "Δp correct token", "wall_s": "wall time",
    "peak_device_mem_bytes": "peak device memory",
    "failure_class": "failure", "job_id": "job id", "tied_with": "tied (on KL) with",
    "error_class": "error", "artifact_kept": "kept", "artifact_bytes": "on disk",
    "kl_divergence": "KL (nats/token)", "reload_kl_delta": "reload KL Δ",
    "artifact_error": "save error", "artifact_uri": "where",
    "recovery_%": "recovery (%)", "ttft_ms": "first token (ms)",
    "decode_ms_p50": "decode step p50 (ms)", "decode_ms_p90": "decode step p90 (ms)",
    "decode_tokens_per_s": "decode tokens/s", "decode_speedup": "decode speed-up (×)",
    "prefill_speedup": "prefill speed-up (×)", "makespan_s": "makespan",
    "busy_s": "busy", "idle_s": "idle",
}
STATUS_COLORS = {Status.DONE: "#e3f1df", Status.FAILED: "#fbe0df", Status.SKIPPED: "#ecebe8"}


def _label(name: str) -> str:
    return LABELS.get(name, name.replace("_", " "))


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value < 60:
        return f"{value:.3g} s"
    if value < 3600:
        return f"{value / 60:.3g} min"
    return f"{value / 3600:.3g} h"


def _collapsed(value: str | None) -> str:
    """One line, the whole text in a tooltip when it is long."""
    if value is None:
        return "–"
    one_line = re.sub(r"\s+", " ", value).strip()
    if len(one_line) <= LONG_TEXT:
        return html.escape(one_line)
    return (f'<span title="{html.escape(value)}">{html.escape(one_line[:LONG_TEXT])}…'
            "</span>")


def table(frame: pl.DataFrame, title: str | None = None):
    """``frame`` as a Great Tables table (see the module)."""
    from great_tables import GT, loc, style

    frame = frame.with_columns(pl.col(pl.Boolean).replace_strict(
        {True: "yes", False: "no"}, default=None, return_dtype=pl.String))
    gt = GT(frame)
    if title:
        gt = gt.tab_header(title=title)
    for name, dtype in frame.schema.items():
        share = name in SHARES or name.endswith("_share")
        if name.endswith("_bytes") and dtype.is_integer():
            gt = gt.fmt_bytes(columns=name, standard="binary", decimals=1)
        elif name.endswith("_s") and not name.endswith("_per_s") and dtype.is_numeric():
            gt = gt.fmt(columns=name, fns=_seconds)
        elif share and dtype.is_numeric():
            gt = gt.fmt_percent(columns=name, decimals=1)
        elif dtype.is_integer():
            gt = gt.fmt_integer(columns=name)
        elif dtype.is_float():
            gt = gt.fmt_number(columns=name, n_sigfig=4)
        elif dtype == pl.String:
            gt = gt.fmt(columns=name, fns=_collapsed)
    gt = gt.cols_label({name: _label(name) for name in frame.columns}).sub_missing(
        missing_text="–")
    if "status" in frame.columns:
        for status, color in STATUS_COLORS.items():
            rows = [i for i, s in enumerate(frame["status"].to_list()) if s == status]
            if rows:
                gt = gt.tab_style(style.fill(color=color), loc.body(columns="status", rows=rows))
    label = next((c for c in ("config_label", "config") if c in frame.columns), None)
    if label is not None:
        baseline = [i for i, v in enumerate(frame[label].to_list()) if v == "baseline"]
        if baseline:
            gt = gt.tab_style([style.text(style="italic"), style.borders(sides="bottom")],
                              loc.body(rows=baseline))
    return gt.opt_row_striping()
