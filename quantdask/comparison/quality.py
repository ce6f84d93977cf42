"""The quality half of a comparison: whether two runs measured the same windows, whether each
model's reference (its baseline's log-likelihoods, the KL's kind, the BOS protocol) is the same,
and each matched job's KL, perplexity and top-1 difference, paired over the shared windows.

KL is against each run's own baseline: a changed reference moves every KL of its model, so it
is checked first and flagged above everything else.
"""

from __future__ import annotations

import math
from typing import Any

import polars as pl

from quantdask.comparison.paired import Difference, paired_difference, unpaired_difference
from quantdask.comparison.runs import RunFrames
from quantdask.words import BASELINE, Status

PAIRED, UNHASHED, DIFFERENT = "paired", "unpaired: no window hashes", "unpaired: windows differ"
"""How two jobs' windows compare: the same tokens (paired), a run recorded before windows
carried hashes (compared unpaired), or different tokens (only unpaired figures)."""

QUALITY_METRICS = {"kl_divergence": "kl", "perplexity": "ln_ppl",
                   "top1_agreement": "top1_agreement"}
"""Each quality metric of the results frame and the windows frame's column it comes from."""
_SE = {"kl_divergence": "kl_se", "perplexity": "ln_ppl_se",
       "top1_agreement": "top1_agreement_se"}


def window_pairing(windows_a: pl.DataFrame, windows_b: pl.DataFrame) -> str:
    """PAIRED, UNHASHED or DIFFERENT for two jobs' windows frames."""
    if windows_a.is_empty() or windows_b.is_empty():
        return UNHASHED
    hashes_a, hashes_b = (w.sort("window")["token_hash"].to_list()
                          for w in (windows_a, windows_b))
    if None in hashes_a or None in hashes_b:
        return UNHASHED
    return PAIRED if hashes_a == hashes_b else DIFFERENT


def _job_windows(run: RunFrames, job_id: str) -> pl.DataFrame:
    return run.windows.filter(pl.col("job_id") == job_id).sort("window")


def quality_tests(a: RunFrames, b: RunFrames, done: pl.DataFrame) -> list[dict[str, Any]]:
    """One row per (job done in both, quality metric): A's and B's figures, the difference
    B - A with its standard error and p (paired over the windows when they are the same), how
    the windows compare, and the job's identity. Verdicts come after (``compare``)."""
    rows = []
    results_a, results_b = a.results, b.results
    for job in done.iter_rows(named=True):
        wa, wb = _job_windows(a, job["job_id_a"]), _job_windows(b, job["job_id_b"])
        pairing = window_pairing(wa, wb)
        ra = results_a.row(by_predicate=pl.col("job_id") == job["job_id_a"], named=True)
        rb = results_b.row(by_predicate=pl.col("job_id") == job["job_id_b"], named=True)
        for metric, column in QUALITY_METRICS.items():
            if pairing == PAIRED:
                value_a, value_b, diff = _paired(metric, wa[column], wb[column])
            else:
                value_a, value_b, diff = _unpaired(metric, ra, rb, min(wa.height, wb.height))
            rows.append({"model": job["model"], "config_label": job["config_label"],
                         "job_id_a": job["job_id_a"], "job_id_b": job["job_id_b"],
                         "metric": metric, "task": None, "a": value_a, "b": value_b,
                         "diff": diff.diff, "se": diff.se, "p": diff.p, "n": diff.n,
                         "pairing": pairing})
    return rows


def _paired(metric: str, a: pl.Series, b: pl.Series) -> tuple[float, float, Difference]:
    diff = paired_difference(a.to_list(), b.to_list())
    mean_a = math.fsum(a.to_list()) / a.len()
    if metric != "perplexity":
        return mean_a, mean_a + diff.diff, diff
    # perplexity is exp of the mean ln_ppl: its difference and (delta method) standard error
    ppl_a, ppl_b = math.exp(mean_a), math.exp(mean_a + diff.diff)
    se = ppl_b * diff.se if diff.se is not None else None
    return ppl_a, ppl_b, Difference(ppl_b - ppl_a, se, diff.p, diff.n)


