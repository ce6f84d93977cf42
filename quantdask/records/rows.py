"""The rows of the secondary frames, typed: one record type per frame, each field a column
(its comment says what it means; ``X | None``: a row may leave it null). ``store.schema``
derives each frame's schema from its row type, and the producers build these records. A done
job's rows (layers, windows, tasks, speed, phases) are made on the worker without the job's
id: the store adds the ``job_id`` column as it writes them."""

from __future__ import annotations

import dataclasses
import datetime as dt

from quantdask.records.base import FrameRow


@dataclasses.dataclass(frozen=True)
class LayerRow(FrameRow):
    """One row per (done job, measured layer): its weight and output error."""

    position: int  # the layer's order in the network
    layer: str  # module name, e.g. model.layers.0.self_attn.q_proj
    in_features: int
    out_features: int
    weight_rel_error: float  # ||W_q - W|| / ||W||
    weight_sqnr_db: float  # 10 log10(||W||^2 / ||W_q - W||^2)
    # Same input, quantized vs original weight, probe batch (null: the output could not be
    # compared, e.g. a layer whose forward returns more than a tensor).
    output_rel_error: float | None


@dataclasses.dataclass(frozen=True)
class WindowRow(FrameRow):
    """One row per (done job, eval window): what paired comparisons of two configs need."""

    window: int  # the eval window's index (the same windows for every job of a model)
    tokens: int  # tokens predicted in it
    ln_ppl: float  # mean negative log-likelihood of the next token (nats)
    kl: float  # mean KL(baseline || quantized) over its positions
    top1_agreement: float
    delta_p: float  # mean change in the correct token's probability
    # sha256 of the window's token ids (int64, little-endian), its first 16 hex digits: two
    # runs measured the same windows when their hashes match (null: recorded before hashes)
    token_hash: str | None = None


@dataclasses.dataclass(frozen=True)
class TaskRow(FrameRow):
    """One row per (done job, task, metric, filter) of a sweep with a tasks block."""

    task: str  # the lm-eval task (or group) name
    is_group: bool  # a group's row aggregates its tasks' (which have rows too)
    metric: str  # e.g. acc, acc_norm, exact_match
    filter: str  # lm-eval's filter of the answers (words.NO_FILTER for most tasks)
    value: float | None
    stderr: float | None  # lm-eval's standard error (null when it has none)
    samples: int | None  # samples scored (a group: its tasks' sum)
    # Samples with any prompt cut from the left to fit the model's window: non-zero means the
    # figure is not the task's (report and logs say so).
    truncated_samples: int
    num_fewshot: int | None
    higher_is_better: bool | None
    # Joined from the baseline's rows (``measure.tasks.with_baseline``):
    baseline_value: float | None = None  # the unquantized model's value, same task and metric
    baseline_stderr: float | None = None
    # value / baseline_value (baseline / value where lower is better): 1 is no loss
    recovery: float | None = None
    # Why recovery is null (the baseline's task scoring failed: its error; a figure missing on
    # either side; a divisor of 0); null when recovery is set.
    recovery_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class TaskItemRow(FrameRow):
    """One row per (done job, task, question, metric, filter): each question's score, so two
    runs' task accuracies compare question by question (``quantdask compare``)."""

    task: str  # the lm-eval task (never a group)
    doc_id: int  # the question's index in the task's evaluated documents
    metric: str  # e.g. acc, acc_norm, exact_match
    filter: str  # lm-eval's filter of the answers
    value: float  # the question's score: 1/0 for correctness, else the metric's value


