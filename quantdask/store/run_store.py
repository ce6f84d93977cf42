"""The run directory: one Parquet file per finished job, written atomically, read back as Polars.

Layout::

    RUN_DIR/jobs.json               the planned jobs of the last sweep run here
    RUN_DIR/results/<job_id>.parquet  one row per finished job (the results schema)
    RUN_DIR/layers/<job_id>.parquet   per-layer error of a done job, written before its result
    RUN_DIR/windows/<job_id>.parquet  per-window quality of a done job, written before its result
    RUN_DIR/tasks/<job_id>.parquet    task scores of a done job (a sweep with tasks), likewise
    RUN_DIR/speed/<job_id>.parquet    generation speed of a done job (a sweep with speed)
    RUN_DIR/phases/<job_id>.parquet   each phase's time and peaks of a done job
    RUN_DIR/samples/<worker>-<ns>.parquet  device samples (utilization, memory over time)
    RUN_DIR/attempts/<job_id>-<run>-<n>.parquet  one row per try of a job
    RUN_DIR/sessions/<run_id>.parquet  one row per driver session (when, how many workers)
    RUN_DIR/excluded_workers.json   workers taken out of rotation, and why
    RUN_DIR/.lock                   held (flock) by the driver running a sweep here
    RUN_DIR/logs/jobs/<job_id>.log    a job's log, every attempt (a running one's lines so far)
    RUN_DIR/logs/workers/worker-<name>.log  a worker's log, every job it ran
    RUN_DIR/report.html             the run's HTML report (and report.ipynb, executed)
    RUN_DIR/scaling/                the demo's scaling runs, one run directory per worker count

A sweep's run directory is ``runs/<sweep name>`` unless the caller says otherwise
(:func:`default_run_dir`); every path inside one comes from :class:`RunStore`. The frames'
folders are those of ``store.schema.FRAMES``, and every frame reads back with
:func:`read_frame`.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from quantdask.errors import RunDirError, SchemaError
from quantdask.records import AttemptRow, FrameRow, SessionRow
from quantdask.store.schema import FRAME, FRAMES, PER_DONE_JOB, Frame
from quantdask.store.validation import (
    empty_frame,
    records_to_frame,
    rows_to_frame,
    validate_record,
)
from quantdask.util import atomic_write
from quantdask.words import Status

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
        self.results_dir = self.frame_dir("results")
        self.logs_dir = self.root / "logs"
        self.job_logs_dir = self.logs_dir / "jobs"
        self.worker_logs_dir = self.logs_dir / "workers"
        self.report_path = self.root / "report.html"
        self.scaling_dir = self.root / "scaling"

    def frame_dir(self, name: str) -> Path:
        """The folder of the frame ``name`` (one of ``store.schema.FRAMES``)."""
        return self.root / FRAME[name].name

    def is_run_dir(self) -> bool:
        """Whether a sweep has recorded results here."""
        return self.results_dir.is_dir()

    def job_log_path(self, job_id: str) -> Path:
        """A job's log, every attempt."""
        return self.job_logs_dir / f"{job_id}.log"

    def create(self) -> RunStore:
        for d in (*(self.frame_dir(f.name) for f in FRAMES), self.job_logs_dir,
                  self.worker_logs_dir):
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

    def write_job_rows(self, name: str, job_id: str, rows: list[dict[str, Any]]) -> Path:
        """Persist a done job's rows of the per-job frame ``name`` (``job_id`` added),
        atomically; the recorder writes them before the job's result."""
        return self.write_rows(name, job_id, [{**row, "job_id": job_id} for row in rows],
                               per_done_job=True)

    def write_rows(self, name: str, key: str, rows: Sequence[FrameRow | dict[str, Any]],
                   per_done_job: bool = False) -> Path:
        """Persist ``rows`` of the frame ``name`` as one file named ``key``, atomically (a
        rerun finds each part whole or not at all): a search's parts, or a done job's rows
        (``write_job_rows``)."""
        frame = FRAME[name]
        if frame.per_done_job != per_done_job:
            raise SchemaError(f"{name} is {'not ' if per_done_job else ''}a frame of one file "
                              "per done job")
        path = self.frame_dir(name) / f"{key}.parquet"
        write_parquet(path, rows_to_frame(_plain(rows), frame.stored, name, frame.optional))
        return path

    def write_samples(self, samples: list[dict[str, Any]]) -> Path | None:
        """Persist a batch of device samples (one worker's drain) as a new file."""
        if not samples:
            return None
        frame = _checked_rows(FRAME["samples"], samples)
        name = _SAFE_NAME.sub("_", samples[0]["worker"])
        path = self.frame_dir("samples") / f"{name}-{time.time_ns()}.parquet"
        write_parquet(path, frame)
        return path

    def write_attempt(self, row: AttemptRow) -> Path:
        """Persist one try of a job (the attempts schema), atomically."""
        frame = _checked_rows(FRAME["attempts"], [row.row()])
        name = f"{row.job_id}-{row.run_id}-{row.attempt}.parquet"
        path = self.frame_dir("attempts") / name
        write_parquet(path, frame)
        return path

    def write_session(self, row: SessionRow) -> Path:
        """Persist (or update) one driver session's row (the sessions schema), atomically."""
        frame = _checked_rows(FRAME["sessions"], [row.row()])
        path = self.frame_dir("sessions") / f"{row.run_id}.parquet"
        write_parquet(path, frame)
        return path

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
        for frame in FRAMES:
            directory = self.frame_dir(frame.name)
            if not directory.is_dir():
                continue
            for tmp in directory.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
            for path in _unreadable(directory, frame.stored):
                target = path.with_name(f"{path.name}.unreadable-{time.time_ns()}")
                path.rename(target)
                log.warning("set aside unreadable %s as %s; its job will run again",
                            path, target.name)
                moved.append(target)
        return moved

    def read(self, name: str) -> pl.DataFrame:
        """The frame ``name`` (one of ``store.schema.FRAMES``) in its schema, sorted. A per-job
        frame holds the rows of the jobs recorded done only (a crash between a job's two writes
        leaves rows without a result: they are not shown, and the rerun replaces them)."""
        frame = FRAME[name]
        rows = _read_dir(self.frame_dir(name), frame.stored)
        if frame.per_done_job or frame.complete is not None:
            results = self.read_results()
            if frame.per_done_job:
                done = results.filter(pl.col("status") == Status.DONE)["job_id"]
                rows = rows.filter(pl.col("job_id").is_in(done.to_list()))
            rows = rows.with_columns([pl.lit(None, frame.schema[c]).alias(c)
                                      for c in frame.derived]).select(list(frame.schema))
            if frame.complete is not None:
                rows = frame.complete(rows, results)
        return rows.sort(*frame.order)

    def read_results(self) -> pl.DataFrame:
        return self.read("results")

    def finished_job_ids(self) -> set[str]:
        """Jobs whose recorded result is final: done, with every metric this version requires
        (a result from an older version that lacks one is measured again)."""
        finished = set()
        for row in self.read_results().filter(pl.col("status").is_in(FINAL_STATUSES)).to_dicts():
            try:
                validate_record({k: v for k, v in row.items() if v is not None})
            except SchemaError:
                continue
            # Its rows of the per-job frames are part of a done job: one set aside (or one from
            # a version that wrote none) means run it again.
            name = f"{row['job_id']}.parquet"
            if all((self.frame_dir(frame.name) / name).exists() for frame in PER_DONE_JOB
                   if frame.required and (frame.present_with is None
                                          or row[frame.present_with] is not None)):
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

    def append_job_log(self, job_id: str, text: str) -> int:
        """Append ``text`` to the job's log; returns the log's length in bytes before it."""
        data = (text if text.endswith("\n") else text + "\n").encode()
        with open(self.job_log_path(job_id), "ab") as f:
            f.write(data)
            return f.tell() - len(data)

    def replace_job_log_tail(self, job_id: str, start: int,
                             new_tail: Callable[[str], str]) -> None:
        """Replace the job's log from byte ``start`` on by ``new_tail(what was there)``, in one
        atomic rewrite: a reader sees the old log or the new one, never parts of both."""
        path = self.job_log_path(job_id)
        old = path.read_bytes() if path.exists() else b""
        tail = new_tail(old[start:].decode(errors="replace")).encode()
        atomic_write(path, lambda f: f.write(old[:start] + tail), durable=False)

    def append_worker_log(self, worker: str, text: str) -> None:
        name = _SAFE_NAME.sub("_", worker).strip("_") or "unknown"
        with open(self.worker_logs_dir / f"worker-{name}.log", "a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")


