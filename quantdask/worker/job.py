"""What runs on a Dask worker: one attempt of a job, as a list of phases, into a ``JobOutcome``.

``run_job`` starts the attempt (see ``attempt``), then runs ``PHASES`` in order on one
``JobRun``, the state an attempt carries from phase to phase: load, quantize, coverage, layer
weights, score (with the layers' output errors), task accuracy, generation speed, artifacts.
Each phase returns a typed record (``worker.records``) of the results columns and frame rows it
produces, or None when it had nothing to do; the results row is assembled from those records
at the end, and each phase's own time and peaks are the phases frame. A new measurement is one
more phase function here, its record type, and one more entry in ``PHASES``.

The worker process keeps each model's config and tokenizer between jobs, and maps the weights
from the checkpoint per job (see ``model_source``); the eval windows and the baseline's
log-probs arrive once per model as a Dask dependency (see ``reference``), so a sweep of many
configs pays the cold start once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import cloudpickle

from quantdask.errors import JobTimeout, UnsupportedHere
from quantdask.randomness import job_random
from quantdask.util import utcnow
from quantdask.words import FailureClass, Status
from quantdask.worker import cpu_share
from quantdask.worker.artifacts import keep_artifact
from quantdask.worker.attempt import AttemptScope, attempt_scope, captured_log
from quantdask.worker.calibration import Calibration
from quantdask.worker.coverage import Coverage, coverage
from quantdask.worker.faults import inject_faults
from quantdask.worker.layers import OutputErrors, weight_errors
from quantdask.worker.live_log import live_sender
from quantdask.worker.measure import PeakMemory, Stopwatch
from quantdask.worker.metrics import measure_quality
from quantdask.worker.model_source import cached_model_source
from quantdask.worker.outcome import JobOutcome, failure_class_of
from quantdask.worker.records import (
    Artifact,
    Covered,
    LayerWeights,
    Loaded,
    NotDone,
    Peaks,
    PhaseRecord,
    Quantized,
    ResultRow,
    Row,
    Scored,
    Span,
    Speed,
    TaskScores,
    Where,
)
from quantdask.worker.runtime import held_resources, torch_device
from quantdask.worker.tasks import truncated_total, with_baseline

if TYPE_CHECKING:
    import torch

    from quantdask.backends.base import Backend
    from quantdask.spec.sweep import Job
    from quantdask.worker.model_source import ModelSource
    from quantdask.worker.reference import Reference

log = logging.getLogger("quantdask.job")

PROBE_WINDOWS = 4
"""The first eval windows, per-layer output error is measured on (during the eval's passes)."""

WHERE_COLUMNS = Where.column_names()
"""What a record keeps of an attempt whatever became of it."""


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
    layers: list[Row] = field(default_factory=list)  # weight errors of the measured layers
    unmeasured: dict[str, str] = field(default_factory=dict)  # layer -> why not measured
    records: list[PhaseRecord] = field(default_factory=list)  # what the phases produced
    phase_rows: list[Row] = field(default_factory=list)  # the phases frame's rows

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
    backend = run.backend
    if run.reference.calibration is None:
        error = run.reference.calibration_error
        raise ValueError(
            f"{backend.name} calibrates on data and this job's reference carries none: "
            + (f"the calibration windows could not be cut ({error})" if error
               else "give the sweep a calibration block"))
    run.calibration = Calibration(run.reference.calibration, run.cuda)
    return backend.quantize(run.source, run.job.options, run.device,
                            calibration=run.calibration)


def check_coverage(run: JobRun) -> Covered:
    """What the backend quantized, and the model's stored size, split into the quantized part
    and the rest; a quantizing backend that replaced no weight is unsupported here, never a
    clean result."""
    run.covered = coverage(run.model, run.originals, run.backend.stored_bytes)
    if run.backend.quantizes and not run.covered.quantized_params:
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
        full_precision=covered.summary() if run.backend.quantizes else None)


