"""The phases of a job, in order (``PHASES``), and the state an attempt hands from one to the
next (``JobRun``): load, quantize, coverage, layer weights, score (with the layers' output
errors), task accuracy, generation speed, artifacts. Each phase returns a typed record
(``records``) of the results columns and frame rows it produces, or None when it had
nothing to do. A new measurement is one more phase function here, its record type, and one
more entry in ``PHASES``; ``job.job`` runs them into an outcome.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quantdask.backends.capabilities import Dequantizes
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
    PhaseRow,
    Quantized,
    Row,
    Scored,
    Speed,
    TaskScores,
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



@dataclass
class JobRun:
    """One attempt's state, handed from phase to phase. The fields without a default are set
    by the phase that makes them (``load``: source and originals; ``quantize``: model;
    ``check_coverage``: covered): a phase that reads one before is an AttributeError."""

    job: Job
    backend: Backend
    reference: Reference
    device: str  # torch's device, e.g. cuda:0
    cuda: bool
    device_label: str = ""  # what the records call it: cuda:<physical id> or cpu
    watch: Stopwatch = field(default_factory=Stopwatch)
    peak: PeakMemory = field(init=False)
    holding: contextlib.ExitStack = field(init=False)  # held until the attempt is measured
    source: ModelSource = field(init=False)
    originals: dict[str, torch.Tensor] = field(init=False)  # the unquantized weights, mapped
    model: torch.nn.Module = field(init=False)  # the quantized model
    calibration: Calibration | None = None
    covered: Coverage = field(init=False)
    meter: QualityMeter | None = None  # a streamed job's, measured in its one pass
    layers: list[Row] = field(default_factory=list)  # weight errors of the measured layers
    unmeasured: dict[str, str] = field(default_factory=dict)  # layer -> why not measured
    records: list[PhaseRecord] = field(default_factory=list)  # what the phases produced
    phase_rows: list[PhaseRow] = field(default_factory=list)  # the phases frame's rows

    @contextlib.contextmanager
    def measured(self) -> Iterator[None]:
        """The phases' span: wall time and peak memory; the mapped weights and idle slots'
        cores are held until it ends, and the models dropped then."""
        with self.watch("wall"), PeakMemory(self.cuda) as self.peak, \
                contextlib.ExitStack() as self.holding:
            self.holding.enter_context(cpu_share.busy())  # borrows idle slots' cores
            try:
                yield
            finally:
                for name in ("model", "originals"):
                    vars(self).pop(name, None)


def load(run: JobRun) -> Loaded:
    """The model's source (config, tokenizer; cached per worker) and its weights, mapped from
    the checkpoint for this job only."""
    with run.watch("load"):
        run.source, cached = cached_model_source(run.job.model)
        run.originals = run.holding.enter_context(run.source.weights())
    return Loaded(run.watch.seconds["load"], cached, run.source.param_count)


def quantize(run: JobRun) -> Quantized:
    """The backend's quantized model on the device (a calibrated backend's with its data)."""
    backend, job = run.backend, run.job
    with run.watch("quantize"):
        if not backend.calibrated:
            run.model = backend.quantize(run.source, job.options, run.device)
        else:
            run.model = _calibrated_model(run)
    return Quantized(run.watch.seconds["quantize"],
                     run.calibration.figures() if run.calibration is not None else None)


def _calibrated_model(run: JobRun) -> torch.nn.Module:
    """The quantized model of a backend that calibrates on the reference's windows."""
    return run.backend.quantize(run.source, run.job.options, run.device,
                                calibration=calibration_of(run))


def calibration_of(run: JobRun) -> Calibration:
    """The calibration windows the job's reference carries, for a calibrated backend (kept
    in ``run.calibration`` for the quantize figures)."""
    if run.reference.calibration is None:
        error = run.reference.calibration_error
        raise ValueError(
            f"{run.backend.name} calibrates on data and this job's reference carries none: "
            + (f"the calibration windows could not be cut ({error})" if error
               else "give the sweep a calibration block"))
    run.calibration = Calibration(run.reference.calibration, run.cuda)
    return run.calibration


