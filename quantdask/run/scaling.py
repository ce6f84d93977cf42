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
from quantdask.run.sweep import run_sweep
from quantdask.store.readers import read_attempts, read_sessions, read_worker_tasks
from quantdask.store.run_store import write_parquet
from quantdask.store.summary import sweep_summary
from quantdask.sweepfile.sweep import Sweep

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


def scaling_frame(summaries: list[dict[str, Any]]) -> pl.DataFrame:
    """Rows of :func:`~quantdask.store.summary.sweep_summary` (plus ``workers`` and ``run_dir``),
    one per worker count, with the speedup and efficiency against the smallest count; and each
    phase's own speedup, its makespan at the smallest count over its makespan at this one
    (``jobs_scaling_speedup``; ``search_scaling_speedup`` where the sweep searched)."""
    frame = pl.DataFrame(summaries).sort("workers")
    base = frame.row(0, named=True)
    phases = [(pl.lit(base[f"{phase}_makespan_s"]) / pl.col(f"{phase}_makespan_s"))
              .alias(f"{phase}_scaling_speedup") for phase in ("jobs", "search")]
    return frame.with_columns(
        (pl.col("throughput_jobs_per_min") / base["throughput_jobs_per_min"])
        .alias("scaling_speedup"), *phases,
    ).with_columns(
        (pl.col("scaling_speedup") / (pl.col("workers") / base["workers"]))
        .alias("scaling_efficiency"))


def read_scaling(out_dir: str | os.PathLike) -> pl.DataFrame:
    """The scaling frame a :func:`scale_sweep` run wrote to ``out_dir``; ``run_dir`` is each
    count's run directory, found inside ``out_dir`` wherever that has moved since."""
    path = Path(out_dir) / SCALING_FILE
    if not path.exists():
        raise RunDirError(f"no scaling run in {out_dir} ({SCALING_FILE} missing); "
                          "run `quantdask scale SWEEP --workers 1,2 --out DIR` first")
    return pl.read_parquet(path).with_columns(
        pl.concat_str(pl.lit(f"{Path(out_dir)}{os.sep}"), "run_dir").alias("run_dir"))


def scale_sweep(
    sweep: Sweep,
    out_dir: str | os.PathLike,
    workers: Sequence[int] = (1, 2, 4),
    host: str = "127.0.0.1",
    on_result: Callable[[dict[str, Any]], None] | None = None,
    on_count: Callable[[int, Path], None] | None = None,
    use_gpus: bool | None = None,
) -> pl.DataFrame:
    """Run every job of ``sweep`` fresh on a new cluster of each size in ``workers`` (a
    search's probing too: each phase's speedup is in the frame); return the scaling frame.

    Workers are GPUs when this machine has them (``use_gpus=False`` forces CPU slots). CPU slots
    each get the same torch threads at every count (the cores split over the largest count), so
    a worker is the same unit throughout, as a GPU would be. Each count runs in
    ``OUT_DIR/workers-N`` (a run directory of its own, with every result and attempt); the frame
    is written to ``OUT_DIR/scaling.parquet``. ``OUT_DIR`` must be new or empty.
    ``on_count(n, run_dir)`` is called before each count starts.
    """
    out = Path(out_dir)
    gpus_here = cuda_device_count() if use_gpus is not False else 0
    counts = _check_worker_counts(workers, gpus_here)
    _check_out_dir(out)
    threads = max(1, (os.cpu_count() or 1) // (max(counts) * sweep.jobs_per_gpu))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in counts:
        run_dir = out / f"workers-{n}"
        if on_count is not None:
            on_count(n, run_dir)
        cluster = (start_cluster(gpus=list(range(n)), host=host,
                                 jobs_per_worker=sweep.jobs_per_gpu) if gpus_here else
                   start_cluster(workers=n, host=host, jobs_per_worker=sweep.jobs_per_gpu,
                                 torch_threads=threads))
        with cluster:
            run_sweep(sweep, run_dir, cluster.client, on_result=on_result)
        summary = sweep_summary(read_attempts(run_dir), read_sessions(run_dir),
                                read_worker_tasks(run_dir))
        if summary.is_empty():
            raise RunDirError(f"the run at {n} workers recorded no attempts ({run_dir})")
        # A resumed run dir has several sessions; this one is fresh, so it has one.
        rows.append({**summary.row(-1, named=True), "workers": n, "run_dir": run_dir.name})
    write_parquet(out / SCALING_FILE, scaling_frame(rows))
    return read_scaling(out)
