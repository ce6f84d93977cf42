"""The phases of a job, in order (``PHASES``): load, quantize, coverage, layer weights, score
(with the layers' output errors), task accuracy, generation speed, artifacts.

A phase is a function of the attempt's context (``JobContext``: its job, backend, reference,
device, and the resources its span holds) and of what the phases before it made (``Made``, an
immutable stage: the model's source, its mapped weights, the quantized model, ...). It returns
the next stage (``dataclasses.replace``) and a typed record (``records``) of the results
columns and frame rows it produces, or None when it had nothing to do. A new measurement is one
more phase function here, its record type, and one more entry in ``PHASES``; ``job.job`` runs
them into an outcome, holding each stage only until the next phase returns.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar, cast

from quantdask.backends.capabilities import Dequantizes, OwnRuntime
from quantdask.errors import UnsupportedHere
from quantdask.job.artifacts import keep_artifact
from quantdask.measure.calibration import Calibration
from quantdask.measure.coverage import Coverage, coverage
from quantdask.measure.layers import OutputErrors, weight_errors
from quantdask.measure.metrics import QualityMeter, measure_quality
from quantdask.measure.tasks import truncated_total, with_baseline
from quantdask.measure.usage import PeakMemory, Stopwatch
from quantdask.process import cpu_share
from quantdask.process.model_source import cached_model_source
from quantdask.process.runtime import held_resources
from quantdask.records import (
    Artifact,
    Covered,
    LayerRow,
    LayerWeights,
    Loaded,
    PhaseRecord,
    Quality,
    Quantized,
    Row,
    Scored,
    Speed,
    TaskScores,
    WindowRow,
)

if TYPE_CHECKING:
    import torch

    from quantdask.backends.base import Backend
    from quantdask.measure.reference import Reference
    from quantdask.process.model_source import ModelSource
    from quantdask.sweepfile.sweep import Job


log = logging.getLogger("quantdask.job")

PROBE_WINDOWS = 4
"""The first eval windows, per-layer output error is measured on (during the eval's passes)."""

T = TypeVar("T")


@dataclass(frozen=True)
class JobContext:
    """What one attempt runs with, from its start to its end: the job, its backend on its
    device, its model's reference, and what its span measures and holds (``measured``). The
    stopwatch, the peak and the held stack are filled in as the attempt goes; these fields
    never change."""

    job: Job
    backend: Backend
    reference: Reference
    device: str  # torch's device, e.g. cuda:0
    cuda: bool
    device_label: str = ""  # what the records call it: cuda:<physical id> or cpu
    prepared: Any = None  # what the backend's OwnRuntime.prepare task made (a converted file)
    watch: Stopwatch = field(default_factory=Stopwatch)
    peak: PeakMemory = field(init=False)  # the span's, read once it ends
    holding: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __post_init__(self) -> None:
        # Frozen: a field derived from another is set by object.__setattr__ (as the
        # dataclasses documentation does), once, here.
        object.__setattr__(self, "peak", PeakMemory(self.cuda))

    @contextlib.contextmanager
    def measured(self) -> Iterator[None]:
        """The phases' span: wall time and peak memory; the mapped weights and idle slots'
        cores are held until it ends. What the phases made is ``job.job.run_phases``' alone,
        and gone before the span ends."""
        with self.watch("wall"), self.peak, self.holding:
            self.holding.enter_context(cpu_share.busy())  # borrows idle slots' cores
            yield


@dataclass(frozen=True)
class Made:
    """What an attempt's phases have made so far, one immutable stage after each phase. A
    field is None until the phase that makes it (``load``: source and originals; ``quantize``:
    model and calibration; ``check_coverage``: covered, unless a streamed pass counted it):
    read it through ``need``, which names what a phase asked for too early. ``records`` are
    the records the phases returned so far (``job.run_phases`` adds each)."""

    source: ModelSource | None = None
    originals: dict[str, torch.Tensor] | None = None  # the unquantized weights, mapped
    model: torch.nn.Module | None = None  # the quantized model
    calibration: Calibration | None = None  # a calibrated backend's windows
    covered: Coverage | None = None
    meter: QualityMeter | None = None  # a streamed job's, measured in its one pass
    layers: tuple[Row, ...] = ()  # weight errors of the measured layers
    unmeasured: Mapping[str, str] = field(default_factory=dict)  # layer -> why not measured
    # A backend with a runtime of its own (OwnRuntime): what that runtime measures (a GGUF's
    # path), made by its quantize phase.
    runtime_model: Any = None
    records: tuple[PhaseRecord, ...] = ()


def need(value: T | None, name: str) -> T:
    """``value``, the field ``name`` of ``Made``, made by an earlier phase; a phase that reads
    it before that phase ran is a RuntimeError saying so."""
    if value is None:
        raise RuntimeError(f"no {name} made yet: a phase read it before the phase that makes it")
    return value


def load(run: JobContext, made: Made) -> tuple[Made, Loaded]:
    """The model's source (config, tokenizer; cached per worker) and its weights, mapped from
    the checkpoint for this job only."""
    with run.watch("load"):
        source, cached = cached_model_source(run.job.model)
        originals = run.holding.enter_context(source.weights())
    return (replace(made, source=source, originals=originals),
            Loaded(run.watch.seconds["load"], cached, source.param_count))


def quantize(run: JobContext, made: Made) -> tuple[Made, Quantized]:
    """The backend's quantized model on the device (a calibrated backend's with its data)."""
    backend, job, source = run.backend, run.job, need(made.source, "source")
    calibration = None
    with run.watch("quantize"):
        if not backend.calibrates(job.options):
            model = backend.quantize(source, job.options, run.device)
        else:
            calibration = calibration_of(run)
            model = backend.quantize(source, job.options, run.device, calibration=calibration)
    return (replace(made, model=model, calibration=calibration),
            Quantized(run.watch.seconds["quantize"],
                      calibration.figures() if calibration is not None else None))


def calibration_of(run: JobContext) -> Calibration:
    """The calibration windows the job's reference carries, for a calibrated backend (the
    phase that calibrates keeps them in ``Made.calibration``, for the quantize figures)."""
    if run.reference.calibration is None:
        error = run.reference.calibration_error
        raise ValueError(
            f"{run.backend.name} calibrates on data and this job's reference carries none: "
            + (f"the calibration windows could not be cut ({error})" if error
               else "give the sweep a calibration block"))
    return Calibration(run.reference.calibration, run.cuda)


def check_coverage(run: JobContext, made: Made) -> tuple[Made, Covered]:
    """What the backend quantized, and the model's stored size, split into the quantized part
    and the rest; a quantizing backend that replaced no weight is unsupported here, never a
    clean result."""
    covered = made.covered  # a streamed job counted it layer by layer
    if covered is None:
        covered = coverage(need(made.model, "model"), need(made.originals, "originals"),
                           run.backend.sizing.stored_bytes)
    if run.backend.sizing.quantizes and not covered.quantized_params:
        raise UnsupportedHere(
            f"no layer was quantized: {run.backend.name} replaced none of this model's "
            f"weights, which stay in {covered.by_class()}")
    return replace(made, covered=covered), covered_record(
        covered, need(made.source, "source").param_count, run.backend.sizing.quantizes)


def covered_record(covered: Coverage, params: int, quantizes: bool) -> Covered:
    """The coverage phase's record of ``covered`` in a model of ``params`` weights (what
    stayed in full precision named only for a config that quantizes)."""
    return Covered(
        size_bytes=covered.size_bytes, bits_per_weight=8.0 * covered.size_bytes / params,
        quantized_bytes=covered.quantized_bytes,
        bits_per_quantized_weight=covered.bits_per_quantized_weight,
        unquantized_bytes=covered.unquantized_bytes,
        unquantized_dtypes=covered.unquantized_dtypes(),
        quantized_params=covered.quantized_params, quantized_share=covered.quantized_share,
        full_precision=covered.summary() if quantizes else None)


def layer_weights(run: JobContext, made: Made) -> tuple[Made, LayerWeights]:
    """Each quantized layer's weight error; before any forward pass (kernels may repack
    weights then: see ``layers``)."""
    dequantizes = run.backend.has(Dequantizes)
    layers, unmeasured = made.layers, made.unmeasured  # a streamed pass measured its own
    if run.job.layer_stats and dequantizes is not None and not run.job.streamed:
        rows, unmeasured = weight_errors(need(made.model, "model"), dequantizes.dequantize,
                                         need(made.originals, "originals"))
        layers = tuple(rows)
    for name, reason in unmeasured.items():
        log.warning("per-layer stats skip %s: %s", name, reason)
    return replace(made, layers=layers, unmeasured=unmeasured), LayerWeights(len(unmeasured))


def score(run: JobContext, made: Made) -> tuple[Made, Scored]:
    """Perplexity, KL and top-1 agreement against the reference on the eval windows, and the
    measured layers' output errors on the first ``PROBE_WINDOWS`` of them, taken by forward
    hooks during the same passes (``layers.OutputErrors``)."""
    reference = run.reference
    if run.job.is_baseline and not run.job.eval.reference_float32:
        # The reference evaluated this very model on these windows: its scores are the
        # baseline's (the unquantized model is not evaluated twice; the time it took is the
        # reference task's, not this job's). A 16-bit model against its float32 reference
        # is measured as any job is: its KL is its dtype's noise floor.
        if reference.baseline is None:
            raise ValueError("this job's reference carries no baseline scores")
        return made, _scored(run, 0.0, reference.baseline, list(reference.baseline_windows),
                             made.layers)
    if made.meter is not None:  # streamed: measured in its one pass, output errors too
        return made, _scored(run, run.watch.seconds["eval"], made.meter.scores(),
                             made.meter.window_rows(), made.layers)
    model = need(made.model, "model")
    outputs = OutputErrors(model, made.layers, need(made.originals, "originals"),
                           PROBE_WINDOWS)
    with run.watch("eval"), outputs:
        meter = measure_quality(model, reference.windows, reference.distribution,
                                run.job.eval.batch_size, run.device, on_batch=outputs.batch)
    for name, reason in outputs.failed.items():
        log.warning("per-layer output error skips %s: %s", name, reason)
    return made, _scored(run, run.watch.seconds["eval"], meter.scores(), meter.window_rows(),
                         outputs.rows())


def _scored(run: JobContext, seconds: float, quality: Quality, windows: list[WindowRow],
            layers: Sequence[Row]) -> Scored:
    """The score phase's record: the figures, with what they were measured against (the
    reference's KL kind and tail, the windows' BOS) and the layers frame's rows."""
    reference = run.reference
    return Scored(seconds, quality, reference.kl_kind, reference.kl_tail_mass,
                  run.job.eval.bos_token_id, reference.dtype or None, windows=windows,
                  layers=_positioned(layers))


def _positioned(layers: Sequence[Row]) -> list[LayerRow]:
    """The layers frame's rows: each measured layer (``measure.layers``' figures) with its
    order in the network."""
    return [LayerRow(position=i, layer=row["layer"], in_features=row["in_features"],
                     out_features=row["out_features"],
                     weight_rel_error=row["weight_rel_error"],
                     weight_sqnr_db=row["weight_sqnr_db"],
                     output_rel_error=row.get("output_rel_error"))
            for i, row in enumerate(layers)]


def score_tasks(run: JobContext, made: Made) -> tuple[Made, TaskScores | None]:
    """The sweep's lm-eval tasks on the quantized model in memory, with the baseline's scores
    of its model beside each (the baseline job reuses those: its model is the one they were
    scored on, once per model with the reference). When the baseline's scoring failed, the
    baseline job records why (``tasks_error``) and no rows, and every other job's rows say it
    where their recovery is null."""
    tasks, baseline = run.job.tasks, run.reference.tasks
    if tasks is None:
        return made, None
    error = (baseline.error if baseline is not None
             else "its model's reference carries no baseline task scores")
    if run.job.is_baseline:
        rows, seconds = (baseline.rows, baseline.seconds) if baseline else ([], 0.0)
        device_peak, rss_peak = ((baseline.peak_device_mem_bytes, baseline.peak_host_rss_bytes)
                                 if baseline else (0, 0))
        scored = with_baseline(rows, rows, error)
        return made, TaskScores(seconds, device_peak, rss_peak, truncated_total(scored),
                                tasks_error=error, tasks=scored,
                                task_items=baseline.items if baseline else [])
    from quantdask.measure.tasks import evaluate_tasks

    return made, tasks_scored(run, lambda: evaluate_tasks(
        need(made.model, "model"), need(made.source, "source").tokenizer, tasks))


def tasks_scored(run: JobContext, evaluate: Callable[[], tuple[list, list]]) -> TaskScores:
    """A quantized job's task phase: ``evaluate()`` (its tasks frame's rows and task items,
    in whatever runtime the job runs) timed and its peaks measured, each row with the
    baseline's score and the recovery beside it."""
    baseline = run.reference.tasks
    error = (baseline.error if baseline is not None
             else "its model's reference carries no baseline task scores")
    with run.watch("tasks"), PeakMemory(run.cuda) as peak:
        rows, items = evaluate()
    scored = with_baseline(rows, run.reference.baseline_tasks, error)
    return TaskScores(run.watch.seconds["tasks"], peak.peak_device_bytes, peak.peak_rss_bytes,
                      truncated_total(scored), tasks=scored, task_items=items)


def time_generation(run: JobContext, made: Made) -> tuple[Made, Speed | None]:
    """Greedy generation timed per batch size (``measure.speed``), on the model the quality
    phases measured; its own section of the stopwatch (``speed_s``), never part of the eval's.
    On a CPU slot, whose device is the machine's cores, the rows also say whether another
    slot's job computed meanwhile."""
    settings = run.job.speed
    if settings is None:
        return made, None
    from quantdask.measure.speed import measure_speed

    whole = held_resources().get("GPU", 1.0) >= 1.0  # outside Dask: nothing else scheduled
    with run.watch("speed"):
        rows = measure_speed(need(made.model, "model"), run.reference.windows, settings,
                             run.cuda, need(made.source, "source").tokenizer.pad_token_id,
                             run.device_label, whole,
                             None if run.cuda else cpu_share.others_busy,
                             run.job.eval.bos_token_id)
    return made, Speed(run.watch.seconds["speed"], speed=rows)


def keep_artifacts(run: JobContext, made: Made) -> tuple[Made, Artifact | None]:
    """Save (and verify, reusing the score phase's rows) the quantized model, when asked."""
    artifacts = run.job.artifacts
    if artifacts is None or not artifacts.enabled:
        return made, None
    return made, keep_artifact(need(made.model, "model"), need(made.source, "source").tokenizer,
                               run.backend, run.job, run.reference, run.device, made.records)


Phase = Callable[[JobContext, Made], tuple[Made, PhaseRecord | None]]
"""A phase: the attempt's context and the stage so far, to the next stage and its record."""
PHASES: tuple[Phase, ...] = (load, quantize, check_coverage, layer_weights, score,
                             score_tasks, time_generation, keep_artifacts)
"""What an attempt of a resident job does, in order."""

_STREAMED_PHASES: list[tuple[Phase, ...]] = []  # registered by quantdask.stream


def register_streamed_phases(phases: tuple[Phase, ...]) -> None:
    """What an attempt of a streamed job (``Job.streamed``) does, in order: the stream
    capability registers its phases here as it is imported (the core never imports it)."""
    _STREAMED_PHASES[:] = [phases]


def phases_for(run: JobContext) -> tuple[Phase, ...]:
    """The phases ``run`` goes through: those of a backend with a runtime of its own
    (:class:`OwnRuntime`), a streamed job's, or a resident one's."""
    own = run.backend.has(OwnRuntime) if run.backend is not None else None  # (tests: none)
    if own is not None:
        return cast("tuple[Phase, ...]", own.phases)
    if not run.job.streamed:
        return PHASES
    if not _STREAMED_PHASES:
        raise RuntimeError("a streamed job, and no streamed phases registered: "
                           "import quantdask.stream first (import quantdask does)")
    return _STREAMED_PHASES[0]
