"""The run directory's frames, each declared once: the results frame (one row per job) and the
secondary frames beside it (``store.validation`` checks records and rows against them: a record
that does not fit is an error, never a null).

Each frame is one :class:`Frame` in ``FRAMES``: its name (its folder in the run directory and
``qd.read_frame``'s word for it), its schema, how it is sorted when read, which columns may be
null, whether it holds one file per done job (written with the job's result by the recorder) and
whether it goes to MLflow. The run store, the recorder, the readers, the MLflow export and the
docs test iterate over ``FRAMES``: adding a frame is one entry here and the phase that fills it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

import polars as pl

from quantdask.records import (
    Artifact,
    Covered,
    Ended,
    GateVerdict,
    LayerWeights,
    Loaded,
    NotDone,
    PhaseRecord,
    Quantized,
    Recorded,
    Scored,
    SearchedFor,
    Span,
    Speed,
    Streamed,
    TaskScores,
    Where,
)
from quantdask.store.speed import DERIVED, with_baseline_speed
from quantdask.words import FailureClass, Status

STATUSES = tuple(Status)

_UTC = pl.Datetime("us", "UTC")

RESULT_RECORDS: tuple[type[PhaseRecord], ...] = (
    Recorded, Ended, Where, Span, Loaded, Quantized, Streamed, Covered, LayerWeights, Scored,
    TaskScores, Speed, Artifact, GateVerdict, SearchedFor, NotDone)
"""The records whose columns make the results frame, one row per job (``records``: each
column's meaning is a comment on its field there)."""

_POLARS = {int: pl.Int64(), float: pl.Float64(), str: pl.String(), bool: pl.Boolean(),
           dt.datetime: _UTC}


def schema_of(record_types: tuple[type[PhaseRecord], ...]) -> dict[str, pl.DataType]:
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


LAYER_SCHEMA: dict[str, pl.DataType] = {
    "job_id": pl.String(),
    "position": pl.Int64(),  # the layer's order in the network
    "layer": pl.String(),  # module name, e.g. model.layers.0.self_attn.q_proj
    "in_features": pl.Int64(),
    "out_features": pl.Int64(),
    "weight_rel_error": pl.Float64(),  # ||W_q - W|| / ||W||
    "weight_sqnr_db": pl.Float64(),  # 10 log10(||W||^2 / ||W_q - W||^2)
    # Same input, quantized vs original weight, probe batch (null: the output could not be
    # compared, e.g. a layer whose forward returns more than a tensor).
    "output_rel_error": pl.Float64(),
}

WINDOW_SCHEMA: dict[str, pl.DataType] = {
    "job_id": pl.String(),
    "window": pl.Int64(),  # the eval window's index (the same windows for every job of a model)
    "tokens": pl.Int64(),  # tokens predicted in it
    "ln_ppl": pl.Float64(),  # mean negative log-likelihood of the next token (nats)
    "kl": pl.Float64(),  # mean KL(baseline || quantized) over its positions
    "top1_agreement": pl.Float64(),
    "delta_p": pl.Float64(),  # mean change in the correct token's probability
}
"""One row per (done job, eval window): what paired comparisons of two configs need."""

TASK_SCHEMA: dict[str, pl.DataType] = {
    "job_id": pl.String(),
    "task": pl.String(),  # the lm-eval task (or group) name
    "is_group": pl.Boolean(),  # a group's row aggregates its tasks' (which have rows too)
    "metric": pl.String(),  # e.g. acc, acc_norm, exact_match
    "filter": pl.String(),  # lm-eval's filter of the answers (words.NO_FILTER for most tasks)
    "value": pl.Float64(),
    "stderr": pl.Float64(),  # lm-eval's standard error (null when it has none)
    "samples": pl.Int64(),  # samples scored (a group: its tasks' sum)
    # Samples with any prompt cut from the left to fit the model's window: non-zero means the
    # figure is not the task's (report and logs say so).
    "truncated_samples": pl.Int64(),
    "num_fewshot": pl.Int64(),
    "higher_is_better": pl.Boolean(),
    "baseline_value": pl.Float64(),  # the unquantized model's value, same task and metric
    "baseline_stderr": pl.Float64(),
    # value / baseline_value (baseline / value where lower is better): 1 is no loss
    "recovery": pl.Float64(),
    # Why recovery is null (the baseline's task scoring failed: its error; a figure missing on
    # either side; a divisor of 0); null when recovery is set.
    "recovery_reason": pl.String(),
}
"""One row per (done job, task, metric, filter) of a sweep with a tasks block."""
TASK_OPTIONAL = ("value", "stderr", "samples", "num_fewshot", "higher_is_better",
                 "baseline_value", "baseline_stderr", "recovery", "recovery_reason")

SPEED_SCHEMA: dict[str, pl.DataType] = {
    "job_id": pl.String(),
    "batch_size": pl.Int64(),
    "prompt_tokens": pl.Int64(),  # per prompt
    "new_tokens": pl.Int64(),  # generated per prompt, exactly (greedy, no early stop)
    "repeats": pl.Int64(),  # timed runs (warm-up runs not counted)
    "device": pl.String(),  # cuda:<physical id> or cpu
    "exclusive": pl.Boolean(),  # the job held its whole device; no other job measured beside
    # A CPU slot's device is the machine's cores: whether another slot's job computed on them
    # before or after the timed runs (null on a GPU)
    "other_slots_busy": pl.Boolean(),
    "ttft_s": pl.Float64(),  # time to first token (prefill), median over the runs
    "decode_s_p50": pl.Float64(),  # one decode step (a token per prompt), median
    "decode_s_p90": pl.Float64(),
    "prefill_tokens_per_s": pl.Float64(),  # batch x prompt tokens / ttft_s
    "decode_tokens_per_s": pl.Float64(),  # batch / median decode step
    "peak_device_mem_bytes": pl.Int64(),  # during the timed runs
    # Added when read (qd.read_speed), from the baseline's row of the same model and batch:
    "baseline_decode_tokens_per_s": pl.Float64(),
    "decode_speedup": pl.Float64(),  # decode tokens/s over the baseline's
    "prefill_speedup": pl.Float64(),
}
"""One row per (done job, batch size) of a sweep with a speed block."""
SPEED_DERIVED = DERIVED
SPEED_OPTIONAL = ("other_slots_busy", "decode_s_p50", "decode_s_p90", "decode_tokens_per_s",
                  "baseline_decode_tokens_per_s", "decode_speedup", "prefill_speedup")

FAILURE_CLASSES = tuple(FailureClass)
"""How a failed or skipped job is classified, and so what the scheduler does about it."""

ATTEMPT_SCHEMA: dict[str, pl.DataType] = {
    "run_id": pl.String(),  # the driver session that made the attempt
    "job_id": pl.String(),
    "attempt": pl.Int64(),
    "key": pl.String(),  # its Dask key
    "worker": pl.String(),
    "device": pl.String(),
    "started_at": _UTC,
    "finished_at": _UTC,
    "status": pl.String(),  # words.AttemptEnd: a job's status, or cancelled (SweepHandle.cancel())
    "failure_class": pl.String(),
    "error_class": pl.String(),
    "error_message": pl.String(),
    # What the try ran with (an out-of-memory retry gets a whole device and half the batch).
    "eval_batch_size": pl.Int64(),
    "gpu_share": pl.Float64(),
    "device_memory_request_bytes": pl.Int64(),  # null: placement by memory was off
}

SESSION_SCHEMA: dict[str, pl.DataType] = {
    "run_id": pl.String(),  # one driver session: one call of run_sweep on this run directory
    "sweep": pl.String(),
    "started_at": _UTC,
    "finished_at": _UTC,  # null while it runs (or if the driver died)
    "completed": pl.Boolean(),  # false when the session ended with an error or an interrupt
    "workers": pl.Int64(),  # workers when it started
    "slots": pl.Int64(),  # jobs those workers could run at once
    "jobs_planned": pl.Int64(),
    "jobs_run": pl.Int64(),  # jobs not yet finished at the start, so submitted this session
}

SENSITIVITY_SCHEMA: dict[str, pl.DataType] = {
    "search": pl.String(),
    "search_key": pl.String(),  # what the cell's figures depend on (model, formats, windows)
    "model": pl.String(),
    "unit": pl.String(),  # a linear (model.layers.3.mlp.up_proj) or a block (model.layers.3)
    "layer": pl.Int64(),  # its decoder layer
    "format": pl.String(),  # a label of the search's formats
    "params": pl.Int64(),  # the unit's weights
    "kl": pl.Float64(),  # the KL it adds alone on the calibration windows (nats per token)
    "kl_se": pl.Float64(),  # its standard error over the windows
    "bytes": pl.Int64(),  # the unit's stored bytes in this format
    "error": pl.String(),  # why the format cannot take the unit (then kl and bytes are null)
    "worker": pl.String(),
    "seconds": pl.Float64(),
}
"""One row per (search, unit, format) cell, from the probes (null kl: infeasible)."""

ALLOCATION_SCHEMA: dict[str, pl.DataType] = {
    "search": pl.String(),
    "model": pl.String(),
    "job_id": pl.String(),  # the job that verifies it
    "role": pl.String(),  # mixed, equal-bytes or uniform
    "candidate": pl.Int64(),  # its rank among its budget's (1: the best)
    "budget_bits_per_weight": pl.Float64(),
    "budget_bytes": pl.Int64(),
    "unit": pl.String(),
    "format": pl.String(),
    "predicted_kl": pl.Float64(),  # the allocation's: the sum of its cells'
    "predicted_bytes": pl.Int64(),  # the allocation's whole model as stored
    "solver": pl.String(),  # milp or fallback
}
"""One row per (allocation, unit): the format each verified allocation gives each unit."""

SAMPLE_SCHEMA: dict[str, pl.DataType] = {
    "worker": pl.String(),
    "device": pl.String(),  # cuda:<physical id> or cpu
    "time": _UTC,
    "job_id": pl.String(),  # the job (or reference-...) running when sampled; null when idle
    "utilization_pct": pl.Float64(),  # GPU utilization (NVML) or the worker process's CPU %
    "memory_used_bytes": pl.Int64(),  # device memory in use (NVML) or the process's RSS
    "memory_total_bytes": pl.Int64(),
}

PHASE_SCHEMA: dict[str, pl.DataType] = {
    "job_id": pl.String(),
    "position": pl.Int64(),  # the phase's order in the job
    "phase": pl.String(),  # load, quantize, coverage, layer_weights, score, tasks, speed, ...
    "seconds": pl.Float64(),  # the phase's wall time, all of it (eval_s and the like are parts)
    # The phase's own peaks (a CPU slot's device is host memory: both are the process's RSS);
    # the job's peaks are the largest of its phases'.
    "peak_device_mem_bytes": pl.Int64(),
    "peak_host_rss_bytes": pl.Int64(),
    "peak_shared": pl.Boolean(),  # other jobs packed on the worker ran meanwhile (upper bound)
}
"""One row per (done job, phase): where a job spends its time and which phase sets its peak."""


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
          ("output_rel_error",), per_done_job=True),
    Frame("windows", WINDOW_SCHEMA, "Per-window frame", ("job_id", "window"), per_done_job=True),
    Frame("tasks", TASK_SCHEMA, "Tasks frame", ("job_id", "task", "metric", "filter"),
          TASK_OPTIONAL, per_done_job=True, present_with="tasks_s"),
    Frame("speed", SPEED_SCHEMA, "Speed frame", ("job_id", "batch_size"), SPEED_OPTIONAL,
          per_done_job=True, present_with="speed_s", derived=SPEED_DERIVED,
          complete=with_baseline_speed),
    Frame("phases", PHASE_SCHEMA, "Phases frame", ("job_id", "position"),
          ("peak_device_mem_bytes", "peak_host_rss_bytes"), per_done_job=True,
          required=False),
    Frame("attempts", ATTEMPT_SCHEMA, "Attempts frame", ("finished_at",),
          ("worker", "device", "started_at", "failure_class", "error_class", "error_message",
           "device_memory_request_bytes")),
    Frame("sessions", SESSION_SCHEMA, "Sessions frame", ("started_at",), ("finished_at",)),
    Frame("samples", SAMPLE_SCHEMA, "Device samples frame", ("worker", "time"), ("job_id",),
          exported=False),
    Frame("sensitivity", SENSITIVITY_SCHEMA, "Sensitivity frame",
          ("search", "layer", "unit", "format"), ("kl", "kl_se", "bytes", "error", "worker")),
    Frame("allocation", ALLOCATION_SCHEMA, "Allocation frame",
          ("search", "budget_bits_per_weight", "role", "candidate", "unit")),
)
"""Every frame of a run directory."""
FRAME = {frame.name: frame for frame in FRAMES}
PER_DONE_JOB = tuple(frame for frame in FRAMES if frame.per_done_job)
