"""What runs on a Dask worker: load -> quantize -> evaluate -> measure, as a ``JobOutcome``.

The worker process keeps each model's config and tokenizer between jobs, and maps the weights
from the checkpoint per job (see ``model_source``); the eval windows and the baseline's
log-probs arrive once per model as a Dask dependency (see ``reference``), so a sweep of many
configs pays the cold start once.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import cloudpickle

from quantdask.errors import JobTimeout, UnsupportedHere
from quantdask.util import utcnow
from quantdask.worker import cpu_share
from quantdask.worker.artifacts import keep_artifact
from quantdask.worker.calibration import Calibration
from quantdask.worker.coverage import coverage
from quantdask.worker.devices import this_workers_sampler
from quantdask.worker.layers import add_output_errors, weight_errors
from quantdask.worker.metrics import (
    SCORES,
    PeakMemory,
    Stopwatch,
    model_size_bytes,
    quality,
)
from quantdask.worker.model_source import cached_model_source
from quantdask.worker.outcome import JobOutcome
from quantdask.worker.runtime import (
    announce_start,
    held_resources,
    quiet_libraries,
    torch_device,
)

if TYPE_CHECKING:
    from quantdask.backends.base import Backend
    from quantdask.spec.sweep import Job
    from quantdask.worker.reference import Reference

log = logging.getLogger("quantdask.job")

PROBE_WINDOWS = 4
"""Eval windows in the probe batch that per-layer output error is measured on."""


SLOW_FAULT_S = 1.5
"""How much longer a ``slow`` fault makes an attempt (before it quantizes)."""


def inject_fault(kind: str, attempt: int) -> None:
    """Make this attempt fail the way ``kind`` says (see ``spec.FAULT_KINDS``); ``slow`` only
    delays it: a job that is surely still running a second after it began (to rehearse a
    worker lost mid-job or to watch one run), at no cost in CPU."""
    import torch

    log.warning("injecting fault %r on attempt %d", kind, attempt)
    if kind == "slow":
        time.sleep(SLOW_FAULT_S)
    if kind == "raise":
        raise RuntimeError(f"injected fault on attempt {attempt}")
    if kind == "oom":
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected on attempt {attempt})")
    if kind == "kill":
        # A crash in mid-job: the worker's start announcement has left before it dies (one
        # lost at once would make the job look never started, and it would be requeued).
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:  # only the scheduler's deadline (a worker restart) ends this
            time.sleep(60)


def failure_class_of(error: BaseException) -> str:
    """``timeout`` for a deadline, ``out_of_memory`` for an allocation failure on any device,
    else ``job_error``."""
    import torch

    if isinstance(error, JobTimeout):
        return "timeout"
    if isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)):
        return "out_of_memory"
    message = str(error).lower()
    allocation = ("out of memory", "can't allocate memory", "cannot allocate memory")
    return "out_of_memory" if any(m in message for m in allocation) else "job_error"


def _local_reference(job: Job) -> Reference:
    from quantdask.worker.reference import compute_reference

    return compute_reference(job.model, job.eval, job.eval.read_text(),
                             calibration=job.calibration)


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
    import torch

    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    # Jobs packed on one worker run in threads of one process: keep this job's lines only.
    this_thread = threading.get_ident()
    handler.addFilter(lambda line: line.thread == this_thread)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {job.id} attempt={attempt} %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    worker, host = announce_start()
    began = time.monotonic()  # the deadline counts from here, as the driver's does
    record: dict[str, Any] = {"worker": worker, "host": host, "started_at": utcnow()}
    outcome = JobOutcome(record)
    sampler = this_workers_sampler()
    if sampler is not None:  # mark the job's samples, and take one even if the job is short
        sampler.job_started(job.id)
    try:
        quiet_libraries()
        if isinstance(backend, bytes):
            backend = cloudpickle.loads(backend)
        device, device_label, cuda = torch_device()
        record["device"] = device_label
        # What this attempt really runs with (a retry after out-of-memory asks for more).
        held = ", ".join(f"{name}={amount:,.0f}" if amount >= 1000 else f"{name}={amount:g}"
                         for name, amount in held_resources().items())
        log.info("start on worker %s (%s) device %s: %s %s; eval batch %d; holding %s",
                 worker, host, device_label, job.backend, job.config_label,
                 job.eval.batch_size, held or "no resources")
        for fault_attempt, kind in job.faults:
            if fault_attempt == attempt:
                inject_fault(kind, attempt)
        reference = reference or _local_reference(job)
        torch.manual_seed(job.seed)
        watch = Stopwatch()
        with watch("wall"), PeakMemory(cuda) as peak, contextlib.ExitStack() as holding:
            holding.enter_context(cpu_share.busy())  # borrows idle slots' cores (CPU slots)
            with watch("load"):
                source, cached = cached_model_source(job.model)
                # The unquantized weights, mapped from the checkpoint for this job only.
                originals = holding.enter_context(source.weights())
            calibration = None
            with watch("quantize"):
                if backend.calibrated:
                    if reference.calibration is None:
                        raise ValueError(
                            f"{backend.name} calibrates on data and this job's reference "
                            "carries none: " + (f"the calibration windows could not be cut "
                                                f"({reference.calibration_error})"
                                                if reference.calibration_error else
                                                "give the sweep a calibration block"))
                    calibration = Calibration(reference.calibration, cuda)
                    model = backend.quantize(source, job.options, device,
                                             calibration=calibration)
                else:
                    model = backend.quantize(source, job.options, device)
            covered = coverage(model, originals)
            if backend.quantizes and not covered.quantized_params:
                raise UnsupportedHere(
                    f"no layer was quantized: {backend.name} replaced none of this model's "
                    f"weights, which stay in {covered.by_class()}")
            size = model_size_bytes(model, backend.stored_bytes)
            layers, unmeasured = [], {}
            # Before any forward pass (see layers).
            if job.layer_stats and backend.dequantize_layer is not None:
                layers, unmeasured = weight_errors(model, backend.dequantize_layer, originals)
            for name, reason in unmeasured.items():
                log.warning("per-layer stats skip %s: %s", name, reason)
            if job.is_baseline:
                # The reference evaluated this very model on these windows: its scores and
                # peak are the baseline's (the unquantized model is not evaluated twice; the
                # time it took is the reference task's, not this job's).
                scores = {k: reference.baseline[k] for k in SCORES}
                watch.seconds["eval"] = 0.0
            else:
                with watch("eval"):
                    scores = quality(model, reference.windows, reference.distribution,
                                     job.eval.batch_size, device)
            if layers:
                outcome.layers = add_output_errors(model, layers, originals,
                                                     reference.windows[:PROBE_WINDOWS], device)
            if job.artifacts is not None and job.artifacts.enabled:
                record.update(keep_artifact(model, source.tokenizer, backend, job, reference,
                                            device))
            del model, originals
        peaks = {"peak_device_mem_bytes": peak.peak_device_bytes,
                 "peak_device_reserved_bytes": peak.peak_reserved_bytes,
                 "peak_host_rss_bytes": peak.peak_rss_bytes, "peak_shared": peak.shared}
        if job.is_baseline:
            peaks = {k: max(v, reference.baseline[k]) for k, v in peaks.items()}
        record.update(
            status="done", wall_s=watch.seconds["wall"], **peaks, load_s=watch.seconds["load"],
            quantize_s=watch.seconds["quantize"], eval_s=watch.seconds["eval"],
            source_cached=cached, param_count=source.param_count,
            size_bytes=size, bits_per_weight=8.0 * size / source.param_count,
            quantized_params=covered.quantized_params, quantized_share=covered.quantized_share,
            full_precision=covered.summary() if backend.quantizes else None,
            layers_unmeasured=len(unmeasured), kl_tail_mass=reference.baseline["kl_tail_mass"],
            **scores, **(calibration.figures() if calibration is not None else {}),
        )
        log.info("done in %.2fs: size %d bytes, %.2f bits/weight, %.1f%% of weights quantized, "
                 "perplexity %.4f, KL %.3g, top-1 %.4f, %d layers measured", record["wall_s"],
                 size, record["bits_per_weight"], 100 * covered.quantized_share,
                 scores["perplexity"], scores["kl_divergence"], scores["top1_agreement"],
                 len(outcome.layers))
    except (UnsupportedHere, NotImplementedError) as err:
        # NotImplementedError: the library has no kernel or op for this layer type or tensor
        # (torchao on Falcon's layers, say), a limit of this combination that a retry repeats.
        record.update(status="skipped", failure_class="unsupported",
                      error_class=type(err).__name__,
                      error_message=str(err) or f"{type(err).__name__} in {job.backend}")
        if isinstance(err, NotImplementedError):
            record["traceback"] = traceback.format_exc()
            log.warning("skipped (not implemented by the library): %s\n%s", err,
                        record["traceback"])
        else:
            log.warning("skipped: %s", err)
    except Exception as err:
        record.update(status="failed", failure_class=failure_class_of(err),
                      error_class=type(err).__name__,
                      error_message=str(err) or type(err).__name__,
                      traceback=traceback.format_exc())
        log.error("failed (%s): %s: %s\n%s", record["failure_class"], type(err).__name__, err,
                  record["traceback"])
    finally:
        log.removeHandler(handler)
        if torch.cuda.is_available():
            with contextlib.suppress(Exception):  # a sticky CUDA error must not lose the record
                torch.cuda.empty_cache()
        if sampler is not None:
            outcome.device_samples = sampler.job_finished(job.id)
    elapsed = time.monotonic() - began
    if elapsed > job.timeout_s and record["status"] != "skipped":
        # Past the deadline is a timeout whether or not the driver looked in time: the outcome
        # must not depend on how busy the driver was. The measurements are dropped with it.
        late = JobTimeout("the attempt", elapsed, job.timeout_s)
        log.error("%s %s", job.id, late)  # to the worker's log (the job's handler is gone)
        buffer.write(f"{utcnow().isoformat()} ERROR {job.id} attempt={attempt} {late}\n")
        record = {k: record[k] for k in ("worker", "host", "started_at", "device") if k in record}
        record.update(status="failed", failure_class="timeout", error_class="JobTimeout",
                      error_message=str(late))
        outcome.record, outcome.layers = record, []
    record["finished_at"] = utcnow()
    outcome.log = buffer.getvalue()
    return outcome
