"""What runs on a Dask worker: one attempt of a job, as the list of phases (``job.phases``),
into a ``JobOutcome``.

``run_job`` starts the attempt (see ``attempt``) with its ``JobContext``, then runs ``PHASES``
in order (a streamed job ``streamed_job.STREAMED_PHASES``): each takes the stage the one
before it made (``Made``) and returns the next, with its record; each has its own time and
peaks (the phases frame). ``run_phases`` keeps the records and the phases frame's rows, and
lets the last stage (the model, the mapped weights) go before the attempt's measured span
ends; the results row is assembled at the end from the records.

The worker process keeps each model's config and tokenizer between jobs, and maps the weights
from the checkpoint per job (see ``model_source``); the eval windows and the baseline's
log-probs arrive once per model as a Dask dependency (see ``reference``), so a sweep of many
configs pays the cold start once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle

from quantdask.errors import JobTimeout, UnsupportedHere
from quantdask.job.faults import inject_faults
from quantdask.job.outcome import JobOutcome, failure_class_of
from quantdask.job.phases import JobContext, Made, phases_for
from quantdask.measure.usage import PeakMemory
from quantdask.process.attempt import AttemptScope, attempt_scope, captured_log
from quantdask.process.live_log import live_sender
from quantdask.process.runtime import held_resources, torch_device
from quantdask.randomness import job_random
from quantdask.records import (
    Ended,
    NotDone,
    Peaks,
    PhaseRecord,
    PhaseRow,
    ResultRow,
    Span,
    Where,
)
from quantdask.util import utcnow
from quantdask.words import FailureClass, Status

if TYPE_CHECKING:

    from quantdask.backends.base import Backend
    from quantdask.measure.reference import Reference
    from quantdask.sweepfile.sweep import Job


log = logging.getLogger("quantdask.job")

def run_phases(run: JobContext) -> tuple[list[PhaseRecord], list[PhaseRow]]:
    """Each phase in order, handed the stage the one before made, with its own time and peaks
    (a row of the phases frame): the records they returned, and those rows. The stages (the
    model, the mapped weights) go as this returns or raises, inside ``run.measured()``."""
    made, rows = Made(), list[PhaseRow]()
    try:
        for position, phase in enumerate(phases_for(run)):
            began = time.perf_counter()
            with PeakMemory(run.cuda) as peak:
                made, produced = phase(run, made)
            if produced is None:
                continue
            made = dataclasses.replace(made, records=(*made.records, produced))
            rows.append(PhaseRow(
                position=position, phase=phase.__name__, seconds=time.perf_counter() - began,
                peak_device_mem_bytes=peak.peak_device_bytes,
                peak_host_rss_bytes=peak.peak_rss_bytes, peak_shared=peak.shared))
        return list(made.records), rows
    except BaseException as error:
        # The traceback keeps this frame and each phase's below it, and their locals keep a
        # stage, until the outcome is written (or longer, where a caller keeps the error): the
        # model would outlive the span. The locals go now; the lines stay for the log.
        del made
        traceback.clear_frames(error.__traceback__)
        raise


def done_records(run: JobContext, records: Sequence[PhaseRecord],
                 phase_rows: list[PhaseRow]) -> list[PhaseRecord]:
    """A done attempt's records: its span (with ``phase_rows``, the phases frame's, from
    ``run_phases``), then its phases' ``records``."""
    peaks = Peaks.of(run.peak)
    for row in phase_rows:  # the span's peak is at least each phase's, read apart from it
        device = row.peak_device_mem_bytes or 0
        peaks = peaks.max(Peaks(device, device, row.peak_host_rss_bytes or 0, row.peak_shared))
    if run.job.is_baseline and not run.job.eval.reference_float32 \
            and run.reference.baseline_peaks is not None:
        # The reference's peak is this model's (its float32 one is not: then the baseline
        # measured itself).
        peaks = peaks.max(run.reference.baseline_peaks)
    return [Span(run.watch.seconds["wall"], peaks, phases=phase_rows), *records]


def _log_done(record: ResultRow, layers: int) -> None:
    log.info("done in %.2fs: size %d bytes, %.2f bits/weight, %.1f%% of weights quantized, "
             "perplexity %.4f, KL %.3g, top-1 %.4f, %d layers measured", record["wall_s"],
             record["size_bytes"], record["bits_per_weight"], 100 * record["quantized_share"],
             record["perplexity"], record["kl_divergence"], record["top1_agreement"], layers)