def attempt_log_text(job_id: str, attempt: int, record: dict[str, Any], log: str) -> str:
    """An attempt's lines for the logs: its ``log``, or for an attempt that ended outside the
    job (no lines) one saying why, from its ``record``."""
    return log or (
        f"{datetime.datetime.now(datetime.UTC).isoformat()} ERROR {job_id} "
        f"attempt={attempt} failed outside the job ({record.get('failure_class')}): "
        f"{record.get('error_class')}: {record.get('error_message')}\n")


def _plain(rows: Sequence[FrameRow | dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows as the frame's files hold them: a typed row's columns (a done job's rows arrive
    with their ``job_id`` added, as dicts)."""
    return [row.row() if isinstance(row, FrameRow) else row for row in rows]


def _checked_rows(frame: Frame, rows: list[dict[str, Any]]) -> pl.DataFrame:
    return rows_to_frame(rows, frame.stored, frame.name, frame.optional)


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


def read_frame(run_dir: str | os.PathLike, name: str) -> pl.DataFrame:
    """The frame ``name`` of ``run_dir`` (``store.schema.FRAMES`` lists them), in its schema.

    >>> read_frame("runs/demo", "phases").group_by("phase").agg(pl.sum("seconds"))  # doctest: +SKIP
    """
    if name not in FRAME:
        raise SchemaError(f"no frame {name!r}: the frames are {', '.join(FRAME)}")
    return RunStore(run_dir).read(name)


def read_frames(run_dir: str | os.PathLike) -> dict[str, pl.DataFrame]:
    """Every frame of ``run_dir`` by name (as :func:`read_frame` reads each)."""
    return {frame.name: read_frame(run_dir, frame.name) for frame in FRAMES}