def check_coverage(run: JobRun) -> Covered:
    """What the backend quantized, and the model's stored size, split into the quantized part
    and the rest; a quantizing backend that replaced no weight is unsupported here, never a
    clean result."""
    if "covered" not in vars(run):  # a streamed job counted it layer by layer
        run.covered = coverage(run.model, run.originals, run.backend.sizing.stored_bytes)
    if run.backend.sizing.quantizes and not run.covered.quantized_params:
        raise UnsupportedHere(
            f"no layer was quantized: {run.backend.name} replaced none of this model's "
            f"weights, which stay in {run.covered.by_class()}")
    covered, params = run.covered, run.source.param_count
    return Covered(
        size_bytes=covered.size_bytes, bits_per_weight=8.0 * covered.size_bytes / params,
        quantized_bytes=covered.quantized_bytes,
        bits_per_quantized_weight=covered.bits_per_quantized_weight,
        unquantized_bytes=covered.unquantized_bytes,
        unquantized_dtypes=covered.unquantized_dtypes(),
        quantized_params=covered.quantized_params, quantized_share=covered.quantized_share,
        full_precision=covered.summary() if run.backend.sizing.quantizes else None)


def layer_weights(run: JobRun) -> LayerWeights:
    """Each quantized layer's weight error; before any forward pass (kernels may repack
    weights then: see ``layers``)."""
    layer_weights = run.backend.has(Dequantizes)
    if run.job.layer_stats and layer_weights is not None and not run.job.streamed:
        run.layers, run.unmeasured = weight_errors(run.model, layer_weights.dequantize,
                                                   run.originals)
    for name, reason in run.unmeasured.items():
        log.warning("per-layer stats skip %s: %s", name, reason)
    return LayerWeights(len(run.unmeasured))


def score(run: JobRun) -> Scored:
    """Perplexity, KL and top-1 agreement against the reference on the eval windows, and the
    measured layers' output errors on the first ``PROBE_WINDOWS`` of them, taken by forward
    hooks during the same passes (``layers.OutputErrors``)."""
    reference = run.reference
    if run.job.is_baseline:
        # The reference evaluated this very model on these windows: its scores are the
        # baseline's (the unquantized model is not evaluated twice; the time it took is the
        # reference task's, not this job's).
        if reference.baseline is None:
            raise ValueError("this job's reference carries no baseline scores")
        return Scored(0.0, reference.baseline, reference.kl_kind, reference.kl_tail_mass,
                      windows=list(reference.baseline_windows), layers=_positioned(run.layers))
    if run.meter is not None:  # streamed: measured in its one pass, output errors too
        return Scored(run.watch.seconds["eval"], run.meter.scores(), reference.kl_kind,
                      reference.kl_tail_mass, windows=run.meter.window_rows(),
                      layers=_positioned(run.layers))
    outputs = OutputErrors(run.model, run.layers, run.originals, PROBE_WINDOWS)
    with run.watch("eval"), outputs:
        meter = measure_quality(run.model, reference.windows, reference.distribution,
                                run.job.eval.batch_size, run.device, on_batch=outputs.batch)
    for name, reason in outputs.failed.items():
        log.warning("per-layer output error skips %s: %s", name, reason)
    return Scored(run.watch.seconds["eval"], meter.scores(), reference.kl_kind,
                  reference.kl_tail_mass, windows=meter.window_rows(),
                  layers=_positioned(outputs.rows()))


def _positioned(layers: list[Row]) -> list[LayerRow]:
    """The layers frame's rows: each measured layer (``measure.layers``' figures) with its
    order in the network."""
    return [LayerRow(position=i, layer=row["layer"], in_features=row["in_features"],
                     out_features=row["out_features"],
                     weight_rel_error=row["weight_rel_error"],
                     weight_sqnr_db=row["weight_sqnr_db"],
                     output_rel_error=row.get("output_rel_error"))
            for i, row in enumerate(layers)]


