"""``quantdask.compare(a, b)``: two run directories side by side, as frames.

>>> import quantdask as qd
>>> comparison = qd.compare("runs/demo", "runs/demo-after-upgrade")  # doctest: +SKIP
>>> comparison.environment        # what changed in the stack, first  # doctest: +SKIP
>>> comparison.quality.filter(pl.col("verdict") != "no detectable difference")  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import polars as pl

from quantdask.comparison.paired import holm
from quantdask.comparison.quality import quality_tests, reference_check
from quantdask.comparison.resources import memory_rows, speed_rows
from quantdask.comparison.runs import (
    done_in_both,
    matched_jobs,
    need_scipy,
    read_run,
    unmatched_jobs,
)
from quantdask.comparison.tasks import task_tests
from quantdask.comparison.verdicts import (
    ALPHA,
    DEFAULT_TOLERANCES,
    HIGHER_IS_WORSE,
    Tolerance,
    tolerance_for,
    verdict,
)
from quantdask.errors import CompareError
from quantdask.store.environment import environment_diff

ERROR_RATE = (f"verdicts control the family-wise error rate at {ALPHA:g} (Holm's adjustment "
              "over every quality and task test of this comparison whose figures differ)")


@dataclass(frozen=True)
class Comparison:
    """Two runs compared (each a frame; ``a`` and ``b`` columns are the runs' figures).

    - ``environment``: components whose versions or models differ (component, a, b);
    - ``reference``: per model, whether its reference changed (then every KL moved with it);
    - ``quality``: per matched job and metric (KL, perplexity, top-1), B - A with its paired
      standard error, p and Holm-adjusted p, the tolerance and the verdict;
    - ``tasks``: per matched job and task metric, the same, paired per question, with the
      questions flipped each way; ``flips``: those questions;
    - ``speed``, ``memory``: ratios B / A with each side's spread, and verdicts;
    - ``status``: matched jobs whose status differs, with both reasons; ``config``: matched
      jobs whose options differ; ``only_in_one``: jobs of one run only;
    - ``notes``: what the reader must know first (a changed reference, unpaired windows...).
    """

    a: str
    b: str
    environment: pl.DataFrame
    reference: pl.DataFrame
    quality: pl.DataFrame
    tasks: pl.DataFrame
    flips: pl.DataFrame
    speed: pl.DataFrame
    memory: pl.DataFrame
    status: pl.DataFrame
    config: pl.DataFrame
    only_in_one: pl.DataFrame
    tolerances: dict[str, Tolerance]
    notes: list[str] = field(default_factory=list)
    error_rate: str = ERROR_RATE


TEST_SCHEMA = {
    "model": pl.String, "config_label": pl.String, "job_id_a": pl.String, "job_id_b": pl.String,
    "task": pl.String, "metric": pl.String, "filter": pl.String, "a": pl.Float64,
    "b": pl.Float64, "diff": pl.Float64, "se": pl.Float64, "p": pl.Float64, "n": pl.Int64,
    "pairing": pl.String, "higher_is_better": pl.Boolean, "flipped_to_wrong": pl.Int64,
    "flipped_to_right": pl.Int64}


def compare(run_a: str | os.PathLike, run_b: str | os.PathLike,
            pairs: dict[str, str] | None = None,
            tolerances: Mapping[str, str | Tolerance] | None = None) -> Comparison:
    """Compare run directory ``run_b`` against ``run_a`` (B - A; ratios B / A). ``pairs``
    matches a config label of A with another of B; ``tolerances`` overrides the practical
    tolerance of a metric (``{"kl_divergence": "2%"}``; ``task`` for every task metric).
    Raises :class:`~quantdask.comparison.runs.CompareError` when the runs cannot be compared.
    Nothing is written into either run."""
    need_scipy()
    tols = {**DEFAULT_TOLERANCES, **{k: v if isinstance(v, Tolerance) else Tolerance.parse(v)
                                     for k, v in (tolerances or {}).items()}}
    a, b = read_run(run_a), read_run(run_b)
    matched = matched_jobs(a, b, pairs)
    done = done_in_both(matched)
    quality = quality_tests(a, b, done)
    task_rows, flips = task_tests(a, b, done)
    tests = pl.DataFrame(quality + task_rows, schema=TEST_SCHEMA)
    _check_tolerance_names(tols, tests)
    tests = _with_verdicts(tests, tols)
    reference = reference_check(a, b, matched)
    return Comparison(
        a=a.name, b=b.name, environment=environment_diff(a.environment, b.environment),
        reference=reference, quality=tests.filter(pl.col("task").is_null()).drop(
            "task", "filter", "higher_is_better", "flipped_to_wrong", "flipped_to_right"),
        tasks=tests.filter(pl.col("task").is_not_null()), flips=flips,
        speed=speed_rows(a, b, done, tols["decode_tokens_per_s"]),
        memory=memory_rows(a, b, done, tols["peak_device_mem_bytes"]),
        status=_status_changes(matched), config=_config_changes(matched),
        only_in_one=unmatched_jobs(a, b, matched), tolerances=tols,
        notes=_notes(a, b, reference, tests))


def _check_tolerance_names(tols: dict[str, Tolerance], tests: pl.DataFrame) -> None:
    tasks = tests.filter(pl.col("task").is_not_null())
    known = set(DEFAULT_TOLERANCES) | set(tasks["metric"]) | {
        f"{t}:{m}" for t, m in tasks.select("task", "metric").iter_rows()}
    unknown = sorted(set(tols) - known)
    if unknown:
        raise CompareError(f"--tolerance {', '.join(unknown)}: no such metric in this "
                           f"comparison; its metrics: {', '.join(sorted(known))}")


def _with_verdicts(tests: pl.DataFrame, tols: dict[str, Tolerance]) -> pl.DataFrame:
    # A test of identical figures (a deterministic rerun: difference 0, error 0) can never be
    # rejected: it stays out of Holm's family (p 1), which would only lose power with it.
    identical = [d == 0.0 and se == 0.0 for d, se in zip(tests["diff"], tests["se"])]
    family = holm([None if same else p for same, p in zip(identical, tests["p"])])
    adjusted = [1.0 if same else p for same, p in zip(identical, family)]
    verdicts, shown = [], []
    for row, p_adj in zip(tests.iter_rows(named=True), adjusted):
        name = row["metric"] if row["task"] is None else f"{row['task']}:{row['metric']}"
        tolerance = tolerance_for(name, tols)
        worse_up = (HIGHER_IS_WORSE[row["metric"]] if row["task"] is None
                    else row["higher_is_better"] is False)
        verdicts.append(verdict(row["diff"], row["a"], p_adj, tolerance, worse_up))
        shown.append(str(tolerance))
    return tests.with_columns(pl.Series("p_adjusted", adjusted, dtype=pl.Float64),
                              pl.Series("tolerance", shown, dtype=pl.String),
                              pl.Series("verdict", verdicts, dtype=pl.String))


def _status_changes(matched: pl.DataFrame) -> pl.DataFrame:
    return matched.filter(pl.col("status_a") != pl.col("status_b")).select(
        "model", "config_label", "status_a", "status_b", "reason_a", "reason_b")


def _config_changes(matched: pl.DataFrame) -> pl.DataFrame:
    return matched.filter((pl.col("config_a") != pl.col("config_b"))
                          | (pl.col("backend_a") != pl.col("backend_b"))
                          | (pl.col("config_label") != pl.col("label_b"))).select(
        "model", "config_label", pl.col("label_b").alias("config_label_b"), "backend_a",
        "backend_b", "config_a", "config_b")


def _notes(a, b, reference: pl.DataFrame, tests: pl.DataFrame) -> list[str]:
    notes = [f"the reference of {row['model']} changed: {row['note']}"
             for row in reference.filter(pl.col("changed").fill_null(False)).iter_rows(
                 named=True)]
    notes += [f"{row['model']}: {row['note']}" for row in reference.filter(
        pl.col("changed").is_null()).iter_rows(named=True)]
    for pairing, count in tests.filter(pl.col("pairing").str.starts_with("unpaired")).group_by(
            "pairing").len().sort("pairing").iter_rows():
        notes.append(f"{count} figures compared {pairing} (two means with their standard "
                     "errors: weaker than a paired test)")
    for run in (a, b):
        if run.superseded:
            notes.append(f"{run.name}: {run.superseded} older results of a config recorded "
                         "again since (its sweep changed and ran there again) are left out; "
                         "the latest of each counts")
        if run.running:
            notes.append(f"{run.name} is being written by a running sweep: its figures may "
                         "still change")
    return notes