@dataclasses.dataclass(frozen=True)
class SpeedRow(FrameRow):
    """One row per (done job, batch size) of a sweep with a speed block, as measured."""

    batch_size: int
    prompt_tokens: int  # per prompt
    new_tokens: int  # generated per prompt, exactly (greedy, no early stop)
    repeats: int  # timed runs (warm-up runs not counted)
    device: str  # cuda:<physical id> or cpu
    exclusive: bool  # the job held its whole device; no other job measured beside
    # A CPU slot's device is the machine's cores: whether another slot's job computed on them
    # before or after the timed runs (null on a GPU)
    other_slots_busy: bool | None
    ttft_s: float  # time to first token (prefill), median over the runs
    decode_s_p50: float | None  # one decode step (a token per prompt), median
    decode_s_p90: float | None
    prefill_tokens_per_s: float  # batch x prompt tokens / ttft_s
    decode_tokens_per_s: float | None  # batch / median decode step
    peak_device_mem_bytes: int  # during the timed runs


@dataclasses.dataclass(frozen=True)
class SpeedAsRead(SpeedRow):
    """A speed row as read (``qd.read_speed``): with the baseline's row of the same model and
    batch beside it (``store.speed``)."""

    baseline_decode_tokens_per_s: float | None = None
    decode_speedup: float | None = None  # decode tokens/s over the baseline's
    prefill_speedup: float | None = None


@dataclasses.dataclass(frozen=True)
class PhaseRow(FrameRow):
    """One row per (done job, phase): where a job spends its time and which phase sets its
    peak."""

    position: int  # the phase's order in the job
    phase: str  # load, quantize, coverage, layer_weights, score, tasks, speed, ...
    seconds: float  # the phase's wall time, all of it (eval_s and the like are parts)
    # The phase's own peaks (a CPU slot's device is host memory: both are the process's RSS);
    # the job's peaks are the largest of its phases'.
    peak_device_mem_bytes: int | None
    peak_host_rss_bytes: int | None
    peak_shared: bool  # other jobs packed on the worker ran meanwhile (upper bound)


@dataclasses.dataclass(frozen=True)
class AttemptRow(FrameRow):
    """One row per attempt of a job, whatever became of it."""

    run_id: str  # the driver session that made the attempt
    job_id: str
    attempt: int
    key: str  # its Dask key
    worker: str | None
    device: str | None
    started_at: dt.datetime | None
    finished_at: dt.datetime
    status: str  # words.AttemptEnd: a job's status, or cancelled (SweepHandle.cancel())
    failure_class: str | None
    error_class: str | None
    error_message: str | None
    # What the try ran with (an out-of-memory retry gets a whole device and half the batch).
    eval_batch_size: int
    gpu_share: float
    device_memory_request_bytes: int | None  # null: placement by memory was off


@dataclasses.dataclass(frozen=True)
class WorkerTaskRow(FrameRow):
    """One row per task other than a job's attempt that a session ran on a worker: the run's
    time account beside the attempts frame."""

    run_id: str  # the driver session that scheduled it
    key: str  # its Dask key
    kind: str  # words.WorkerTaskKind: reference, baseline tasks, search units, probe...
    label: str  # its model
    worker: str
    device: str
    started_at: dt.datetime  # the worker's clock, as it began (after any lock it waits for)
    finished_at: dt.datetime
    status: str  # done or failed
    error_class: str | None  # the exception's type, for a failed one


@dataclasses.dataclass(frozen=True)
class EnvironmentRow(FrameRow):
    """One row per (driver session, process, component): what the driver and each worker ran
    on when the session started (``process.environment``)."""

    run_id: str  # the driver session
    process: str  # driver, or a worker's address
    captured_at: dt.datetime
    component: str  # quantdask, quantdask_commit, python, torch, ..., cuda, gpu_driver, gpu, os
    value: str  # its version or model (process.environment.NOT_INSTALLED: absent)


@dataclasses.dataclass(frozen=True)
class SessionRow(FrameRow):
    """One row per driver session on the run directory."""

    run_id: str  # one driver session: one call of run_sweep on this run directory
    sweep: str
    started_at: dt.datetime
    finished_at: dt.datetime | None  # null while it runs (or if the driver died)
    completed: bool  # false when the session ended with an error or an interrupt
    workers: int  # workers when it started
    slots: int  # jobs those workers could run at once
    jobs_planned: int
    jobs_run: int  # jobs not yet finished at the start, so submitted this session