def score_tasks(run: JobRun) -> TaskScores | None:
    """The sweep's lm-eval tasks on the quantized model in memory, with the baseline's scores
    of its model beside each (the baseline job reuses those: its model is the one they were
    scored on, once per model with the reference). When the baseline's scoring failed, the
    baseline job records why (``tasks_error``) and no rows, and every other job's rows say it
    where their recovery is null."""
    tasks, baseline = run.job.tasks, run.reference.tasks
    if tasks is None:
        return None
    error = (baseline.error if baseline is not None
             else "its model's reference carries no baseline task scores")
    if run.job.is_baseline:
        rows, seconds = (baseline.rows, baseline.seconds) if baseline else ([], 0.0)
        device_peak, rss_peak = ((baseline.peak_device_mem_bytes, baseline.peak_host_rss_bytes)
                                 if baseline else (0, 0))
        scored = with_baseline(rows, rows, error)
        return TaskScores(seconds, device_peak, rss_peak, truncated_total(scored),
                          tasks_error=error, tasks=scored)
    from quantdask.measure.tasks import evaluate_tasks

    with run.watch("tasks"), PeakMemory(run.cuda) as peak:
        rows = evaluate_tasks(run.model, run.source.tokenizer, tasks)
    scored = with_baseline(rows, run.reference.baseline_tasks, error)
    return TaskScores(run.watch.seconds["tasks"], peak.peak_device_bytes, peak.peak_rss_bytes,
                      truncated_total(scored), tasks=scored)


def time_generation(run: JobRun) -> Speed | None:
    """Greedy generation timed per batch size (``measure.speed``), on the model the quality
    phases measured; its own section of the stopwatch (``speed_s``), never part of the eval's.
    On a CPU slot, whose device is the machine's cores, the rows also say whether another
    slot's job computed meanwhile."""
    settings = run.job.speed
    if settings is None:
        return None
    from quantdask.measure.speed import measure_speed

    whole = held_resources().get("GPU", 1.0) >= 1.0  # outside Dask: nothing else scheduled
    with run.watch("speed"):
        rows = measure_speed(run.model, run.reference.windows, settings, run.cuda,
                             run.source.tokenizer.pad_token_id, run.device_label, whole,
                             None if run.cuda else cpu_share.others_busy)
    return Speed(run.watch.seconds["speed"], speed=rows)


def keep_artifacts(run: JobRun) -> Artifact | None:
    """Save (and verify, reusing the score phase's rows) the quantized model, when asked."""
    artifacts = run.job.artifacts
    if artifacts is None or not artifacts.enabled:
        return None
    return keep_artifact(run.model, run.source.tokenizer, run.backend, run.job, run.reference,
                         run.device, run.records)


Phase = Callable[[JobRun], PhaseRecord | None]
PHASES: tuple[Phase, ...] = (load, quantize, check_coverage, layer_weights, score,
                             score_tasks, time_generation, keep_artifacts)
"""What an attempt of a resident job does, in order."""

_STREAMED_PHASES: list[tuple[Phase, ...]] = []  # registered by quantdask.stream


def register_streamed_phases(phases: tuple[Phase, ...]) -> None:
    """What an attempt of a streamed job (``Job.streamed``) does, in order: the stream
    capability registers its phases here as it is imported (the core never imports it)."""
    _STREAMED_PHASES[:] = [phases]


def phases_for(run: JobRun) -> tuple[Phase, ...]:
    """The phases ``run`` goes through: a streamed job's, or a resident one's."""
    if not run.job.streamed:
        return PHASES
    if not _STREAMED_PHASES:
        raise RuntimeError("a streamed job, and no streamed phases registered: "
                           "import quantdask.stream first (import quantdask does)")
    return _STREAMED_PHASES[0]