def not_done_record(error: Exception, backend: str) -> tuple[Status, NotDone]:
    """Skipped, for what cannot run here (a retry would repeat it), else failed and classified
    by ``failure_class_of``; with why, logged either way."""
    if isinstance(error, (UnsupportedHere, NotImplementedError)):
        # NotImplementedError: the library has no kernel or op for this layer type or tensor
        # (torchao on Falcon's layers, say), a limit of this combination.
        skipped = NotDone(FailureClass.UNSUPPORTED, type(error).__name__,
                          str(error) or f"{type(error).__name__} in {backend}")
        if isinstance(error, NotImplementedError):
            tb = traceback.format_exc()
            log.warning("skipped (not implemented by the library): %s\n%s", error, tb)
            return Status.SKIPPED, dataclasses.replace(skipped, traceback=tb)
        log.warning("skipped: %s", error)
        return Status.SKIPPED, skipped
    failed = NotDone(failure_class_of(error), type(error).__name__,
                     str(error) or type(error).__name__, traceback.format_exc())
    log.error("failed (%s): %s: %s\n%s", failed.failure_class, type(error).__name__, error,
              failed.traceback)
    return Status.FAILED, failed


def start(job: Job, pickled: Backend | bytes, attempt: int, reference: Reference | None,
          scope: AttemptScope, device: tuple[str, str, bool], prepared: Any = None
          ) -> JobContext:
    """The attempt's backend on its ``device`` (torch's, the records' label, CUDA or not), its
    faults, and its model's reference."""
    import torch

    backend: Backend = cloudpickle.loads(pickled) if isinstance(pickled, bytes) else pickled
    on, device_label, cuda = device
    # What this attempt really runs with (a retry after out-of-memory asks for more).
    held = ", ".join(f"{name}={amount:,.0f}" if amount >= 1000 else f"{name}={amount:g}"
                     for name, amount in held_resources().items())
    log.info("start on worker %s (%s) device %s: %s %s; eval batch %d; holding %s",
             scope.worker, scope.host, device_label, job.backend, job.config_label,
             job.eval.batch_size, held or "no resources")
    inject_faults(job, attempt)
    if reference is None:
        from quantdask.measure.reference import compute_reference

        reference = compute_reference(job.model, job.eval, job.eval.read_text(),
                                      calibration=job.calibration, tasks=job.tasks)
    if held_resources().get("GPU", 1.0) >= 1.0:
        # Alone on this worker (nothing packed beside it): a backend that draws from torch's
        # global generator is reproducible too. Packed jobs draw from their own generators
        # only (``quantdask.randomness``), and leave the global one alone.
        torch.manual_seed(job.seed)
    return JobContext(job, backend, reference, on, cuda, device_label=device_label,
                      prepared=prepared)


def run_job(job: Job, backend: Backend | bytes, attempt: int = 1,
            reference: Reference | None = None, prepared: Any = None) -> JobOutcome:
    """Run one job here and return its outcome: metrics when done, the reason when not.

    ``backend`` may come pickled (bytes), so that one this worker cannot load (a notebook's,
    from a module it lacks) fails as this job, not as the worker. ``reference`` is the model's
    shared eval windows and baseline log-probs (computed here when not given); ``prepared``
    what its backend made once for it (``OwnRuntime.prepare``). Never raises for
    a job's own failure: the class, message and traceback come back in ``outcome.record``
    (``status`` failed or skipped), beside the job's log, its per-layer rows and the worker's
    device samples during it.
    """
    records: list[PhaseRecord] = []
    status = Status.DONE
    with captured_log(log, f"{job.id} attempt={attempt}", live=live_sender()) as buffer, \
            attempt_scope(job.id) as scope, job_random(job.seed):
        where = Where(scope.worker, scope.host, scope.started_at)
        try:
            device = torch_device()
            where = dataclasses.replace(where, device=device[1])
            run = start(job, backend, attempt, reference, scope, device, prepared)
            with run.measured():
                produced, phase_rows = run_phases(run)
            records = done_records(run, produced, phase_rows)
            done = JobOutcome(tuple(records))
            _log_done(done.record, len(done.rows["layers"]))
        except Exception as error:
            status, not_done = not_done_record(error, job.backend)
            records = [not_done]
    late = _overrun(job, attempt, scope, buffer, status)
    if late is not None:  # the measurements are dropped with it
        status, records = Status.FAILED, [late]
    return JobOutcome((where, *records, Ended(status, utcnow())), scope.samples,
                      buffer.getvalue(), whole_log=True)


def _overrun(job: Job, attempt: int, scope: AttemptScope, buffer,
             status: Status) -> NotDone | None:
    """Past the deadline is a timeout whether or not the driver looked in time: the outcome
    must not depend on how busy the driver was (a skipped job stays skipped)."""
    elapsed = scope.elapsed()
    if elapsed <= job.timeout_s or status == Status.SKIPPED:
        return None
    late = JobTimeout("the attempt", elapsed, job.timeout_s)
    log.error("%s %s", job.id, late)  # to the worker's log (the job's handler is gone)
    buffer.write(f"{utcnow().isoformat()} ERROR {job.id} attempt={attempt} {late}\n")
    return NotDone(FailureClass.TIMEOUT, "JobTimeout", str(late))
