"""The two runs of a comparison: each run directory read and checked (nothing is written into
either), and their jobs matched by model and config label.

A job of A and one of B are the same job when they have the same model and config label
(``pairs`` matches labels that differ, e.g. a group size changed between the runs); a matched
pair whose options differ is listed among the changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from quantdask.errors import CompareError
from quantdask.store.environment import latest_environment
from quantdask.store.run_store import RunStore, read_frame
from quantdask.words import BASELINE, Status

INSTALL = "pip install 'quantdask[compare]'"


def need_scipy():
    """``scipy.stats``, or a :class:`CompareError` with the install command."""
    try:
        import scipy.stats
    except ImportError as missing:
        raise CompareError(f"quantdask compare needs scipy for its paired tests ({missing}); "
                           f"install it with: {INSTALL}") from missing
    return scipy.stats


MATCH_COLUMNS = ("model", "config_label")
"""What makes a job of one run the same job in another (``pairs`` aside)."""


@dataclass(frozen=True)
class RunFrames:
    """One run's frames a comparison reads, and its latest environment."""

    name: str  # the run directory as given
    results: pl.DataFrame
    windows: pl.DataFrame
    tasks: pl.DataFrame
    task_items: pl.DataFrame
    speed: pl.DataFrame
    environment: dict[str, str]
    running: bool  # a driver holds it: its figures may still change
    superseded: int = 0  # older results of a model and config label recorded again since


def read_run(run_dir: str | os.PathLike) -> RunFrames:
    """``run_dir``'s frames, or a :class:`CompareError` that says what is wrong with it."""
    store = RunStore(run_dir)
    path = Path(run_dir)
    if not path.is_dir():
        raise CompareError(f"no run directory at {run_dir}; give the run directory of a sweep "
                           "(runs/<sweep name> by default)")
    if not store.is_run_dir() or not (path / "jobs.json").is_file():
        missing = "results/" if not store.is_run_dir() else "jobs.json"
        raise CompareError(f"{run_dir} is not a whole run directory (it has no {missing}): "
                           "give one a sweep wrote, or run the sweep there first")
    results = store.read_results()
    if results.is_empty():
        raise CompareError(f"{run_dir} has no recorded job yet: nothing to compare")
    # A sweep changed and run again in the same directory (other eval or task settings make
    # other job ids) leaves the old results beside the new: the latest of each config counts.
    latest = results.sort("finished_at").unique(MATCH_COLUMNS, keep="last", maintain_order=True)
    frames = {name: read_frame(run_dir, name)
              for name in ("windows", "tasks", "task_items", "speed", "environment")}
    return RunFrames(str(run_dir), latest, frames["windows"], frames["tasks"],
                     frames["task_items"], frames["speed"],
                     latest_environment(frames["environment"]), store.is_locked(),
                     results.height - latest.height)


def matched_jobs(a: RunFrames, b: RunFrames, pairs: dict[str, str] | None = None
                 ) -> pl.DataFrame:
    """One row per job of A matched with one of B: its model and config label (A's, and B's
    where ``pairs`` maps A's to another), each side's job id, status, failure reason, backend
    and options (``config``)."""
    pairs = pairs or {}
    labels_b = set(b.results["config_label"])
    for label_a, label_b in pairs.items():
        if label_a not in set(a.results["config_label"]) or label_b not in labels_b:
            raise CompareError(f"--pair {label_a}={label_b}: A's config labels are "
                               f"{_listed(a.results['config_label'])}, B's "
                               f"{_listed(b.results['config_label'])}")
    side_a = _side(a.results, "a").with_columns(
        pl.col("config_label").replace(pairs).alias("label_b"))
    side_b = _side(b.results, "b").rename({"config_label": "label_b"})
    joined = side_a.join(side_b, on=["model", "label_b"], how="inner")
    if joined.is_empty():
        raise CompareError(
            f"no job of {a.name} matches one of {b.name} by model and config label: A has "
            f"{_listed(_keys(a.results))}, B has {_listed(_keys(b.results))}; compare runs of "
            "the same sweep, or match configs whose labels differ with --pair A_LABEL=B_LABEL")
    return joined.sort("model", "config_label")


def unmatched_jobs(a: RunFrames, b: RunFrames, matched: pl.DataFrame) -> pl.DataFrame:
    """Jobs present in one run only: run (a or b), job id, model, config label, status."""
    frames = []
    for side, run in (("a", a), ("b", b)):
        ids = set(matched[f"job_id_{side}"])
        frames.append(run.results.filter(~pl.col("job_id").is_in(list(ids)))
                      .select(pl.lit(side).alias("run"), "job_id", "model", "config_label",
                              "status"))
    return pl.concat(frames)


def _side(results: pl.DataFrame, side: str) -> pl.DataFrame:
    reason = pl.coalesce(pl.col("error_message"), pl.col("failure_class"))
    return results.select(
        "model", "config_label",
        *[pl.col(c).alias(f"{c}_{side}") for c in ("job_id", "status", "backend", "config")],
        reason.alias(f"reason_{side}"),
        (pl.col("backend") == BASELINE).alias(f"is_baseline_{side}"))


def _keys(results: pl.DataFrame) -> list[str]:
    return [f"{m}/{c}" for m, c in results.select(MATCH_COLUMNS).unique().sort(
        MATCH_COLUMNS).iter_rows()]


def _listed(values) -> str:
    values = sorted(set(values))
    return ", ".join(values[:12]) + (f" and {len(values) - 12} more" if len(values) > 12 else "")


def done_in_both(matched: pl.DataFrame) -> pl.DataFrame:
    """The matched jobs done in both runs (the ones with figures to compare)."""
    return matched.filter((pl.col("status_a") == Status.DONE) & (pl.col("status_b") == Status.DONE))
