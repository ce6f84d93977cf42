"""What runs on a Dask worker: one attempt of a job, as a list of phases, into a ``JobOutcome``.

``run_job`` starts the attempt (see ``attempt``), then runs ``PHASES`` in order on one
``JobRun``, the state an attempt carries from phase to phase: load, quantize, coverage, layer
weights, score (with the layers' output errors), task accuracy, generation speed, artifacts. A
new measurement is one more phase function here (with its own section of the stopwatch) and one
more entry in ``PHASES``; the record is made from the ``JobRun`` at the end.

The worker process keeps each model's config and tokenizer between jobs, and maps the weights
from the checkpoint per job (see ``model_source``); the eval windows and the baseline's
log-probs arrive once per model as a Dask dependency (see ``reference``), so a sweep of many
configs pays the cold start once.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cloudpickle

from quantdask.errors import JobTimeout, UnsupportedHere
from quantdask.util import utcnow
from quantdask.worker import cpu_share
from quantdask.worker.artifacts import keep_artifact
from quantdask.worker.attempt import AttemptScope, attempt_scope, captured_log
from quantdask.worker.calibration import Calibration
from quantdask.worker.coverage import Coverage, coverage
from quantdask.worker.faults import inject_faults
from quantdask.worker.layers import OutputErrors, weight_errors
from quantdask.worker.measure import PeakMemory, Stopwatch
from quantdask.worker.metrics import SCORES, measure_quality
from quantdask.worker.model_source import cached_model_source
from quantdask.worker.outcome import (
    FailureClass,
    JobOutcome,
    Status,
    failure_class_of,
    peak_columns,
)
from quantdask.worker.runtime import held_resources, torch_device
from quantdask.worker.tasks import TASK_COLUMNS, truncated_total, with_baseline

if TYPE_CHECKING:
    import torch

    from quantdask.backends.base import Backend
    from quantdask.spec.sweep import Job
    from quantdask.worker.model_source import ModelSource
    from quantdask.worker.reference import Reference

log = logging.getLogger("quantdask.job")

PROBE_WINDOWS = 4
"""The first eval windows, per-layer output error is measured on (during the eval's passes)."""

WHERE_COLUMNS = ("worker", "host", "started_at", "device")
"""What a record keeps of an attempt whatever became of it."""


@dataclass
class JobRun:
    """One attempt's state, handed from phase to phase."""

    job: Job
    backend: Backend
    reference: Reference
    device: str  # torch's device, e.g. cuda:0
    cuda: bool
    device_label: str = ""  # what the records call it: cuda:<physical id> or cpu
    watch: Stopwatch = field(default_factory=Stopwatch)
    peak: PeakMemory | None = None
    holding: contextlib.ExitStack | None = None  # what the attempt holds until it is measured
    source: ModelSource | None = None
    source_cached: bool = False
    originals: dict[str, torch.Tensor] | None = None  # the unquantized weights, mapped
    model: torch.nn.Module | None = None  # the quantized model
    calibration: Calibration | None = None
    covered: Coverage | None = None
    size_bytes: int = 0
    layers: list[dict[str, Any]] = field(default_factory=list)
    unmeasured: dict[str, str] = field(default_factory=dict)  # layer -> why not measured
    scores: dict[str, Any] = field(default_factory=dict)
    windows: list[dict[str, Any]] = field(default_factory=list)  # per-window quality
    tasks: list[dict[str, Any]] = field(default_factory=list)  # the tasks frame's rows
    speed: list[dict[str, Any]] = field(default_factory=list)  # the speed frame's rows
    extra: dict[str, Any] = field(default_factory=dict)  # more record columns from phases

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
                self.model = self.originals = None


def load(run: JobRun) -> None:
    """The model's source (config, tokenizer; cached per worker) and its weights, mapped from
    the checkpoint for this job only."""
    with run.watch("load"):
        run.source, run.source_cached = cached_model_source(run.job.model)
        run.originals = run.holding.enter_context(run.source.weights())


def quantize(run: JobRun) -> None:
    """The backend's quantized model on the device (a calibrated backend's with its data)."""
    backend, job = run.backend, run.job
    with run.watch("quantize"):
        if not backend.calibrated:
            run.model = backend.quantize(run.source, job.options, run.device)
            return
        if run.reference.calibration is None:
            error = run.reference.calibration_error
            raise ValueError(
                f"{backend.name} calibrates on data and this job's reference carries none: "
                + (f"the calibration windows could not be cut ({error})" if error
                   else "give the sweep a calibration block"))
        run.calibration = Calibration(run.reference.calibration, run.cuda)
        run.model = backend.quantize(run.source, job.options, run.device,
                                     calibration=run.calibration)
        run.extra.update(run.calibration.figures())


def check_coverage(run: JobRun) -> None:
    """What the backend quantized, and the model's stored size, split into the quantized part
    and the rest; a quantizing backend that replaced no weight is unsupported here, never a
    clean result."""
    run.covered = coverage(run.model, run.originals, run.backend.stored_bytes)
    if run.backend.quantizes and not run.covered.quantized_params:
        raise UnsupportedHere(
            f"no layer was quantized: {run.backend.name} replaced none of this model's "
            f"weights, which stay in {run.covered.by_class()}")
    run.size_bytes = run.covered.size_bytes


def layer_weights(run: JobRun) -> None:
    """Each quantized layer's weight error; before any forward pass (kernels may repack
    weights then: see ``layers``)."""
    if run.job.layer_stats and run.backend.dequantize_layer is not None:
        run.layers, run.unmeasured = weight_errors(run.model, run.backend.dequantize_layer,
                                                   run.originals)
    for name, reason in run.unmeasured.items():
        log.warning("per-layer stats skip %s: %s", name, reason)


def score(run: JobRun) -> None:
    """Perplexity, KL and top-1 agreement against the reference on the eval windows, and the
    measured layers' output errors on the first ``PROBE_WINDOWS`` of them, taken by forward
    hooks during the same passes (``layers.OutputErrors``)."""
    if run.job.is_baseline:
        # The reference evaluated this very model on these windows: its scores are the
        # baseline's (the unquantized model is not evaluated twice; the time it took is the
        # reference task's, not this job's).
        run.scores = {k: run.reference.baseline[k] for k in SCORES}
        run.windows = list(run.reference.baseline_windows)
        run.watch.seconds["eval"] = 0.0
        return
    outputs = OutputErrors(run.model, run.layers, run.originals, PROBE_WINDOWS)
    with run.watch("eval"), outputs:
        meter = measure_quality(run.model, run.reference.windows, run.reference.distribution,
                                run.job.eval.batch_size, run.device, on_batch=outputs.batch)
    run.scores, run.windows, run.layers = meter.scores(), meter.window_rows(), outputs.rows()
    for name, reason in outputs.failed.items():
        log.warning("per-layer output error skips %s: %s", name, reason)


def score_tasks(run: JobRun) -> None:
    """The sweep's lm-eval tasks on the quantized model in memory, with the baseline's scores
    of its model beside each (the baseline job reuses those: its model is the one they were
    scored on, once per model with the reference)."""
    tasks = run.job.tasks
    if tasks is None:
        return
    baseline = run.reference.baseline
    if run.job.is_baseline:
        rows = run.reference.baseline_tasks
        run.extra.update({k: baseline[k] for k in TASK_COLUMNS})
    else:
        from quantdask.worker.tasks import evaluate_tasks

        with run.watch("tasks"), PeakMemory(run.cuda) as peak:
            rows = evaluate_tasks(run.model, run.source.tokenizer, tasks)
        run.extra.update(tasks_s=run.watch.seconds["tasks"],
                         tasks_peak_device_mem_bytes=peak.peak_device_bytes,
                         tasks_peak_host_rss_bytes=peak.peak_rss_bytes)
    run.tasks = with_baseline(rows, run.reference.baseline_tasks)
    run.extra["tasks_truncated_samples"] = truncated_total(run.tasks)


def time_generation(run: JobRun) -> None:
    """Greedy generation timed per batch size (``worker.speed``), on the model the quality
    phases measured; its own section of the stopwatch (``speed_s``), never part of the eval's.
    On a CPU slot, whose device is the machine's cores, the rows also say whether another
    slot's job computed meanwhile."""
    settings = run.job.speed
    if settings is None:
        return
    from quantdask.worker.speed import measure_speed

    whole = held_resources().get("GPU", 1.0) >= 1.0  # outside Dask: nothing else scheduled
    with run.watch("speed"):
        run.speed = measure_speed(run.model, run.reference.windows, settings, run.cuda,
                                  run.source.tokenizer.pad_token_id, run.device_label, whole,
                                  None if run.cuda else cpu_share.others_busy)
    run.extra["speed_s"] = run.watch.seconds["speed"]


def keep_artifacts(run: JobRun) -> None:
    """Save (and verify) the quantized model, when the sweep keeps artifacts."""
    artifacts = run.job.artifacts
    if artifacts is not None and artifacts.enabled:
        run.extra.update(keep_artifact(run.model, run.source.tokenizer, run.backend, run.job,
                                       run.reference, run.device))


Phase = Callable[[JobRun], None]
PHASES: tuple[Phase, ...] = (load, quantize, check_coverage, layer_weights, score,
                             score_tasks, time_generation, keep_artifacts)
"""What an attempt does, in order."""


def done_record(run: JobRun) -> dict[str, Any]:
    """The measured columns of a done attempt."""
    seconds, covered, source = run.watch.seconds, run.covered, run.source
    peaks = peak_columns(run.peak)
    if run.job.is_baseline:  # the reference's peak is this model's too
        peaks = {k: max(v, run.reference.baseline[k]) for k, v in peaks.items()}
    return {
        "status": Status.DONE, "wall_s": seconds["wall"], **peaks, "load_s": seconds["load"],
        "quantize_s": seconds["quantize"], "eval_s": seconds["eval"],
        "source_cached": run.source_cached, "param_count": source.param_count,
        "size_bytes": run.size_bytes, "bits_per_weight": 8.0 * run.size_bytes / source.param_count,
        "quantized_bytes": covered.quantized_bytes,
        "bits_per_quantized_weight": covered.bits_per_quantized_weight,
        "unquantized_bytes": covered.unquantized_bytes,
        "unquantized_dtypes": covered.unquantized_dtypes(),
        "quantized_params": covered.quantized_params, "quantized_share": covered.quantized_share,
        "full_precision": covered.summary() if run.backend.quantizes else None,
        "layers_unmeasured": len(run.unmeasured),
        "kl_tail_mass": run.reference.baseline["kl_tail_mass"],
        "kl_kind": run.reference.baseline["kl_kind"], **run.scores, **run.extra,
    }


def _log_done(record: dict[str, Any], layers: int) -> None:
    log.info("done in %.2fs: size %d bytes, %.2f bits/weight, %.1f%% of weights quantized, "
             "perplexity %.4f, KL %.3g, top-1 %.4f, %d layers measured", record["wall_s"],
             record["size_bytes"], record["bits_per_weight"], 100 * record["quantized_share"],
             record["perplexity"], record["kl_divergence"], record["top1_agreement"], layers)


def not_done_record(error: Exception, backend: str) -> dict[str, Any]:
    """A skipped record for what cannot run here (a retry would repeat it), else a failed one
    classified by ``failure_class_of``; logged either way."""
    if isinstance(error, (UnsupportedHere, NotImplementedError)):
        # NotImplementedError: the library has no kernel or op for this layer type or tensor
        # (torchao on Falcon's layers, say), a limit of this combination.
        record = {"status": Status.SKIPPED, "failure_class": FailureClass.UNSUPPORTED,
                  "error_class": type(error).__name__,
                  "error_message": str(error) or f"{type(error).__name__} in {backend}"}
        if isinstance(error, NotImplementedError):
            record["traceback"] = traceback.format_exc()
            log.warning("skipped (not implemented by the library): %s\n%s", error,
                        record["traceback"])
        else:
            log.warning("skipped: %s", error)
        return record
    record = {"status": Status.FAILED, "failure_class": failure_class_of(error),
              "error_class": type(error).__name__,
              "error_message": str(error) or type(error).__name__,
              "traceback": traceback.format_exc()}
    log.error("failed (%s): %s: %s\n%s", record["failure_class"], type(error).__name__, error,
              record["traceback"])
    return record


def start(job: Job, backend: Backend | bytes, attempt: int, reference: Reference | None,
          scope: AttemptScope, record: dict[str, Any]) -> JobRun:
    """The attempt's device and backend, its faults, and its model's reference."""
    import torch

    if isinstance(backend, bytes):
        backend = cloudpickle.loads(backend)
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
    with captured_log(log, f"{job.id} attempt={attempt}") as buffer, \
            attempt_scope(job.id) as scope:
        record = outcome.record = {"worker": scope.worker, "host": scope.host,
                                   "started_at": scope.started_at}
        try:
            run = start(job, backend, attempt, reference, scope, record)
            with run.measured():
                for phase in PHASES:
                    phase(run)
            record.update(done_record(run))
            outcome.layers, outcome.windows, outcome.tasks = run.layers, run.windows, run.tasks
            outcome.speed = run.speed
            _log_done(record, len(run.layers))
        except Exception as error:
            record.update(not_done_record(error, job.backend))
    outcome.device_samples = scope.samples
    _fail_if_overrun(outcome, job, attempt, scope, buffer)
    outcome.record["finished_at"] = utcnow()
    outcome.log = buffer.getvalue()
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
    outcome.layers, outcome.windows, outcome.tasks, outcome.speed = [], [], [], []
