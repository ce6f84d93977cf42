"""The run directory: one Parquet file per finished job, written atomically, read back as Polars.

Layout::

    RUN_DIR/jobs.json               the planned jobs of the last sweep run here
    RUN_DIR/results/<job_id>.parquet  one row per finished job (the results schema)
    RUN_DIR/layers/<job_id>.parquet   per-layer error of a done job, written before its result
    RUN_DIR/windows/<job_id>.parquet  per-window quality of a done job, written before its result
    RUN_DIR/tasks/<job_id>.parquet    task scores of a done job (a sweep with tasks), likewise
    RUN_DIR/speed/<job_id>.parquet    generation speed of a done job (a sweep with speed)
    RUN_DIR/samples/<worker>-<ns>.parquet  device samples (utilization, memory over time)
    RUN_DIR/attempts/<job_id>-<run>-<n>.parquet  one row per try of a job
    RUN_DIR/sessions/<run_id>.parquet  one row per driver session (when, how many workers)
    RUN_DIR/excluded_workers.json   workers taken out of rotation, and why
    RUN_DIR/.lock                   held (flock) by the driver running a sweep here
    RUN_DIR/logs/jobs/<job_id>.log    a job's log, every attempt
    RUN_DIR/logs/workers/worker-<name>.log  a worker's log, every job it ran
    RUN_DIR/report.html             the run's HTML report (and report.ipynb, executed)
    RUN_DIR/scaling/                the demo's scaling runs, one run directory per worker count

A sweep's run directory is ``runs/<sweep name>`` unless the caller says otherwise
(:func:`default_run_dir`); every path inside one comes from :class:`RunStore`.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import polars as pl

from quantdask.errors import RunDirError, SchemaError
from quantdask.store.schema import (
    ATTEMPT_SCHEMA,
    LAYER_SCHEMA,
    RESULT_SCHEMA,
    SAMPLE_SCHEMA,
    SESSION_SCHEMA,
    SPEED_OPTIONAL,
    SPEED_SCHEMA,
    TASK_OPTIONAL,
    TASK_SCHEMA,
    WINDOW_SCHEMA,
    empty_frame,
    records_to_frame,
    rows_to_frame,
    validate_record,
)
from quantdask.util import atomic_write
from quantdask.worker.outcome import Status

FINAL_STATUSES = (Status.DONE,)
"""Statuses a rerun keeps. Failed jobs are tried again by the next run of their sweep, and so
are skipped ones: what is unsupported depends on the machine (a library installed since, a GPU)."""

_SAFE_NAME = re.compile(r"[^\w.-]+")
log = logging.getLogger("quantdask.store")


def write_parquet(path: Path, frame: pl.DataFrame) -> None:
    """``frame`` as a Parquet file, atomically. No column statistics: these files hold a row or
    a few, and computing statistics was most of the cost of writing one (2.5x)."""
    atomic_write(path, lambda f: frame.write_parquet(f, statistics=False))


RUNS_DIR = "runs"
"""Where run directories go by default, relative to the working directory."""


def default_run_dir(sweep_name: str, suffix: str = "") -> str:
    """``runs/<sweep name><suffix>``: a sweep's run directory (suffix ``-scaling``: its scaling
    runs) when none is given."""
    return os.path.join(RUNS_DIR, f"{sweep_name}{suffix}")


class RunStore:
    """Durable results of the sweeps run in ``run_dir``."""

    def __init__(self, run_dir: str | os.PathLike):
        self.root = Path(run_dir)
        if self.root.exists() and not self.root.is_dir():
            raise RunDirError(f"run directory {self.root} exists and is not a directory")
        self.results_dir = self.root / "results"
        self.layers_dir = self.root / "layers"
        self.windows_dir = self.root / "windows"
        self.tasks_dir = self.root / "tasks"
        self.speed_dir = self.root / "speed"
        self.samples_dir = self.root / "samples"
        self.attempts_dir = self.root / "attempts"
        self.sessions_dir = self.root / "sessions"
        self.logs_dir = self.root / "logs"
        self.job_logs_dir = self.logs_dir / "jobs"
        self.worker_logs_dir = self.logs_dir / "workers"
        self.report_path = self.root / "report.html"
        self.scaling_dir = self.root / "scaling"

    def is_run_dir(self) -> bool:
        """Whether a sweep has recorded results here."""
        return self.results_dir.is_dir()

    def job_log_path(self, job_id: str) -> Path:
        """A job's log, every attempt."""
        return self.job_logs_dir / f"{job_id}.log"

    def create(self) -> RunStore:
        for d in (self.results_dir, self.layers_dir, self.windows_dir, self.tasks_dir,
                  self.speed_dir, self.samples_dir, self.attempts_dir, self.sessions_dir,
                  self.job_logs_dir, self.worker_logs_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self

    def result_path(self, job_id: str) -> Path:
        return self.results_dir / f"{job_id}.parquet"

    def write_result(self, record: dict[str, Any]) -> Path:
        """Validate ``record`` and persist it as the job's result, atomically."""
        frame = records_to_frame([record])
        path = self.result_path(record["job_id"])
        write_parquet(path, frame)
        return path

    def write_layers(self, job_id: str, rows: list[dict[str, Any]]) -> Path:
        """Persist a job's per-layer rows (``job_id`` and ``position`` added), atomically."""
        frame = rows_to_frame([{**row, "job_id": job_id, "position": i}
                               for i, row in enumerate(rows)], LAYER_SCHEMA, "layer",
                              optional=("output_rel_error",))
        path = self.layers_dir / f"{job_id}.parquet"
        write_parquet(path, frame)
        return path

    def write_windows(self, job_id: str, rows: list[dict[str, Any]]) -> Path:
        """Persist a job's per-window rows (``job_id`` added), atomically."""
        return self._write_rows(self.windows_dir, job_id, rows, WINDOW_SCHEMA, "window")

    def write_tasks(self, job_id: str, rows: list[dict[str, Any]]) -> Path:
        """Persist a job's task rows (``job_id`` added), atomically."""
        return self._write_rows(self.tasks_dir, job_id, rows, TASK_SCHEMA, "task",
                                TASK_OPTIONAL)

    def write_speed(self, job_id: str, rows: list[dict[str, Any]]) -> Path:
        """Persist a job's speed rows (``job_id`` added), atomically."""
        return self._write_rows(self.speed_dir, job_id, rows, SPEED_SCHEMA, "speed",
                                SPEED_OPTIONAL)

    @staticmethod
    def _write_rows(directory: Path, job_id: str, rows: list[dict[str, Any]], schema: dict,
                    what: str, optional: tuple[str, ...] = ()) -> Path:
        frame = rows_to_frame([{**row, "job_id": job_id} for row in rows], schema, what,
                              optional)
        path = directory / f"{job_id}.parquet"
        write_parquet(path, frame)
        return path

    def write_samples(self, samples: list[dict[str, Any]]) -> Path | None:
        """Persist a batch of device samples (one worker's drain) as a new file."""
        if not samples:
            return None
        frame = rows_to_frame(samples, SAMPLE_SCHEMA, "device sample", optional=("job_id",))
        name = _SAFE_NAME.sub("_", samples[0]["worker"])
        path = self.samples_dir / f"{name}-{time.time_ns()}.parquet"
        write_parquet(path, frame)
        return path

    def write_attempt(self, row: dict[str, Any]) -> Path:
        """Persist one try of a job (the attempts schema), atomically."""
        frame = rows_to_frame([row], ATTEMPT_SCHEMA, "attempt",
                              optional=("worker", "device", "started_at", "failure_class",
                                        "error_class", "error_message",
                                        "device_memory_request_bytes"))
        name = f"{row['job_id']}-{row['run_id']}-{row['attempt']}.parquet"
        path = self.attempts_dir / name
        write_parquet(path, frame)
        return path

    def write_session(self, row: dict[str, Any]) -> Path:
        """Persist (or update) one driver session's row (the sessions schema), atomically."""
        frame = rows_to_frame([row], SESSION_SCHEMA, "session", optional=("finished_at",))
        path = self.sessions_dir / f"{row['run_id']}.parquet"
        write_parquet(path, frame)
        return path

    def read_sessions(self) -> pl.DataFrame:
        return _read_dir(self.sessions_dir, SESSION_SCHEMA).sort("started_at")

    def record_excluded_worker(self, worker: str, reason: str) -> None:
        """Note that ``worker`` was taken out of rotation, and why (``excluded_workers.json``)."""
        excluded = self.read_excluded_workers()
        excluded.append({"worker": worker, "reason": reason,
                         "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        atomic_write(self.root / "excluded_workers.json",
                      lambda f: f.write(json.dumps(excluded, indent=1).encode()))

    def read_excluded_workers(self) -> list[dict[str, str]]:
        path = self.root / "excluded_workers.json"
        return json.loads(path.read_text()) if path.exists() else []

    def read_attempts(self) -> pl.DataFrame:
        return _read_dir(self.attempts_dir, ATTEMPT_SCHEMA).sort("finished_at")

    @contextlib.contextmanager
    def lock(self):
        """Hold the run directory for one driver: a second one is refused, a dead one's lock
        goes with its process (flock), so a rerun after ``kill -9`` proceeds."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                raise RunDirError(f"run directory {self.root} is in use by another quantdask "
                                  f"run (pid {holder}); wait for it to finish or choose "
                                  "another --run-dir") from None
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            try:
                yield self
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def is_locked(self) -> bool:
        """Whether a driver holds the run directory now (without taking it)."""
        path = self.root / ".lock"
        if not path.exists():
            return False
        with open(path) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    def check_unlocked(self) -> None:
        """Raise :class:`RunDirError` now if another driver holds the run directory (so a CLI
        refuses before starting a cluster); :meth:`lock` still decides."""
        if (self.root / ".lock").exists():
            with self.lock():
                pass

    def set_aside_unreadable(self) -> list[Path]:
        """Move result files that cannot be read (or do not fit the schema) aside, and delete
        temporary files a crash left, so that those jobs run again. Call under :meth:`lock`."""
        moved = []
        for directory in (self.results_dir, self.layers_dir, self.windows_dir, self.tasks_dir,
                          self.speed_dir, self.attempts_dir, self.samples_dir,
                          self.sessions_dir):
            if not directory.is_dir():
                continue
            for tmp in directory.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
            for path in _unreadable(directory, _SCHEMAS[directory.name]):
                target = path.with_name(f"{path.name}.unreadable-{time.time_ns()}")
                path.rename(target)
                log.warning("set aside unreadable %s as %s; its job will run again",
                            path, target.name)
                moved.append(target)
        return moved

    def read_samples(self) -> pl.DataFrame:
        return _read_dir(self.samples_dir, SAMPLE_SCHEMA).sort("worker", "time")

    def read_results(self) -> pl.DataFrame:
        return _read_dir(self.results_dir, RESULT_SCHEMA).sort("finished_at")

    def read_layers(self) -> pl.DataFrame:
        """Per-layer rows of the jobs recorded done (a crash between the two writes leaves
        layers without a result: they are not shown, and the rerun replaces them)."""
        return self._done_rows(self.layers_dir, LAYER_SCHEMA).sort("job_id", "position")

    def read_windows(self) -> pl.DataFrame:
        """Per-window rows of the jobs recorded done (as for ``read_layers``)."""
        return self._done_rows(self.windows_dir, WINDOW_SCHEMA).sort("job_id", "window")

    def read_tasks(self) -> pl.DataFrame:
        """Task rows of the jobs recorded done (as for ``read_layers``)."""
        return self._done_rows(self.tasks_dir, TASK_SCHEMA).sort("job_id", "task", "metric",
                                                                 "filter")

    def read_speed_rows(self) -> pl.DataFrame:
        """Speed rows of the jobs recorded done, as measured (``store.speed.read_speed`` adds
        the baseline's figures)."""
        return self._done_rows(self.speed_dir, SPEED_SCHEMA).sort("job_id", "batch_size")

    def _done_rows(self, directory: Path, schema: dict) -> pl.DataFrame:
        recorded = self.read_results().filter(pl.col("status") == Status.DONE)["job_id"]
        return _read_dir(directory, schema).filter(pl.col("job_id").is_in(recorded.to_list()))

    def finished_job_ids(self) -> set[str]:
        """Jobs whose recorded result is final: done, with every metric this version requires
        (a result from an older version that lacks one is measured again)."""
        finished = set()
        for row in self.read_results().filter(pl.col("status").is_in(FINAL_STATUSES)).to_dicts():
            try:
                validate_record({k: v for k, v in row.items() if v is not None})
            except SchemaError:
                continue
            # Its per-layer and per-window rows are part of a done job: one set aside (or one
            # from a version that wrote none) means run it again.
            name = f"{row['job_id']}.parquet"
            kept = [self.layers_dir, self.windows_dir]
            kept += [self.tasks_dir] if row["tasks_s"] is not None else []
            kept += [self.speed_dir] if row["speed_s"] is not None else []
            if all((directory / name).exists() for directory in kept):
                finished.add(row["job_id"])
        return finished

    def write_plan(self, jobs: list[dict[str, Any]]) -> None:
        atomic_write(self.root / "jobs.json",
                      lambda f: f.write(json.dumps(jobs, indent=1).encode()))

    def read_plan(self) -> list[dict[str, Any]]:
        path = self.root / "jobs.json"
        if not path.exists():
            return []
        return json.loads(path.read_text())

    def append_attempt_log(self, job_id: str, attempt: int, record: dict[str, Any],
                           log: str) -> None:
        """An attempt's ``log`` lines into its job's and its worker's log; an attempt that ended
        outside the job (no lines) gets one saying why, from its ``record``."""
        text = log or (
            f"{datetime.datetime.now(datetime.UTC).isoformat()} ERROR {job_id} "
            f"attempt={attempt} failed outside the job ({record.get('failure_class')}): "
            f"{record.get('error_class')}: {record.get('error_message')}\n")
        self.append_job_log(job_id, text)
        self.append_worker_log(record.get("worker") or "unknown-worker", text)

    def append_job_log(self, job_id: str, text: str) -> None:
        with open(self.job_log_path(job_id), "a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def append_worker_log(self, worker: str, text: str) -> None:
        name = _SAFE_NAME.sub("_", worker).strip("_") or "unknown"
        with open(self.worker_logs_dir / f"worker-{name}.log", "a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")


_SCHEMAS = {"results": RESULT_SCHEMA, "layers": LAYER_SCHEMA, "windows": WINDOW_SCHEMA,
            "tasks": TASK_SCHEMA, "speed": SPEED_SCHEMA, "samples": SAMPLE_SCHEMA,
            "attempts": ATTEMPT_SCHEMA, "sessions": SESSION_SCHEMA}


def _read_file(path: Path, schema: dict) -> pl.DataFrame | None:
    """The file's rows in ``schema`` (columns a file from an older version lacks are null), or
    None when the file cannot be decoded or its columns cannot take the schema's types."""
    try:
        frame = pl.read_parquet(path)
        missing = [pl.lit(None, dtype).alias(c) for c, dtype in schema.items()
                   if c not in frame.columns]
        return frame.with_columns(missing).select(
            [pl.col(c).cast(dtype) for c, dtype in schema.items()])
    except (pl.exceptions.PolarsError, ValueError):  # damaged or not Parquet; an OSError
        return None  # (a flaky network disk) is raised, not taken for damage


def _unreadable(directory: Path, schema: dict) -> list[Path]:
    return [p for p in sorted(directory.glob("*.parquet")) if _read_file(p, schema) is None]


def _read_dir(directory: Path, schema: dict) -> pl.DataFrame:
    """Every readable file of ``directory`` as one frame; damaged ones are left out (with a
    warning) until a run sets them aside and reruns their jobs."""
    frames = []
    for path in sorted(directory.glob("*.parquet")) if directory.is_dir() else []:
        frame = _read_file(path, schema)
        if frame is None:
            log.warning("%s is unreadable or has another schema; left out", path)
        else:
            frames.append(frame)
    return pl.concat(frames, how="vertical") if frames else empty_frame(schema)


def read_attempts(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Every try of every job of ``run_dir``: one row per attempt."""
    return RunStore(run_dir).read_attempts()


def read_sessions(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Every driver session of ``run_dir``: when it ran, on how many workers and slots."""
    return RunStore(run_dir).read_sessions()


def read_device_samples(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Utilization and memory of every worker's device over time (one row per sample)."""
    return RunStore(run_dir).read_samples()


def read_windows(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Per-window quality of every done job of ``run_dir``: one row per (job, eval window)."""
    return RunStore(run_dir).read_windows()


def read_tasks(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Task scores of every done job of ``run_dir``: one row per (job, task, metric, filter),
    with the baseline's value and the recovery (empty for a sweep without tasks)."""
    return RunStore(run_dir).read_tasks()


def read_layers(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Per-layer error of every recorded job of ``run_dir``: one row per (job, quantized layer)."""
    return RunStore(run_dir).read_layers()


def read_results(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Every recorded job of ``run_dir`` as one Polars frame (the results schema).

    >>> read_results("runs/demo").select("config_label", "perplexity")  # doctest: +SKIP
    """
    return RunStore(run_dir).read_results()