@dataclasses.dataclass(frozen=True)
class SampleRow(FrameRow):
    """One device sample of a worker (GPU by NVML, or the worker process on a CPU slot)."""

    worker: str
    device: str  # cuda:<physical id> or cpu
    time: dt.datetime
    job_id: str | None  # the job (or reference-...) running when sampled; null when idle
    utilization_pct: float  # GPU utilization (NVML) or the worker process's CPU %
    memory_used_bytes: int  # device memory in use (NVML) or the process's RSS
    memory_total_bytes: int


@dataclasses.dataclass(frozen=True)
class SensitivityRow(FrameRow):
    """One row per (search, unit, format) cell, from the probes (null kl: infeasible)."""

    search: str
    search_key: str  # what the cell's figures depend on (model, formats, windows)
    model: str
    unit: str  # a linear (model.layers.3.mlp.up_proj) or a block (model.layers.3)
    layer: int  # its decoder layer
    format: str  # a label of the search's formats
    params: int  # the unit's weights
    kl: float | None  # the KL it adds alone on the calibration windows (nats per token)
    kl_se: float | None  # its standard error over the windows
    bytes: int | None  # the unit's stored bytes in this format
    error: str | None  # why the format cannot take the unit (then kl and bytes are null)
    worker: str | None
    seconds: float
    # How the cell was scored: kl (its KL measured with the unit swapped in) or fisher (a
    # second-order estimate from one backward pass per calibration batch, mapped to nats by a
    # fit against the measured whole-model KLs of unit (all))
    method: str = "kl"
    # The method's own figure: the KL measured (kl), or the Fisher estimate in nats before the
    # fit (fisher)
    score: float | None = None


@dataclasses.dataclass(frozen=True)
class RefinementRow(FrameRow):
    """One row per (search, generation, candidate) of a search's refinement: a whole mix
    scored by its KL measured on the refinement's calibration windows."""

    search: str
    search_key: str  # the search's key, plus the refinement's windows and seed
    model: str
    generation: int  # 0: the solver's allocation, the first parent
    candidate: int  # 0: the generation's parent (re-scored only in generation 0)
    parent: str  # the parent mix's hash (its formats, canonical JSON)
    mix: str  # this mix's hash
    formats: str  # unit -> format, canonical JSON
    bytes: int  # the units' stored bytes (the budget counts these plus the rest)
    kl: float  # its whole-model KL on the refinement windows (nats per token)
    kl_se: float  # its standard error over the windows
    kl_vs_parent: float  # its KL minus its parent's, window by window (paired)
    kl_vs_parent_se: float  # that difference's standard error
    window_kl: str  # each window's KL, a JSON list (the next generation's pairs)
    measured_in: str  # torch (the probe model, every unit swapped in) or the runtime
    worker: str | None
    seconds: float


@dataclasses.dataclass(frozen=True)
class AllocationRow(FrameRow):
    """One row per (allocation, unit): the format each verified allocation gives each unit."""

    search: str
    model: str
    job_id: str  # the job that verifies it
    role: str  # mixed, equal-bytes or uniform
    candidate: int  # its rank among its budget's (1: the best)
    budget_bits_per_weight: float
    budget_bytes: int
    unit: str
    format: str
    predicted_kl: float  # the allocation's: the sum of its cells'
    predicted_bytes: int  # the allocation's whole model as stored
    solver: str  # milp or fallback
    predicted_in: str = "torch"  # or "torch, a proxy for <runtime>" (a runtime of its own)
    backend: str = ""  # the search's backend
    config: str = ""  # the verifying job's options, canonical JSON (what an export writes)
    model_location: str = ""  # the model's directory or hub id (what an export converts)