def layer_weights(run: JobRun) -> LayerWeights:
    """Each quantized layer's weight error; before any forward pass (kernels may repack
    weights then: see ``layers``)."""
    if run.job.layer_stats and run.backend.dequantize_layer is not None:
        run.layers, run.unmeasured = weight_errors(run.model, run.backend.dequantize_layer,
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
    outputs = OutputErrors(run.model, run.layers, run.originals, PROBE_WINDOWS)
    with run.watch("eval"), outputs:
        meter = measure_quality(run.model, reference.windows, reference.distribution,
                                run.job.eval.batch_size, run.device, on_batch=outputs.batch)
    for name, reason in outputs.failed.items():
        log.warning("per-layer output error skips %s: %s", name, reason)
    return Scored(run.watch.seconds["eval"], meter.scores(), reference.kl_kind,
                  reference.kl_tail_mass, windows=meter.window_rows(),
                  layers=_positioned(outputs.rows()))


def _positioned(layers: list[Row]) -> list[Row]:
    """The layers frame's rows: each layer with its order in the network."""
    return [{**row, "position": i} for i, row in enumerate(layers)]


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
    from quantdask.worker.tasks import evaluate_tasks

    with run.watch("tasks"), PeakMemory(run.cuda) as peak:
        rows = evaluate_tasks(run.model, run.source.tokenizer, tasks)
    scored = with_baseline(rows, run.reference.baseline_tasks, error)
    return TaskScores(run.watch.seconds["tasks"], peak.peak_device_bytes, peak.peak_rss_bytes,
                      truncated_total(scored), tasks=scored)


def time_generation(run: JobRun) -> Speed | None:
    """Greedy generation timed per batch size (``worker.speed``), on the model the quality
    phases measured; its own section of the stopwatch (``speed_s``), never part of the eval's.
    On a CPU slot, whose device is the machine's cores, the rows also say whether another
    slot's job computed meanwhile."""
    settings = run.job.speed
    if settings is None:
        return None
    from quantdask.worker.speed import measure_speed

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
"""What an attempt does, in order."""


def run_phases(run: JobRun) -> None:
    """Each phase in order, with its own time and peaks (a row of the phases frame)."""
    for position, phase in enumerate(PHASES):
        began = time.perf_counter()
        with PeakMemory(run.cuda) as peak:
            produced = phase(run)
        if produced is None:
            continue
        run.records.append(produced)
        run.phase_rows.append({
            "position": position, "phase": phase.__name__,
            "seconds": time.perf_counter() - began,
            "peak_device_mem_bytes": peak.peak_device_bytes,
            "peak_host_rss_bytes": peak.peak_rss_bytes, "peak_shared": peak.shared})


def done_record(run: JobRun) -> tuple[ResultRow, dict[str, list[Row]]]:
    """The measured columns of a done attempt, and its rows of the per-job frames, from the
    records its phases produced."""
    peaks = Peaks.of(run.peak)
    if run.job.is_baseline and run.reference.baseline_peaks is not None:
        peaks = peaks.max(run.reference.baseline_peaks)  # the reference's peak is this model's
    span = Span(run.watch.seconds["wall"], peaks, phases=run.phase_rows)
    record: ResultRow = {"status": Status.DONE}
    rows: dict[str, list[Row]] = {}
    for produced in (span, *run.records):
        record.update(produced.columns())
        rows.update(produced.rows())
    return record, rows


def _log_done(record: ResultRow, layers: int) -> None:
    log.info("done in %.2fs: size %d bytes, %.2f bits/weight, %.1f%% of weights quantized, "
             "perplexity %.4f, KL %.3g, top-1 %.4f, %d layers measured", record["wall_s"],
             record["size_bytes"], record["bits_per_weight"], 100 * record["quantized_share"],
             record["perplexity"], record["kl_divergence"], record["top1_agreement"], layers)


def not_done_record(error: Exception, backend: str) -> ResultRow:
    """A skipped record for what cannot run here (a retry would repeat it), else a failed one
    classified by ``failure_class_of``; logged either way."""
    if isinstance(error, (UnsupportedHere, NotImplementedError)):
        # NotImplementedError: the library has no kernel or op for this layer type or tensor
        # (torchao on Falcon's layers, say), a limit of this combination.
        skipped = NotDone(Status.SKIPPED, FailureClass.UNSUPPORTED, type(error).__name__,
                          str(error) or f"{type(error).__name__} in {backend}")
        if isinstance(error, NotImplementedError):
            tb = traceback.format_exc()
            log.warning("skipped (not implemented by the library): %s\n%s", error, tb)
            return dataclasses.replace(skipped, traceback=tb).columns()
        log.warning("skipped: %s", error)
        return skipped.columns()
    failed = NotDone(Status.FAILED, failure_class_of(error), type(error).__name__,
                     str(error) or type(error).__name__, traceback.format_exc())
    log.error("failed (%s): %s: %s\n%s", failed.failure_class, type(error).__name__, error,
              failed.traceback)
    return failed.columns()


def start(job: Job, pickled: Backend | bytes, attempt: int, reference: Reference | None,
          scope: AttemptScope, record: ResultRow) -> JobRun:
    """The attempt's device and backend, its faults, and its model's reference."""
    import torch

    backend: Backend = cloudpickle.loads(pickled) if isinstance(pickled, bytes) else pickled
    device, device_label, cuda = torch_device()
    record["device"] = device_label
    # What this attempt really runs with (a retry after out-of-memory asks for more).
    held = ", ".join(f"{name}={amount:,.0f}" if amount >= 1000 else f"{name}={amount:g}"
                     for name, amount in held_resources().items())
    log.info("start on worker %s (%s) device %s: %s %s; eval batch %d; holding %s",
             scope.worker, scope.host, device_label, job.backend, job.config_label,
             job.eval.batch_size, held or "no resources")
    inject_faults(job, attempt)
    if reference is None:
        from quantdask.worker.reference import compute_reference

        reference = compute_reference(job.model, job.eval, job.eval.read_text(),
                                      calibration=job.calibration, tasks=job.tasks)
    if held_resources().get("GPU", 1.0) >= 1.0:
        # Alone on this worker (nothing packed beside it): a backend that draws from torch's
        # global generator is reproducible too. Packed jobs draw from their own generators
        # only (``quantdask.randomness``), and leave the global one alone.
        torch.manual_seed(job.seed)
    return JobRun(job, backend, reference, device, cuda, device_label=device_label)


def run_job(job: Job, backend: Backend | bytes, attempt: int = 1,
            reference: Reference | None = None) -> JobOutcome:
    """Run one job here and return its outcome: metrics when done, the reason when not.

    ``backend`` may come pickled (bytes), so that one this worker cannot load (a notebook's,
    from a module it lacks) fails as this job, not as the worker. ``reference`` is the model's
    shared eval windows and baseline log-probs (computed here when not given). Never raises for
    a job's own failure: the class, message and traceback come back in ``outcome.record``
    (``status`` failed or skipped), beside the job's log, its per-layer rows and the worker's
    device samples during it.
    """
    outcome = JobOutcome({})
    with captured_log(log, f"{job.id} attempt={attempt}", live=live_sender()) as buffer, \
            attempt_scope(job.id) as scope, job_random(job.seed):
        record = outcome.record = Where(scope.worker, scope.host, scope.started_at).columns()
        try:
            run = start(job, backend, attempt, reference, scope, record)
            with run.measured():
                run_phases(run)
            measured, outcome.rows = done_record(run)
            record.update(measured)
            _log_done(record, len(outcome.rows["layers"]))
        except Exception as error:
            record.update(not_done_record(error, job.backend))
    outcome.device_samples = scope.samples
    _fail_if_overrun(outcome, job, attempt, scope, buffer)
    outcome.record["finished_at"] = utcnow()
    outcome.log, outcome.whole_log = buffer.getvalue(), True
    return outcome


def _fail_if_overrun(outcome: JobOutcome, job: Job, attempt: int, scope: AttemptScope,
                     buffer) -> None:
    """Past the deadline is a timeout whether or not the driver looked in time: the outcome
    must not depend on how busy the driver was. The measurements are dropped with it."""
    elapsed = scope.elapsed()
    if elapsed <= job.timeout_s or outcome.status == Status.SKIPPED:
        return
    late = JobTimeout("the attempt", elapsed, job.timeout_s)
    log.error("%s %s", job.id, late)  # to the worker's log (the job's handler is gone)
    buffer.write(f"{utcnow().isoformat()} ERROR {job.id} attempt={attempt} {late}\n")
    outcome.record = {k: outcome.record[k] for k in WHERE_COLUMNS if k in outcome.record}
    outcome.record.update(status=Status.FAILED, failure_class=FailureClass.TIMEOUT,
                          error_class="JobTimeout", error_message=str(late))
    outcome.rows = {}
