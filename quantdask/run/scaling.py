"""Scaling runs: the same sweep, run fresh at each worker count, and how the throughput grew.

>>> scaling = scale_sweep(load_sweep("data/demo_sweep.yaml"), "runs/scaling", [1, 2])
...  # doctest: +SKIP
>>> scaling_chart(scaling)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from quantdask.cluster.local import start_cluster
from quantdask.cluster.operations import cuda_device_count
from quantdask.errors import RunDirError, SpecError
from quantdask.process.machine_load import LoadMeter
from quantdask.run.sweep import run_sweep
from quantdask.store.readers import read_attempts, read_sessions, read_worker_tasks
from quantdask.store.run_store import write_parquet
from quantdask.store.summary import sweep_summary
from quantdask.sweepfile.sweep import Sweep, expand_grid

SCALING_FILE = "scaling.parquet"


def worker_counts_here(wanted: Sequence[int]) -> list[int]:
    """The counts of ``wanted`` this machine can run: all of them on CPU slots, those up to its
    GPU count on a GPU machine."""
    gpus = cuda_device_count()
    return [n for n in wanted if not gpus or n <= gpus]


def _check_worker_counts(workers: Sequence[int], gpus_here: int) -> list[int]:
    counts = list(workers)
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise SpecError("workers", f"must be positive integers like 1,2,4; got {counts!r}")
    if len(set(counts)) != len(counts):
        raise SpecError("workers", f"lists a count twice: {counts!r}")
    if gpus_here and max(counts) > gpus_here:
        raise SpecError("workers", f"asks for {max(counts)} workers but this machine has "
                                   f"{gpus_here} GPUs (one worker per GPU)")
    return sorted(counts)


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise RunDirError(f"{out_dir} already exists and is not empty: a scaling run starts "
                          "fresh, so give another --out (nothing there was changed)")


SHORT_SWEEP_JOBS = 16
"""A sweep of at most this many jobs is short: each count runs :data:`SHORT_REPEATS` times by
default (a longer one once)."""
SHORT_REPEATS = 3


def default_repeats(sweep: Sweep) -> int:
    """How many times each count runs when the caller does not say (see
    :data:`SHORT_SWEEP_JOBS`)."""
    return SHORT_REPEATS if len(expand_grid(sweep)) <= SHORT_SWEEP_JOBS else 1


def scaling_frame(summaries: list[dict[str, Any]]) -> pl.DataFrame:
    """Rows of :func:`~quantdask.store.summary.sweep_summary` (plus ``workers``, ``repeat``,
    ``run_dir`` and the machine's load), one per run, with the speedup and efficiency against
    the smallest count's run of the same repeat (the one beside it in time: the runs are
    interleaved, so drift in the machine's load falls on both sides); and each phase's own
    speedup, its makespan at the smallest count over its makespan at this one
    (``jobs_scaling_speedup``; ``search_scaling_speedup`` where the sweep searched)."""
    frame = pl.DataFrame(summaries).sort("repeat", "workers")
    smallest = frame["workers"].min()
    base = frame.filter(pl.col("workers") == smallest).select(
        "repeat", pl.col("throughput_jobs_per_min").alias("_base_throughput"),
        *[pl.col(f"{phase}_makespan_s").alias(f"_base_{phase}") for phase in PHASES])
    frame = frame.join(base, on="repeat", how="left")
    phases = [(pl.col(f"_base_{phase}") / pl.col(f"{phase}_makespan_s"))
              .alias(f"{phase}_scaling_speedup") for phase in PHASES]
    return frame.with_columns(
        (pl.col("throughput_jobs_per_min") / pl.col("_base_throughput"))
        .alias("scaling_speedup"), *phases,
    ).with_columns(
        (pl.col("scaling_speedup") / (pl.col("workers") / smallest))
        .alias("scaling_efficiency")
    ).drop("_base_throughput", *[f"_base_{phase}" for phase in PHASES]).sort("workers", "repeat")


PHASES = ("jobs", "search")
"""The phases whose own speedups the frame has (``sweep_summary``'s ``jobs_``, ``search_``)."""

NO_SPEEDUP = "no measurable speed-up"


def scaling_verdict(low: float | None, high: float | None, runs: int) -> str | None:
    """What a speedup's spread over ``runs`` runs (its least ``low``, its most ``high``) says:
    ``faster`` or ``slower`` where every run agrees, :data:`NO_SPEEDUP` where they straddle
    1.0 (the noise is larger than the effect), ``one run: no spread`` with a single run."""
    if low is None or high is None:
        return None
    if runs < 2:
        return "one run: no spread"
    return "faster" if low > 1.0 else "slower" if high < 1.0 else NO_SPEEDUP


def scaling_summary(scaling: pl.DataFrame) -> pl.DataFrame:
    """One row per worker count of a scaling frame: the median speedup over its runs, its
    least and most (the spread), the runs, and the verdict (:func:`scaling_verdict`); the same
    for each phase (``jobs_``, ``search_``: null where it did not run), and the median load."""
    columns = ["scaling", *(f"{phase}_scaling" for phase in PHASES)]
    grouped = scaling.group_by("workers").agg(
        pl.len().alias("runs"),
        *[agg for name in columns for agg in (
            pl.col(f"{name}_speedup").median().alias(f"{name}_speedup"),
            pl.col(f"{name}_speedup").min().alias(f"{name}_speedup_min"),
            pl.col(f"{name}_speedup").max().alias(f"{name}_speedup_max"))],
        pl.col("throughput_jobs_per_min").median(),
        pl.col("load_average").median(), pl.col("other_cpu_share").median()).sort("workers")
    smallest = grouped["workers"].min()
    verdicts = {f"{name}_verdict": [
        None if row["workers"] == smallest else scaling_verdict(
            row[f"{name}_speedup_min"], row[f"{name}_speedup_max"], row["runs"])
        for row in grouped.iter_rows(named=True)] for name in columns}
    return grouped.with_columns(*[pl.Series(name, values, dtype=pl.String)
                                  for name, values in verdicts.items()])


def read_scaling(out_dir: str | os.PathLike) -> pl.DataFrame:
    """The scaling frame a :func:`scale_sweep` run wrote to ``out_dir``; ``run_dir`` is each
    count's run directory, found inside ``out_dir`` wherever that has moved since."""
    path = Path(out_dir) / SCALING_FILE
    if not path.exists():
        raise RunDirError(f"no scaling run in {out_dir} ({SCALING_FILE} missing); "
                          "run `quantdask scale SWEEP --workers 1,2 --out DIR` first")
    frame = pl.read_parquet(path)
    # a measurement from before repeats and the load were recorded: one run per count
    missing = {"repeat": pl.lit(1, pl.Int64), "load_average": pl.lit(None, pl.Float64),
               "other_cpu_share": pl.lit(None, pl.Float64)}
    return frame.with_columns(
        *[value.alias(name) for name, value in missing.items() if name not in frame.columns],
        pl.concat_str(pl.lit(f"{Path(out_dir)}{os.sep}"), "run_dir").alias("run_dir"))


def scale_sweep(
    sweep: Sweep,
    out_dir: str | os.PathLike,
    workers: Sequence[int] = (1, 2, 4),
    host: str = "127.0.0.1",
    on_result: Callable[[dict[str, Any]], None] | None = None,
    on_count: Callable[[int, Path], None] | None = None,
    use_gpus: bool | None = None,
    repeats: int | None = None,
) -> pl.DataFrame:
    """Run every job of ``sweep`` fresh on a new cluster of each size in ``workers`` (a
    search's probing too: each phase's speedup is in the frame), ``repeats`` times each
    (default :func:`default_repeats`), interleaved (1, 2, 1, 2, ...: drift in the machine's
    load falls on every count alike); return the scaling frame, one row per run, with the
    machine's load beside it (``process.machine_load``). :func:`scaling_summary` gives each
    count's median speedup, its spread and verdict.

    Workers are GPUs when this machine has them (``use_gpus=False`` forces CPU slots). CPU slots
    each get the same torch threads at every count (the cores split over the largest count), so
    a worker is the same unit throughout, as a GPU would be. Each run has a run directory of its
    own in ``OUT_DIR`` (``workers-N``, ``workers-N-run-R`` with repeats), with every result and
    attempt; the frame is written to ``OUT_DIR/scaling.parquet``. ``OUT_DIR`` must be new or
    empty. ``on_count(n, run_dir)`` is called before each run starts.
    """
    out = Path(out_dir)
    gpus_here = cuda_device_count() if use_gpus is not False else 0
    counts = _check_worker_counts(workers, gpus_here)
    repeats = default_repeats(sweep) if repeats is None else repeats
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise SpecError("repeats", f"must be a positive integer, got {repeats!r}")
    _check_out_dir(out)
    threads = max(1, (os.cpu_count() or 1) // (max(counts) * sweep.jobs_per_gpu))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for repeat in range(1, repeats + 1):
        for n in counts:
            run_dir = out / (f"workers-{n}" if repeats == 1 else f"workers-{n}-run-{repeat}")
            if on_count is not None:
                on_count(n, run_dir)
            cluster = (start_cluster(gpus=list(range(n)), host=host,
                                     jobs_per_worker=sweep.jobs_per_gpu) if gpus_here else
                       start_cluster(workers=n, host=host, jobs_per_worker=sweep.jobs_per_gpu,
                                     torch_threads=threads))
            with cluster, LoadMeter() as load:
                run_sweep(sweep, run_dir, cluster.client, on_result=on_result)
            summary = sweep_summary(read_attempts(run_dir), read_sessions(run_dir),
                                    read_worker_tasks(run_dir))
            if summary.is_empty():
                raise RunDirError(f"the run at {n} workers recorded no attempts ({run_dir})")
            # A resumed run dir has several sessions; this one is fresh, so it has one.
            rows.append({**summary.row(-1, named=True), "workers": n, "repeat": repeat,
                         "run_dir": run_dir.name, **load.figures()})
    write_parquet(out / SCALING_FILE, scaling_frame(rows))
    return read_scaling(out)
