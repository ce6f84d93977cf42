"""What earlier runs in a run directory measured, for placement to learn from: the done
results, their phases, and the options each row was run with."""

from __future__ import annotations

import json
import os

import polars as pl

from quantdask.backends import BackendOptions, get_backend
from quantdask.errors import SpecError
from quantdask.words import Status


def stored_options(row: dict) -> BackendOptions | None:
    """The options of a results row (its ``config``, as JSON); None when its backend no longer
    takes them."""
    try:
        return get_backend(row["backend"]).normalize(json.loads(row["config"]), "config")
    except SpecError:
        return None


def done_results(run_dir: str | os.PathLike | None) -> pl.DataFrame:
    """The done results already in ``run_dir`` (empty without any)."""
    from quantdask.store.readers import read_results

    if run_dir is None or not os.path.isdir(run_dir):
        return pl.DataFrame()
    results = read_results(run_dir)
    return results.filter(pl.col("status") == Status.DONE) if results.height else results


def done_phases(run_dir: str | os.PathLike | None) -> pl.DataFrame:
    """The phases frame already in ``run_dir`` (empty without one)."""
    from quantdask.store.run_store import read_frame

    if run_dir is None or not os.path.isdir(run_dir):
        return pl.DataFrame()
    return read_frame(run_dir, "phases")
