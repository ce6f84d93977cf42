"""The run directory: one Parquet file per finished job, written atomically, read back as Polars.

Layout::

    RUN_DIR/jobs.json               the planned jobs of the last sweep run here
    RUN_DIR/results/<job_id>.parquet  one row per finished job (the results schema)
    RUN_DIR/layers/<job_id>.parquet   per-layer error of a done job, written before its result
    RUN_DIR/samples/<worker>-<ns>.parquet  device samples (utilization, memory over time)
    RUN_DIR/logs/jobs/<job_id>.log    a job's log, every attempt
    RUN_DIR/logs/workers/worker-<name>.log  a worker's log, every job it ran
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import polars as pl

from quantdask.errors import RunDirError
from quantdask.schema import (
    LAYER_SCHEMA,
    RESULT_SCHEMA,
    SAMPLE_SCHEMA,
    empty_frame,
    records_to_frame,
    rows_to_frame,
)

FINAL_STATUSES = ("done", "skipped")
"""Statuses a rerun keeps. A failed job is tried again by the next run of its sweep."""

_SAFE_NAME = re.compile(r"[^\w.-]+")


def _atomic_write(path: Path, write) -> None:
    """Write through a temporary file in the same directory, then rename: all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunStore:
    """Durable results of the sweeps run in ``run_dir``."""

    def __init__(self, run_dir: str | os.PathLike):
        self.root = Path(run_dir)
        if self.root.exists() and not self.root.is_dir():
            raise RunDirError(f"run directory {self.root} exists and is not a directory")
        self.results_dir = self.root / "results"
        self.layers_dir = self.root / "layers"
        self.samples_dir = self.root / "samples"
        self.job_logs_dir = self.root / "logs" / "jobs"
        self.worker_logs_dir = self.root / "logs" / "workers"

    def create(self) -> RunStore:
        for d in (self.results_dir, self.layers_dir, self.samples_dir, self.job_logs_dir,
                  self.worker_logs_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def result_path(self, job_id: str) -> Path:
        return self.results_dir / f"{job_id}.parquet"

    def write_result(self, record: dict[str, Any]) -> Path:
        """Validate ``record`` and persist it as the job's result, atomically."""
        frame = records_to_frame([record])
        path = self.result_path(record["job_id"])
        _atomic_write(path, frame.write_parquet)
        return path

    def write_layers(self, job_id: str, rows: list[dict[str, Any]]) -> Path:
        """Persist a job's per-layer rows (``job_id`` and ``position`` added), atomically."""
        frame = rows_to_frame([{**row, "job_id": job_id, "position": i}
                               for i, row in enumerate(rows)], LAYER_SCHEMA, "layer")
        path = self.layers_dir / f"{job_id}.parquet"
        _atomic_write(path, frame.write_parquet)
        return path

    def write_samples(self, samples: list[dict[str, Any]]) -> Path | None:
        """Persist a batch of device samples (one worker's drain) as a new file."""
        if not samples:
            return None
        frame = rows_to_frame(samples, SAMPLE_SCHEMA, "device sample", optional=("job_id",))
        name = _SAFE_NAME.sub("_", samples[0]["worker"])
        path = self.samples_dir / f"{name}-{time.time_ns()}.parquet"
        _atomic_write(path, frame.write_parquet)
        return path

    def read_samples(self) -> pl.DataFrame:
        return _read_dir(self.samples_dir, SAMPLE_SCHEMA).sort("worker", "time")

    def read_results(self) -> pl.DataFrame:
        return _read_dir(self.results_dir, RESULT_SCHEMA).sort("finished_at")

    def read_layers(self) -> pl.DataFrame:
        """Per-layer rows of the jobs whose result is recorded (a crash between the two writes
        leaves layers without a result: they are not shown, and the rerun replaces them)."""
        recorded = self.read_results()["job_id"].to_list()
        layers = _read_dir(self.layers_dir, LAYER_SCHEMA)
        return layers.filter(pl.col("job_id").is_in(recorded)).sort("job_id", "position")

    def finished_job_ids(self) -> set[str]:
        """Jobs whose recorded result is final (done or skipped): a rerun does not run them."""
        results = self.read_results()
        return set(results.filter(pl.col("status").is_in(FINAL_STATUSES))["job_id"])

    def write_plan(self, jobs: list[dict[str, Any]]) -> None:
        _atomic_write(self.root / "jobs.json",
                      lambda f: f.write(json.dumps(jobs, indent=1).encode()))

    def read_plan(self) -> list[dict[str, Any]]:
        path = self.root / "jobs.json"
        if not path.exists():
            return []
        return json.loads(path.read_text())

    def append_job_log(self, job_id: str, text: str) -> None:
        with open(self.job_logs_dir / f"{job_id}.log", "a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def append_worker_log(self, worker: str, text: str) -> None:
        name = _SAFE_NAME.sub("_", worker).strip("_") or "unknown"
        with open(self.worker_logs_dir / f"worker-{name}.log", "a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")


def _read_dir(directory: Path, schema: dict) -> pl.DataFrame:
    files = sorted(directory.glob("*.parquet")) if directory.is_dir() else []
    if not files:
        return empty_frame(schema)
    return pl.concat([pl.read_parquet(f) for f in files], how="vertical")


def read_device_samples(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Utilization and memory of every worker's device over time (one row per sample)."""
    return RunStore(run_dir).read_samples()


def read_layers(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Per-layer error of every recorded job of ``run_dir``: one row per (job, quantized layer)."""
    return RunStore(run_dir).read_layers()


def read_results(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Every recorded job of ``run_dir`` as one Polars frame (the results schema).

    >>> read_results("runs/demo").select("config_label", "perplexity")  # doctest: +SKIP
    """
    return RunStore(run_dir).read_results()


def job_status(run_dir: str | os.PathLike) -> pl.DataFrame:
    """One row per planned job of ``run_dir`` with its status (``pending`` when not recorded)."""
    store = RunStore(run_dir)
    plan = store.read_plan()
    results = store.read_results().select("job_id", "status", "attempts", "worker", "wall_s",
                                          "perplexity", "error_message")
    if not plan:
        return results.with_columns(pl.lit(None, pl.String).alias("config_label"))
    planned = pl.DataFrame(plan).select("job_id", "model", "backend", "config_label", "priority")
    return (planned.join(results, on="job_id", how="left")
            .with_columns(pl.col("status").fill_null("pending")))
