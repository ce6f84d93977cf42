"""What each phase of a job produces, typed: the columns it adds to the job's results row and the
rows it adds to the secondary frames (``records.rows``).

A phase returns one :class:`PhaseRecord` (a frozen dataclass): its plain fields are results
columns, a field made with :func:`frame_rows` holds rows of the frame it names, and a field
whose type is another record contributes that record's columns (the quality figures inside
the score's record). ``run_job`` keeps the records of the phases that ran (``JobOutcome``);
the results schema is derived from them (``store.schema.RESULT_RECORDS``), and
``tests/test_store.py`` checks from the return annotations that every results column comes
from exactly one place, so a misspelt column is a failing test, not a missing column in a
report.

>>> Loaded(load_s=0.5, source_cached=True, param_count=10).columns()
{'load_s': 0.5, 'source_cached': True, 'param_count': 10}
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import TYPE_CHECKING

from quantdask.records.base import PhaseRecord, frame_rows
from quantdask.records.rows import (
    LayerRow,
    PhaseRow,
    SpeedRow,
    TaskItemRow,
    TaskRow,
    WindowRow,
)

if TYPE_CHECKING:
    from quantdask.measure.usage import PeakMemory


@dataclasses.dataclass(frozen=True)
class Recorded(PhaseRecord):
    """What every job's row holds whatever became of it: its identity, stamped by the driver
    (``run.recorder``)."""

    job_id: str
    sweep: str
    model: str
    backend: str
    config: str  # canonical JSON of the options
    config_label: str
    attempts: int
    priority: int
    queued_at: dt.datetime


@dataclasses.dataclass(frozen=True)
class Ended(PhaseRecord):
    """How and when an attempt ended: done, failed or skipped (``words.Status``; the attempts
    frame's ``cancelled`` too)."""

    status: str
    finished_at: dt.datetime


@dataclasses.dataclass(frozen=True)
class GateVerdict(PhaseRecord):
    """The sweep's gates (null without gates, and for the baseline they are measured against):
    whether this done job passed them all, the gates it passed, and why each failing one
    failed, one per line (``run.recorder``)."""

    gates_passed: bool | None = None
    gates_met: str | None = None
    gates_failed: str | None = None


@dataclasses.dataclass(frozen=True)
class SearchedFor(PhaseRecord):
    """A mixed-precision search's job (null for the sweep's own configs): its search, its role
    (mixed, equal-bytes or uniform), its rank among its budget's candidates, that budget, and
    the KL and stored bytes the probes predicted (the allocation frame has its formats)."""

    search: str
    search_role: str
    search_candidate: int
    search_budget_bits_per_weight: float
    predicted_kl: float
    predicted_bytes: int
    # how the prediction was made (the allocation frame's predicted_in; null: before methods)
    predicted_in: str | None = None


@dataclasses.dataclass(frozen=True)
class Where(PhaseRecord):
    """Where and when an attempt ran: kept whatever became of it."""

    worker: str | None
    host: str | None
    started_at: dt.datetime | None
    device: str | None = None


@dataclasses.dataclass(frozen=True)
class Peaks(PhaseRecord):
    """Peak device memory (allocated, reserved) and host RSS over a block (see
    ``measure.usage.PeakMemory``); ``peak_shared``: other jobs packed on the worker ran
    meanwhile, so the peaks are the worker's (an upper bound of this job's own; placement does
    not learn from them; null in results from before it was recorded)."""

    peak_device_mem_bytes: int
    peak_device_reserved_bytes: int
    peak_host_rss_bytes: int
    peak_shared: bool = False

    @classmethod
    def of(cls, peak: PeakMemory) -> Peaks:
        return cls(peak.peak_device_bytes, peak.peak_reserved_bytes, peak.peak_rss_bytes,
                   peak.shared)

    def max(self, other: Peaks) -> Peaks:
        """The larger of each figure (shared if either was)."""
        return Peaks(max(self.peak_device_mem_bytes, other.peak_device_mem_bytes),
                     max(self.peak_device_reserved_bytes, other.peak_device_reserved_bytes),
                     max(self.peak_host_rss_bytes, other.peak_host_rss_bytes),
                     self.peak_shared or other.peak_shared)


@dataclasses.dataclass(frozen=True)
class Span(PhaseRecord):
    """The whole attempt's wall time and peaks (a baseline's include its reference's), and
    each phase's own time and peaks (the phases frame)."""

    wall_s: float
    peaks: Peaks
    phases: list[PhaseRow] = frame_rows("phases")


@dataclasses.dataclass(frozen=True)
class Loaded(PhaseRecord):
    """The ``load`` phase: the model's source and its mapped weights."""

    load_s: float
    source_cached: bool
    param_count: int


@dataclasses.dataclass(frozen=True)
class Calibrated(PhaseRecord):
    """A calibrated backend's data-driven step, inside the quantize phase (inside quantize_s),
    and its peaks; null for a backend that does not calibrate."""

    calibrate_s: float
    calibrate_peak_device_mem_bytes: int
    calibrate_peak_host_rss_bytes: int


@dataclasses.dataclass(frozen=True)
class Quantized(PhaseRecord):
    """The ``quantize`` phase (``calibration``: None for a backend that does not calibrate)."""

    quantize_s: float
    calibration: Calibrated | None = None


@dataclasses.dataclass(frozen=True)
class Streamed(PhaseRecord):
    """A streamed job's pass (``stream.streamed_job``): its layers read from the checkpoint
    one at a time (null for a resident job): the checkpoint bytes it read, its mean seconds
    per layer (read, quantize, run every window), and what it skipped because it needs the
    model resident."""

    quantized: Quantized  # its quantize_s: reading and quantizing the layers
    streamed: bool
    stream_bytes_read: int
    stream_layer_s: float
    stream_skipped: str


@dataclasses.dataclass(frozen=True)
class InRuntime(PhaseRecord):
    """A job of a backend with a runtime of its own (``OwnRuntime``: llama.cpp for GGUF), null
    otherwise: the runtime and its build, the tensors' types as the file holds them, the share
    of the quantized weights the runtime's quantizer put in another type than the config's
    (llama.cpp swaps K-quants for legacy types on rows that are not a multiple of 256), and
    what the job did not measure in that runtime."""

    quantized: Quantized  # its quantize_s: the conversion (once per model) and the quantizer
    runtime: str  # e.g. llama.cpp 0c1e570 (llama-cpp-python 0.3.36), cpu
    tensor_types: str  # e.g. 13 Q4_K, 3 Q6_K, 5 F32
    fallback_share: float  # of the quantized weights: 0 when every tensor took the config's type
    runtime_skipped: str | None  # what it did not measure there (null: nothing)
    # who wrote the file's quantized tensors: "llama.cpp's quantizer", or a searched mix
    # "assembled: N of M tensors quantized here" (the rest kept from earlier mixes, the same
    # bytes: gguf.assembled), so its quantize_s counts only those N
    quantized_by: str | None = None


@dataclasses.dataclass(frozen=True)
class Covered(PhaseRecord):
    """The ``check_coverage`` phase: what was quantized, and the stored size split."""

    size_bytes: int
    bits_per_weight: float
    # size_bytes split: the quantized weights with their quantization constants (scales,
    # zeros, absmax, quant maps, packing metadata), and the rest (embeddings, norms, head,
    # biases, unquantized layers) in whatever dtype the backend leaves it, with its dtypes'
    # shares ("float16 93%, float32 7%"). Methods compare on bits_per_quantized_weight (8 x
    # quantized_bytes / quantized_params; null when nothing is quantized, as for the
    # baseline): bits_per_weight counts the rest's dtype too.
    quantized_bytes: int
    bits_per_quantized_weight: float | None
    unquantized_bytes: int
    unquantized_dtypes: str
    # Weights the backend holds quantized (logical count), and their share of param_count:
    # 0 for the baseline; a quantized config that quantized nothing is skipped, never done.
    quantized_params: int
    quantized_share: float
    full_precision: str | None  # what stayed in full precision, largest share first


@dataclasses.dataclass(frozen=True)
class LayerWeights(PhaseRecord):
    """The ``layer_weights`` phase: how many quantized layers could not be measured."""

    layers_unmeasured: int  # quantized layers the per-layer stats could not measure


@dataclasses.dataclass(frozen=True)
class Quality(PhaseRecord):
    """Perplexity, KL, top-1 and the correct token's probability change, with their standard
    errors (``measure.statistics.quality_figures``; docs/quality.md)."""

    perplexity: float
    # Standard errors (_se) are over eval windows, null with one window; docs/quality.md.
    ln_ppl_se: float | None  # of ln(perplexity)
    kl_divergence: float  # KL(baseline || quantized) per token, nats
    kl_se: float | None
    # KL per position: percentiles over positions, and the largest
    kl_median: float
    kl_p90: float
    kl_p99: float
    kl_p999: float
    kl_max: float
    top1_agreement: float  # share of tokens where the top-1 prediction matches
    top1_agreement_se: float | None  # binomial, over tokens
    eval_tokens: int
    # The correct next token's probability, quantized minus baseline, per position
    delta_p_mean: float | None
    delta_p_se: float | None
    delta_p_rms: float | None
    delta_p_p01: float | None
    delta_p_p05: float | None
    delta_p_median: float | None
    delta_p_p95: float | None
    delta_p_p99: float | None
    # ln(PPL(quantized) / PPL(baseline)) on the same tokens, and its paired standard error
    ln_ppl_ratio: float | None
    ln_ppl_ratio_se: float | None


@dataclasses.dataclass(frozen=True)
class Scored(PhaseRecord):
    """The ``score`` phase: the quality figures against the reference, per window too, and the
    per-layer rows (weight errors, with the output errors measured during its passes)."""

    eval_s: float
    quality: Quality
    kl_kind: str  # exact, estimate (unbiased, tail sampled) or lower_bound
    # The reference's mean probability mass outside its top eval.kl_top_k tokens (0: exact KL)
    kl_tail_mass: float
    # The token that starts every eval window (eval.bos resolved with the model's tokenizer);
    # null: the text cut as the tokenizer encodes it (a BOS at most in window 0)
    eval_bos_token_id: int | None = None
    # What the reference's log-probs were computed in: float32 (a 16-bit model's, by default:
    # eval.reference_dtype) or the model's own dtype
    reference_dtype: str | None = None
    windows: list[WindowRow] = frame_rows("windows")
    layers: list[LayerRow] = frame_rows("layers")


@dataclasses.dataclass(frozen=True)
class TaskScores(PhaseRecord):
    """The ``score_tasks`` phase (a sweep with a tasks block; null without): its time and
    peaks (the baseline's: its tasks scored once per model beside the reference), and the
    samples of all its tasks that had a prompt cut to the model's window (the tasks frame
    says which)."""

    tasks_s: float
    tasks_peak_device_mem_bytes: int
    tasks_peak_host_rss_bytes: int
    tasks_truncated_samples: int
    # The baseline's only: why its tasks have no scores (scoring the unquantized model failed;
    # its quality figures and the quantized jobs' task scores stand). Null otherwise.
    tasks_error: str | None = None
    tasks: list[TaskRow] = frame_rows("tasks")
    task_items: list[TaskItemRow] = frame_rows("task_items")


@dataclasses.dataclass(frozen=True)
class Speed(PhaseRecord):
    """The ``time_generation`` phase (a sweep with a speed block; null without): its wall
    time, warm-up runs included; its figures are in the speed frame, one row per batch size."""

    speed_s: float
    speed: list[SpeedRow] = frame_rows("speed")


@dataclasses.dataclass(frozen=True)
class Artifact(PhaseRecord):
    """The ``keep_artifacts`` phase (artifacts: keep; null when none was asked for): where the
    saved model went, its bytes on disk and sha256 (``job.artifacts.directory_digest``),
    whether it is still kept (false: deleted, off the Pareto frontier), the reloaded model's
    KL minus the in-memory one's on the first eval windows (verify: true), and why a save
    failed."""

    artifact_uri: str | None = None
    artifact_bytes: int | None = None
    artifact_sha256: str | None = None
    artifact_kept: bool | None = None
    reload_kl_delta: float | None = None
    artifact_error: str | None = None


@dataclasses.dataclass(frozen=True)
class NotDone(PhaseRecord):
    """Why an attempt did not finish: its class, and the exception's type, message and
    traceback."""

    # One of store.schema.FAILURE_CLASSES, for failed and skipped jobs (none: cancelled)
    failure_class: str | None
    error_class: str  # the exception's type
    error_message: str
    traceback: str | None = None
    # An attempt its worker's nanny killed for memory (Dask's worker-restart-memory event):
    # the worker's Dask memory limit, and its RSS as the nanny read it, past the terminate
    # fraction of that limit (the peak the attempt reached, at least); null otherwise.
    memory_limit_bytes: int | None = None
    killed_at_rss_bytes: int | None = None