def _unpaired(metric: str, ra: dict, rb: dict, n: int) -> tuple[float, float, Difference]:
    value_a, value_b = ra[metric], rb[metric]
    se_a, se_b = ra[_SE[metric]], rb[_SE[metric]]
    if metric == "perplexity" and se_a is not None and se_b is not None:
        # the test on ln(perplexity), whose standard errors the runs record
        test = unpaired_difference(math.log(value_a), se_a, math.log(value_b), se_b, n)
        return value_a, value_b, Difference(value_b - value_a, math.hypot(
            value_a * se_a, value_b * se_b), test.p, n)
    return value_a, value_b, unpaired_difference(value_a, se_a, value_b, se_b, n)


REFERENCE_JITTER_NATS = 1e-3
"""A baseline window's mean log-likelihood moving by no more than this between two runs is the
same reference (GPU jitter; 0.1% of perplexity, a tenth of its default tolerance)."""


def reference_check(a: RunFrames, b: RunFrames, matched: pl.DataFrame) -> pl.DataFrame:
    """One row per model of the matched jobs: its baseline's perplexity in each run, the KL's
    kind and the eval BOS in each, the largest change of a window's log-likelihood, and
    whether the reference changed (then every KL of the model is against another model's
    distribution, or other windows)."""
    rows = []
    for model in sorted(set(matched["model"])):
        sides = [_baseline(run, model) for run in (a, b)]
        row: dict[str, Any] = {"model": model}
        for side, run, found in zip("ab", (a, b), sides):
            row[f"baseline_perplexity_{side}"] = found["perplexity"] if found else None
            row[f"kl_kind_{side}"] = _kinds(run.results, model)
            row[f"eval_bos_{side}"] = found["eval_bos_token_id"] if found else None
        row.update(_reference_change(a, b, sides, row))
        rows.append(row)
    return pl.DataFrame(rows, schema=REFERENCE_SCHEMA)


REFERENCE_SCHEMA = {
    "model": pl.String, "baseline_perplexity_a": pl.Float64, "baseline_perplexity_b": pl.Float64,
    "kl_kind_a": pl.String, "kl_kind_b": pl.String, "eval_bos_a": pl.Int64,
    "eval_bos_b": pl.Int64, "max_window_ln_ppl_change": pl.Float64, "changed": pl.Boolean,
    "note": pl.String}


def _baseline(run: RunFrames, model: str) -> dict | None:
    done = run.results.filter((pl.col("model") == model) & (pl.col("backend") == BASELINE)
                              & (pl.col("status") == Status.DONE))
    return done.row(0, named=True) if done.height else None


def _kinds(results: pl.DataFrame, model: str) -> str | None:
    kinds = sorted(set(results.filter(pl.col("model") == model)["kl_kind"].drop_nulls()))
    return ", ".join(kinds) or None


def _reference_change(a: RunFrames, b: RunFrames, sides: list[dict | None],
                      row: dict[str, Any]) -> dict[str, Any]:
    if None in sides:
        missing = "A" if sides[0] is None else "B"
        return {"max_window_ln_ppl_change": None, "changed": None,
                "note": f"run {missing} has no done baseline job of this model: the reference "
                        "cannot be checked"}
    assert sides[0] is not None and sides[1] is not None
    wa, wb = _job_windows(a, sides[0]["job_id"]), _job_windows(b, sides[1]["job_id"])
    pairing = window_pairing(wa, wb)
    change = None
    if pairing != DIFFERENT and wa.height == wb.height and wa.height:
        change = float((wa["ln_ppl"] - wb["ln_ppl"]).abs().max())  # type: ignore[arg-type]
    shown = change
    notes = []
    if change is not None and change <= REFERENCE_JITTER_NATS:
        change = None  # GPU jitter: the same reference
    if pairing == DIFFERENT:
        notes.append("the eval windows' tokens differ (text, tokenizer, seq_len or BOS)")
    if row["kl_kind_a"] != row["kl_kind_b"]:
        notes.append(f"the KL's kind changed ({row['kl_kind_a']} to {row['kl_kind_b']})")
    if row["eval_bos_a"] != row["eval_bos_b"]:
        notes.append(f"the eval BOS changed ({row['eval_bos_a']} to {row['eval_bos_b']})")
    if change is not None:
        notes.append(f"the baseline's log-likelihoods moved (largest window change "
                     f"{change:.3g} nats): a new library, device or kernel computes the "
                     "unquantized model differently, and every KL of the model is against it")
    return {"max_window_ln_ppl_change": shown, "changed": bool(notes),
            "note": "; ".join(notes) or "the same reference"}
