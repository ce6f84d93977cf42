"""``keep: pareto`` once a sweep ends: the artifacts of jobs off each model's size/KL frontier are
deleted, and their results say so (``artifact_kept: false``; where they were and their digest
stay on record)."""

from __future__ import annotations

import logging
import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import polars as pl

    from quantdask.store.run_store import RunStore
    from quantdask.sweepfile.settings import ArtifactSettings


def dominated(results: pl.DataFrame, windows: pl.DataFrame | None = None) -> list[str]:
    """Job ids of done jobs with a kept artifact off their model's size (``size_bytes``)
    against KL frontier, ties not ranked (``pareto_frontier``, paired over ``windows``)."""
    import polars as pl

    from quantdask.store.frontier import pareto_frontier

    kept = results.filter(pl.col("artifact_kept").fill_null(False))
    frontier = pareto_frontier(kept, cost="size_bytes", windows=windows)
    return frontier.filter(~pl.col("pareto"))["job_id"].to_list()


def prune_to_pareto(store: RunStore, settings: ArtifactSettings) -> list[str]:
    """Delete the artifacts of the dominated jobs (:func:`dominated`) and record them as not
    kept (``artifact_kept`` false, the location and digest stay as a record of what was
    made); return their job ids."""
    results = store.read_results()
    pruned = dominated(results, store.read("windows"))
    for row in results.filter(results["job_id"].is_in(pruned)).iter_rows(named=True):
        location = settings.location(row["job_id"])
        if settings.is_url:
            import fsspec

            fs, path = fsspec.core.url_to_fs(location)
            if fs.exists(path):
                fs.rm(path, recursive=True)
        else:
            shutil.rmtree(location, ignore_errors=True)
        store.write_result({k: v for k, v in {**row, "artifact_kept": False}.items()
                            if v is not None})
        logging.getLogger("quantdask.artifacts").info(
            "artifact of %s deleted: off the size/KL Pareto frontier", row["job_id"])
    return pruned
