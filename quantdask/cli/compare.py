"""``quantdask compare RUN_A RUN_B``: the comparison's verdict tables on the terminal, its HTML
report on request, and its regression gates (exit 3 when one fails, 2 on bad input)."""

from __future__ import annotations

from typing import Any

import polars as pl

from quantdask.cli.exits import EXIT_GATE_FAILED
from quantdask.cli.render import table
from quantdask.errors import CompareError


def _pairs(texts: list[str]) -> dict[str, str]:
    pairs = {}
    for text in texts:
        a, sep, b = text.partition("=")
        if not sep or not a.strip() or not b.strip():
            raise CompareError(f"--pair {text!r}: write A_LABEL=B_LABEL (a config label of "
                               "run A, then the one of run B to compare it with)")
        pairs[a.strip()] = b.strip()
    return pairs


def _tolerances(texts: list[str]) -> dict[str, str]:
    found = {}
    for text in texts:
        metric, sep, amount = text.partition("=")
        if not sep:
            raise CompareError(f"--tolerance {text!r}: write METRIC=N% or METRIC=X, e.g. "
                               "kl_divergence=2% (task: every task metric)")
        found[metric.strip()] = amount.strip()
    return found


def cmd_compare(args) -> int:
    from quantdask.comparison.compare import compare
    from quantdask.comparison.gates import failed_gates, parse_gate

    gates = [parse_gate(text) for text in args.fail_on]  # a malformed gate: before anything
    pairs, tolerances = _pairs(args.pair), _tolerances(args.tolerance)
    comparison = compare(args.run_a, args.run_b, pairs, tolerances)
    failures = failed_gates(comparison, gates)  # a gate naming no metric: before printing
    print("\n".join(comparison_lines(comparison)))
    if args.html:
        from quantdask.report.compare import write_compare_report

        written = write_compare_report(args.run_a, args.run_b, args.html, pairs, tolerances)
        print(f"compare report: {written}")
    for line in failures:
        print(f"gate failed: {line}")
    if gates:
        print(f"{len(failures)} gate failures (exit {EXIT_GATE_FAILED})" if failures
              else f"every gate passed ({len(gates)})")
    return EXIT_GATE_FAILED if failures else 0


def comparison_lines(comparison) -> list[str]:
    """The comparison as the terminal shows it: what the reader must know first, the
    environment's differences, then each section's table."""
    lines = [f"A: {comparison.a}", f"B: {comparison.b}"]
    lines += [f"note: {note}" for note in comparison.notes]
    lines += _section("environment differences", comparison.environment,
                      ["component", "a", "b"], "no difference")
    changed = comparison.reference.filter(pl.col("changed").fill_null(True))
    lines += _section("references changed (every KL of the model moved with it)", changed,
                      ["model", "baseline_perplexity_a", "baseline_perplexity_b", "note"],
                      "none: each model's reference is the same")
    lines += _section("quality (B - A, paired over the shared windows)",
                      _shown(comparison.quality),
                      ["model", "config_label", "metric", "a", "b", "change", "p_adjusted",
                       "pairing", "verdict"], "no job done in both runs")
    lines += _section("tasks (B - A, paired per question)", _shown(comparison.tasks),
                      ["model", "config_label", "task", "metric", "a", "b", "change",
                       "flipped_to_wrong", "flipped_to_right", "p_adjusted", "verdict"],
                      "no task scored in both runs")
    lines += _section("decode speed (B / A; a decode step's median and p90 seconds)",
                      comparison.speed,
                      ["model", "config_label", "batch_size", "decode_ratio", "decode_s_p50_a",
                       "decode_s_p90_a", "decode_s_p50_b", "decode_s_p90_b", "prefill_ratio",
                       "verdict"], "not timed in both runs")
    lines += _section("memory (B / A)", comparison.memory,
                      ["model", "config_label", "peak_device_mem_bytes_ratio",
                       "peak_host_rss_bytes_ratio", "size_bytes_ratio", "wall_s_ratio",
                       "verdict"], "no job done in both runs")
    lines += _section("status changed", comparison.status,
                      ["model", "config_label", "status_a", "status_b", "reason_a", "reason_b"],
                      "no job")
    lines += _section("options changed", comparison.config,
                      ["model", "config_label", "config_label_b", "config_a", "config_b"],
                      "no job")
    lines += _section("jobs in one run only", comparison.only_in_one,
                      ["run", "model", "config_label", "status"], "no job")
    lines.append(f"error rate: {comparison.error_rate}; tolerances: " + ", ".join(
        f"{m} {t}" for m, t in comparison.tolerances.items()))
    return lines


def _shown(tests: pl.DataFrame) -> pl.DataFrame:
    """B - A with its standard error, as one column."""
    def change(row: dict[str, Any]) -> str:
        if row["diff"] is None:
            return "-"
        se = f" ± {row['se']:.2g}" if row["se"] is not None else ""
        return f"{row['diff']:+.4g}{se}"

    return tests.with_columns(pl.Series("change", [change(r) for r in tests.iter_rows(
        named=True)], dtype=pl.String))


def _section(title: str, frame: pl.DataFrame, columns: list[str], empty: str) -> list[str]:
    if frame.is_empty():
        return ["", f"{title}: {empty}"]
    return ["", f"{title}:", table(frame.to_dicts(), columns)]
