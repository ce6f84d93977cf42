"""The run directory's frames, each declared once: the results frame (one row per job) and the
secondary frames beside it (``store.validation`` checks records and rows against them: a record
that does not fit is an error, never a null).

Each frame is one :class:`Frame` in ``FRAMES``: its name (its folder in the run directory and
``qd.read_frame``'s word for it), its schema and the columns that may be null (both derived
from its record types in ``quantdask.records``, where each column's meaning is written), how it
is sorted when read, whether it holds one file per done job (written with the job's result by
the recorder) and whether it goes to MLflow. The run store, the recorder, the readers, the
MLflow export and the docs test iterate over ``FRAMES``: adding a frame is one entry here, its
record type and the phase that fills it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

import polars as pl

from quantdask.records import (
    AllocationRow,
    Artifact,
    AttemptRow,
    Covered,
    Ended,
    EnvironmentRow,
    FrameRow,
    GateVerdict,
    InRuntime,
    LayerRow,
    LayerWeights,
    Loaded,
    NotDone,
    PhaseRecord,
    PhaseRow,
    Quantized,
    Record,
    Recorded,
    RefinementRow,
    SampleRow,
    Scored,
    SearchedFor,
    SensitivityRow,
    SessionRow,
    Span,
    Speed,
    SpeedAsRead,
    Streamed,
    TaskItemRow,
    TaskRow,
    TaskScores,
    Where,
    WindowRow,
    WorkerTaskRow,
)
from quantdask.store.speed import DERIVED, with_baseline_speed
from quantdask.words import FailureClass, Status

STATUSES = tuple(Status)

_UTC = pl.Datetime("us", "UTC")

RESULT_RECORDS: tuple[type[PhaseRecord], ...] = (
    Recorded, Ended, Where, Span, Loaded, Quantized, Streamed, InRuntime, Covered, LayerWeights,
    Scored, TaskScores, Speed, Artifact, GateVerdict, SearchedFor, NotDone)
"""The records whose columns make the results frame, one row per job (``records``: each
column's meaning is a comment on its field there)."""

_POLARS = {int: pl.Int64(), float: pl.Float64(), str: pl.String(), bool: pl.Boolean(),
           dt.datetime: _UTC}


def schema_of(record_types: tuple[type[Record], ...]) -> dict[str, pl.DataType]:
    """The Polars schema of the columns ``record_types`` fill, in their order, each field's
    Python type as Polars holds it; a column two records fill is declared by the first (a
    streamed job's quantize_s, every row's status)."""
    schema: dict[str, pl.DataType] = {}
    for record_type in record_types:
        for column, kind in record_type.column_types().items():
            schema.setdefault(column, _POLARS[kind])
    return schema


RESULT_SCHEMA = schema_of(RESULT_RECORDS)
"""The results frame's schema, derived from its records (``RESULT_RECORDS``)."""


FAILURE_CLASSES = tuple(FailureClass)
"""How a failed or skipped job is classified, and so what the scheduler does about it."""


def _per_job(row_type: type[FrameRow]) -> dict[str, pl.DataType]:
    """The schema of a done job's rows: its ``job_id`` (the store adds it), then the row's."""
    return {"job_id": pl.String(), **schema_of((row_type,))}


LAYER_SCHEMA = _per_job(LayerRow)
WINDOW_SCHEMA = _per_job(WindowRow)
TASK_SCHEMA = _per_job(TaskRow)
TASK_ITEM_SCHEMA = _per_job(TaskItemRow)
SPEED_SCHEMA = _per_job(SpeedAsRead)
SPEED_DERIVED = DERIVED
PHASE_SCHEMA = _per_job(PhaseRow)
ATTEMPT_SCHEMA = schema_of((AttemptRow,))
SESSION_SCHEMA = schema_of((SessionRow,))
ENVIRONMENT_SCHEMA = schema_of((EnvironmentRow,))
SENSITIVITY_SCHEMA = schema_of((SensitivityRow,))
ALLOCATION_SCHEMA = schema_of((AllocationRow,))
REFINEMENT_SCHEMA = schema_of((RefinementRow,))
SAMPLE_SCHEMA = schema_of((SampleRow,))
WORKER_TASK_SCHEMA = schema_of((WorkerTaskRow,))


@dataclass(frozen=True)
class Frame:
    """One frame of the run directory, declared once (see the module)."""

    name: str  # its folder in the run directory, and its name for qd.read_frame
    schema: dict[str, pl.DataType]
    heading: str  # where docs/results.md documents its columns
    order: tuple[str, ...]  # how it is sorted when read
    optional: tuple[str, ...] = ()  # columns a row may leave null (secondary frames)
    # One file per done job, written by the recorder before the job's result (from the
    # outcome's rows of this frame); read back for the jobs recorded done only.
    per_done_job: bool = False
    # A done job has this frame's file only when this results column is set (its phase ran);
    # None: every done job has one. A done job missing its file is run again, unless the frame
    # is telemetry (not ``required``: results from before it existed stand).
    present_with: str | None = None
    required: bool = True
    # Columns computed when read, from the frame and the results frame (not stored).
    derived: tuple[str, ...] = ()
    complete: Callable[[pl.DataFrame, pl.DataFrame], pl.DataFrame] | None = None
    exported: bool = True  # into the MLflow export's parent run

    @property
    def stored(self) -> dict[str, pl.DataType]:
        """The columns its files hold."""
        return {c: t for c, t in self.schema.items() if c not in self.derived}


FRAMES: tuple[Frame, ...] = (
    Frame("results", RESULT_SCHEMA, "Results frame", ("finished_at",)),
    Frame("layers", LAYER_SCHEMA, "Per-layer frame", ("job_id", "position"),
          LayerRow.optional_columns(), per_done_job=True),
    Frame("windows", WINDOW_SCHEMA, "Per-window frame", ("job_id", "window"),
          WindowRow.optional_columns(), per_done_job=True),
    Frame("tasks", TASK_SCHEMA, "Tasks frame", ("job_id", "task", "metric", "filter"),
          TaskRow.optional_columns(), per_done_job=True, present_with="tasks_s"),
    Frame("task_items", TASK_ITEM_SCHEMA, "Task items frame",
          ("job_id", "task", "metric", "filter", "doc_id"), per_done_job=True,
          present_with="tasks_s", required=False, exported=False),
    Frame("speed", SPEED_SCHEMA, "Speed frame", ("job_id", "batch_size"),
          SpeedAsRead.optional_columns(), per_done_job=True, present_with="speed_s",
          derived=SPEED_DERIVED, complete=with_baseline_speed),
    Frame("phases", PHASE_SCHEMA, "Phases frame", ("job_id", "position"),
          PhaseRow.optional_columns(), per_done_job=True, required=False),
    Frame("attempts", ATTEMPT_SCHEMA, "Attempts frame", ("finished_at",),
          AttemptRow.optional_columns()),
    Frame("worker_tasks", WORKER_TASK_SCHEMA, "Worker tasks frame", ("started_at", "key"),
          WorkerTaskRow.optional_columns()),
    Frame("sessions", SESSION_SCHEMA, "Sessions frame", ("started_at",),
          SessionRow.optional_columns()),
    Frame("environment", ENVIRONMENT_SCHEMA, "Environment frame",
          ("captured_at", "process", "component")),
    Frame("samples", SAMPLE_SCHEMA, "Device samples frame", ("worker", "time"),
          SampleRow.optional_columns(), exported=False),
    Frame("sensitivity", SENSITIVITY_SCHEMA, "Sensitivity frame",
          ("search", "layer", "unit", "format"), SensitivityRow.optional_columns()),
    Frame("allocation", ALLOCATION_SCHEMA, "Allocation frame",
          ("search", "budget_bits_per_weight", "role", "candidate", "unit")),
    Frame("refinement", REFINEMENT_SCHEMA, "Refinement frame",
          ("search", "generation", "candidate"), RefinementRow.optional_columns()),
)
"""Every frame of a run directory."""
FRAME = {frame.name: frame for frame in FRAMES}
PER_DONE_JOB = tuple(frame for frame in FRAMES if frame.per_done_job)
