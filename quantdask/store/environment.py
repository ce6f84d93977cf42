"""A run's environment as one value per component: the latest session's driver and workers
(``run.environment`` records them), a component on which they differ shown with each value's
processes. ``quantdask status`` and the report show it; ``quantdask compare`` diffs two."""

from __future__ import annotations

import polars as pl

LISTED_FIRST = ("quantdask", "quantdask_commit", "python", "torch", "transformers",
                "bitsandbytes", "cuda", "gpu_driver", "gpu", "cpu", "os")
"""Components shown first, in this order (the rest follow by name)."""


def latest_environment(environment: pl.DataFrame) -> dict[str, str]:
    """``component -> value`` of the last session recorded in ``environment`` (the frame);
    where its processes differ, each value with the processes that have it
    (``2.5.1 (driver, tcp://..); 2.4.0 (tcp://..)``). Empty for a run recorded before the
    environment was."""
    if environment.is_empty():
        return {}
    last = environment.sort("captured_at").get_column("run_id")[-1]
    session = environment.filter(pl.col("run_id") == last)
    values: dict[str, dict[str, list[str]]] = {}
    for row in session.sort("process").iter_rows(named=True):
        values.setdefault(row["component"], {}).setdefault(row["value"], []).append(
            row["process"])
    ordered = [c for c in LISTED_FIRST if c in values] + sorted(set(values) - set(LISTED_FIRST))
    return {component: _joined(values[component]) for component in ordered}


def _joined(by_value: dict[str, list[str]]) -> str:
    if len(by_value) == 1:
        return next(iter(by_value))
    return "; ".join(f"{value} ({', '.join(processes)})"
                     for value, processes in sorted(by_value.items()))


def environment_diff(a: dict[str, str], b: dict[str, str]) -> pl.DataFrame:
    """The components whose values differ between two runs' environments (one missing on a
    side is null there): columns component, a, b."""
    components = list(dict.fromkeys([*a, *b]))
    rows = [{"component": c, "a": a.get(c), "b": b.get(c)} for c in components
            if a.get(c) != b.get(c)]
    return pl.DataFrame(rows, schema={"component": pl.String, "a": pl.String, "b": pl.String})


def environment_table(environment: pl.DataFrame) -> pl.DataFrame:
    """The report's table of the latest session's environment: component, value (a library
    not installed left out)."""
    from quantdask.process.environment import NOT_INSTALLED

    rows = [{"component": c, "value": v} for c, v in latest_environment(environment).items()
            if v != NOT_INSTALLED]
    return pl.DataFrame(rows, schema={"component": pl.String, "value": pl.String})
