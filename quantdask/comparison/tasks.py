"""The task half of a comparison: each matched job's task metrics compared question by question
(the task items frame): McNemar's exact test on the questions that flipped for a right/wrong
metric, a paired bootstrap for any other; the flipped questions themselves for the report.

A run recorded before per-question scores is compared unpaired (lm-eval's standard errors).
"""

from __future__ import annotations

from typing import Any

import polars as pl

from quantdask.comparison.paired import mcnemar, paired_bootstrap, unpaired_difference
from quantdask.comparison.runs import RunFrames

PER_QUESTION, NO_ITEMS = "paired per question", "unpaired: no per-question scores"
QUESTIONS_DIFFER = "unpaired: questions differ"
_KEYS = ["task", "metric", "filter"]


def task_tests(a: RunFrames, b: RunFrames, done: pl.DataFrame
               ) -> tuple[list[dict[str, Any]], pl.DataFrame]:
    """One row per (job done in both, task, metric, filter) with A's and B's value, B - A, its
    standard error and p, and the flipped counts; and the flipped questions (job, task,
    metric, doc_id, A's and B's score)."""
    rows: list[dict[str, Any]] = []
    flips = []
    for job in done.iter_rows(named=True):
        ia = a.task_items.filter(pl.col("job_id") == job["job_id_a"])
        ib = b.task_items.filter(pl.col("job_id") == job["job_id_b"])
        ta = a.tasks.filter((pl.col("job_id") == job["job_id_a"]) & ~pl.col("is_group"))
        tb = b.tasks.filter((pl.col("job_id") == job["job_id_b"]) & ~pl.col("is_group"))
        both = ta.join(tb, on=_KEYS, suffix="_b")
        for task in both.iter_rows(named=True):
            key = {k: task[k] for k in _KEYS}
            row, flipped = _compare_task(key, _items(ia, key), _items(ib, key), task)
            rows.append({"model": job["model"], "config_label": job["config_label"],
                         "job_id_a": job["job_id_a"], "job_id_b": job["job_id_b"], **row})
            if flipped is not None and flipped.height:
                flips.append(flipped.select(
                    pl.lit(job["model"]).alias("model"),
                    pl.lit(job["config_label"]).alias("config_label"), *_KEYS, "doc_id",
                    "value_a", "value_b"))
    flip_frame = pl.concat(flips) if flips else pl.DataFrame(schema=FLIP_SCHEMA)
    return rows, flip_frame


FLIP_SCHEMA = {"model": pl.String, "config_label": pl.String, "task": pl.String,
               "metric": pl.String, "filter": pl.String, "doc_id": pl.Int64,
               "value_a": pl.Float64, "value_b": pl.Float64}


def _items(items: pl.DataFrame, key: dict[str, Any]) -> pl.DataFrame:
    return items.filter(pl.all_horizontal(pl.col(k) == v for k, v in key.items()))


def _compare_task(key: dict[str, Any], items_a: pl.DataFrame, items_b: pl.DataFrame,
                  task: dict[str, Any]) -> tuple[dict[str, Any], pl.DataFrame | None]:
    row = {"metric": key["metric"], "task": key["task"], "filter": key["filter"],
           "higher_is_better": task["higher_is_better"]}
    same_questions = (items_a.height > 0 and items_a.height == items_b.height
                      and set(items_a["doc_id"]) == set(items_b["doc_id"]))
    if not same_questions:
        pairing = NO_ITEMS if items_a.is_empty() or items_b.is_empty() else QUESTIONS_DIFFER
        unpaired = {**row, "a": task["value"], "b": task["value_b"], "diff": None, "se": None,
                    "p": None, "n": task["samples"] or 0, "pairing": pairing,
                    "flipped_to_wrong": None, "flipped_to_right": None}
        if task["value"] is None or task["value_b"] is None:  # lm-eval gave no figure
            return unpaired, None
        diff = unpaired_difference(task["value"], task["stderr"], task["value_b"],
                                   task["stderr_b"], task["samples"] or 0)
        return {**unpaired, "diff": diff.diff, "se": diff.se, "p": diff.p}, None
    pairs = items_a.join(items_b, on="doc_id", suffix="_b").rename(
        {"value": "value_a"}).sort("doc_id")
    va, vb = pairs["value_a"], pairs["value_b"]
    binary = set(va.to_list()) | set(vb.to_list()) <= {0.0, 1.0}
    to_wrong = to_right = None
    if binary:
        to_wrong = int(((va == 1.0) & (vb == 0.0)).sum())
        to_right = int(((va == 0.0) & (vb == 1.0)).sum())
        diff = mcnemar(to_wrong, to_right, pairs.height)
    else:
        diff = paired_bootstrap(va.to_list(), vb.to_list())
    flipped = pairs.filter(pl.col("value_a") != pl.col("value_b"))
    return {**row, "a": float(va.mean()), "b": float(vb.mean()),  # type: ignore[arg-type]
            "diff": diff.diff, "se": diff.se, "p": diff.p, "n": diff.n,
            "pairing": PER_QUESTION, "flipped_to_wrong": to_wrong,
            "flipped_to_right": to_right}, flipped
