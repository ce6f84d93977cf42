"""Work every job of a model shares, done once per model: the eval windows and the unquantized
model's next-token log-probabilities, which KL divergence and top-1 agreement compare against.

On workers, :func:`compute_reference_shard` computes it in parts and
:func:`combine_reference` joins them (:func:`compute_reference` does both in one process). On
the driver, :class:`ModelReferences` submits it once per model and hands its future to each of
that model's jobs, so Dask moves the result to each worker once and nothing is recomputed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dask.sizeof import sizeof

from quantdask.errors import JobTimeout
from quantdask.spec.sweep import DEVICE_MEMORY
from quantdask.worker import cpu_share
from quantdask.worker.metrics import (
    PeakMemory,
    QualityMeter,
    eval_windows,
    exact_sum,
    reference_slice,
)
from quantdask.worker.model_source import cached_model_source

if TYPE_CHECKING:
    import torch
    from distributed import Client, Future

    from quantdask.spec.sweep import CalibrationSettings, EvalSettings, Job, ModelSpec

log = logging.getLogger("quantdask.reference")

TAIL_WARNING = 0.05
"""Warn when the reference's top k leave more than this share of the probability mass out."""
REFERENCE_TOPIC = "quantdask-reference"
"""Dask event topic: one event each time a worker computes a reference (to count them)."""


@dataclass
class Reference:
    """Eval windows (samples x seq_len token ids) and the unquantized model's next-token
    distribution at each position but the last, in the compact form :func:`reference_slice`
    makes: ``log_probs`` (samples x seq_len-1 x k, float32) of the tokens ``ids`` (int32), and
    ``rest``, the log of the mass outside them; with ``eval.kl_top_k: all``, every token's
    log-prob and no ``ids``. ``baseline``: the unquantized model's own scores on the windows.
    ``calibration``: the sweep's calibration windows (samples x seq_len token ids) when it has
    a calibration block, cut once per model here for its calibrated jobs."""

    key: str
    windows: torch.Tensor
    log_probs: torch.Tensor
    ids: torch.Tensor | None = None
    rest: torch.Tensor | None = None
    baseline: dict = field(default_factory=dict)
    calibration: torch.Tensor | None = None
    calibration_error: str | None = None  # why the calibration windows could not be cut

    @property
    def distribution(self) -> dict[str, torch.Tensor]:
        """The tensors :class:`~quantdask.worker.metrics.QualityMeter` compares against."""
        return {name: t for name, t in (("log_probs", self.log_probs), ("ids", self.ids),
                                        ("rest", self.rest)) if t is not None}

    @property
    def nbytes(self) -> int:
        tensors = (self.windows, *self.distribution.values(), self.calibration)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@sizeof.register(Reference)
def _reference_size(reference: Reference) -> int:
    # Dask weighs data to decide what to keep and spill; a reference can be gigabytes.
    return reference.nbytes


def reference_key(model: ModelSpec, settings: EvalSettings,
                  calibration: CalibrationSettings | None = None) -> str:
    """A Dask key naming the reference of ``model`` on ``settings``' windows (with
    ``calibration``'s windows, when given)."""
    parts = {"model": model.identity(), "eval": settings.identity()}
    if calibration is not None:
        parts["calibration"] = calibration.identity()
    identity = json.dumps(parts, sort_keys=True)
    return f"reference-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def shard_rows(samples: int, batch_size: int, slots: int) -> list[tuple[int, int]]:
    """How a reference of ``samples`` windows splits over ``slots`` workers: contiguous ranges
    of windows (start, stop), at most one per slot, each a whole number of batches (only the
    last may end in the eval's own short batch). Every part then runs exactly the batches one
    pass over all the windows runs, so the reference is the same bits however many workers the
    cluster had when it was split."""
    batch = max(1, batch_size)
    batches = max(1, -(-samples // batch))
    parts = max(1, min(slots, batches))
    bounds = [min(samples, round(i * batches / parts) * batch) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


@dataclass
class ReferenceShard:
    """One worker's part of a reference: the windows ``rows`` (start, stop) of the eval, their
    compact log-probs (as in :class:`Reference`), and what the baseline's scores and peaks are
    summed or maxed from."""

    rows: tuple[int, int]
    windows: torch.Tensor
    compact: dict[str, torch.Tensor]
    meter: QualityMeter
    tail: list[float]  # the mass outside the top k, summed over each slice's positions
    peaks: dict[str, int]


@sizeof.register(ReferenceShard)
def _shard_size(shard: ReferenceShard) -> int:
    return sum(t.numel() * t.element_size() for t in (shard.windows, *shard.compact.values()))


def compute_reference(model: ModelSpec, settings: EvalSettings, text: str,
                      timeout_s: float = float("inf"),
                      calibration: CalibrationSettings | None = None) -> Reference:
    """The whole reference of ``model`` on ``settings``' windows, computed here in one go (the
    driver splits it over workers: :func:`compute_reference_shard`, :func:`combine_reference`).

    Raises :class:`JobTimeout` when that took longer than ``timeout_s``."""
    shard = compute_reference_shard(model, settings, text, (0, settings.samples), timeout_s)
    return combine_reference(model, settings, shard, calibration=calibration,
                             calibration_text=calibration and calibration.read_text())


def compute_reference_shard(model: ModelSpec, settings: EvalSettings, text: str,
                            rows: tuple[int, int],
                            timeout_s: float = float("inf")) -> ReferenceShard:
    """Tokenize ``text`` into the eval windows and run the unquantized model over windows
    ``rows`` (start, stop).

    Raises :class:`JobTimeout` when that took longer than ``timeout_s`` (the jobs waiting on it
    then fail as ``timeout``, as they do when the driver cuts a hung one)."""
    from quantdask.worker.devices import this_workers_sampler
    from quantdask.worker.job import announce_start, quiet_libraries

    announce_start()  # its deadline starts now
    began = time.monotonic()
    quiet_libraries()
    sampler = this_workers_sampler()
    if sampler is not None:  # the device's samples meanwhile belong to the reference
        sampler.job_started(reference_key(model, settings))
    try:
        with cpu_share.busy():  # borrows idle slots' cores (CPU slots)
            shard = _compute_shard(model, settings, text, rows)
    finally:
        if sampler is not None:
            # Its samples stay on the worker: the next job's record (or the sweep's end) takes them.
            sampler.job_finished(reference_key(model, settings), take=False)
    elapsed = time.monotonic() - began
    if elapsed > timeout_s:
        raise JobTimeout("its model's reference (eval windows and baseline log-probs)", elapsed,
                         timeout_s)
    return shard


def _compute_shard(model: ModelSpec, settings: EvalSettings, text: str,
                   rows: tuple[int, int]) -> ReferenceShard:
    from quantdask.worker.job import torch_device
    from quantdask.worker.logits import sliced_log_probs

    source, _ = cached_model_source(model)
    windows = eval_windows(source.tokenizer(text)["input_ids"], settings.seq_len,
                           settings.samples)[rows[0]:rows[1]].clone()  # not the whole storage
    device, _, cuda = torch_device()
    meter = QualityMeter(windows, None)
    compact: dict[str, torch.Tensor] = {}
    tail: list[float] = []
    with PeakMemory(cuda) as peak:
        fp_model = source.build(device)
        for piece in sliced_log_probs(fp_model, windows, settings.batch_size, device):
            meter.add(piece.rows, piece.positions, piece.log_probs)
            for name, part in reference_slice(piece.log_probs, settings.top_k).items():
                if name not in compact:  # sized by the first slice: k, or the whole vocabulary
                    compact[name] = part.new_empty((windows.size(0), windows.size(1) - 1,
                                                    *part.shape[2:]))
                compact[name][piece.rows, piece.positions] = part
                if name == "rest":
                    tail.append(exact_sum(part.double().exp()))
        del fp_model
    peaks = {"peak_device_mem_bytes": peak.peak_device_bytes,
             "peak_device_reserved_bytes": peak.peak_reserved_bytes,
             "peak_host_rss_bytes": peak.peak_rss_bytes, "peak_shared": peak.shared}
    return ReferenceShard(rows, windows, compact, meter, tail, peaks)


def combine_reference(model: ModelSpec, settings: EvalSettings, *shards: ReferenceShard,
                      calibration: CalibrationSettings | None = None,
                      calibration_text: str | None = None) -> Reference:
    """The reference from its shards (in any order; together they cover every window once),
    with the baseline's figures: the unquantized model's scores over all of them, and the
    largest peak any shard needed; and, with ``calibration``, the calibration windows cut from
    ``calibration_text`` with the model's tokenizer."""
    import torch

    from quantdask.worker.calibration import calibration_windows

    shards = tuple(sorted(shards, key=lambda shard: shard.rows))
    covered = [row for shard in shards for row in range(*shard.rows)]
    if covered != list(range(settings.samples)):
        raise ValueError(f"reference shards cover windows {[s.rows for s in shards]}, not "
                         f"0..{settings.samples}")
    windows = torch.cat([shard.windows for shard in shards])
    meter = QualityMeter(windows, None)
    for shard in shards:
        meter.merge(shard.meter)
    compact = {name: torch.cat([shard.compact[name] for shard in shards])
               for name in shards[0].compact}
    key = reference_key(model, settings, calibration)
    calibration_ids, calibration_error = None, None
    if calibration is not None:
        # Only the tokenizer (not the model source: this small task has no resources), and a
        # bad calibration text fails the calibrated jobs alone, not the model's reference.
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                model.location, trust_remote_code=model.trust_remote_code,
                revision=model.revision)
            calibration_ids = calibration_windows(
                tokenizer(calibration_text)["input_ids"], calibration.seq_len,
                calibration.samples, calibration.seed)
        except Exception as error:  # noqa: BLE001 - recorded for the calibrated jobs
            calibration_error = f"{type(error).__name__}: {error}"
            log.error("%s: calibration windows not cut: %s", model.label, calibration_error)
    _announce(key)
    tail_mass = math.fsum(t for shard in shards for t in shard.tail) / meter.tokens
    if tail_mass > TAIL_WARNING:
        log.warning("%s: the top %s tokens hold only %.1f%% of the unquantized model's "
                    "probability mass on average: KL is a loose lower bound here (its "
                    "predictions are flat); eval.kl_top_k: all gives the exact figure",
                    model.label, settings.kl_top_k, 100 * (1 - tail_mass))
    # The baseline job's figures: the unquantized model, evaluated here.
    baseline = {**meter.scores(), "kl_tail_mass": tail_mass,
                **{name: max(shard.peaks[name] for shard in shards)
                   for name in shards[0].peaks}}
    return Reference(key=key, windows=windows, baseline=baseline, calibration=calibration_ids,
                     calibration_error=calibration_error, **compact)


def _announce(key: str) -> None:
    try:
        from distributed import get_worker

        get_worker().log_event(REFERENCE_TOPIC, {"key": key})
    except ValueError:  # computed outside a Dask worker
        pass


@dataclass
class ModelReferences:
    """The driver's side of one sweep's references: one future per model (submitted again
    only after a failure, so a retry never inherits a failed dependency), the attempts waiting
    for one (``parked``), and a deadline on each part like a job's.

    A reference is computed in parts (:func:`shard_rows`, one per slot ``slots()`` counts) that
    one small task combines: every worker computes from the start instead of one computing
    while the others wait. ``resources_for(job)`` is what each part of the reference of
    ``job``'s model asks Dask for; ``clock`` reads the time its deadlines are measured on (a
    fake one in tests).
    """

    client: Client
    run_id: str
    resources_for: Callable[[Job], dict[str, float]]
    clock: Callable[[], float] = time.monotonic
    slots: Callable[[], int] = lambda: 1
    futures: dict[str, Future] = field(default_factory=dict)  # reference_key -> current future
    # Attempts waiting for their model's reference: Dask key -> [(job, attempt, avoid, future)].
    parked: dict[str, list[tuple[Job, int, str | None, Future]]] = field(default_factory=dict)
    _parts: dict[str, list[Future]] = field(default_factory=dict)  # Dask key -> its parts
    _whole: dict[str, str] = field(default_factory=dict)  # a part's Dask key -> the reference's
    _deadlines: dict[str, float] = field(default_factory=dict)  # part's Dask key -> timeout_s
    _starts: dict[str, tuple[float, str]] = field(default_factory=dict)  # key -> (t, address)
    _cut: set[str] = field(default_factory=set)
    _requests: dict[str, float] = field(default_factory=dict)  # part -> DEVICE_MEMORY asked
    _texts: dict[str, str] = field(default_factory=dict)  # text_sha256 -> eval/calibration text
    _submitted: int = 0

    def future_for(self, job: Job) -> Future:
        """The future of ``job``'s model reference, submitted now if there is none (or the last
        one failed)."""
        key = reference_key(job.model, job.eval, job.calibration)
        self._settle()
        future = self.futures.get(key)
        if future is None or future.status in ("error", "cancelled"):
            self._submitted += 1
            # The Dask key is this driver's own: a key is an identity across clients, and a
            # cancellation of another sweep's reference must never reach this one.
            dask_key = f"{key}-{self.run_id}-{self._submitted}"
            resources = self.resources_for(job)
            parts = []
            for start, stop in shard_rows(job.eval.samples, job.eval.batch_size, self.slots()):
                part_key = f"{dask_key}-windows-{start}-{stop}"
                self._deadlines[part_key] = job.timeout_s  # before its start is announced
                self._requests[part_key] = resources.get(DEVICE_MEMORY, 0)
                self._whole[part_key] = dask_key
                parts.append(self.client.submit(
                    compute_reference_shard, job.model, job.eval, self._text(job.eval),
                    (start, stop), job.timeout_s, key=part_key, resources=resources,
                    priority=job.priority + 10, pure=False, retries=0))
            self._parts[dask_key] = parts
            calibration = job.calibration
            future = self.client.submit(
                combine_reference, job.model, job.eval, *parts, calibration=calibration,
                calibration_text=calibration and self._text(calibration), key=dask_key,
                priority=job.priority + 10, pure=False, retries=0)
            self.futures[key] = future
        return future

    def _text(self, source) -> str:
        """The text of an eval or calibration source, read once per sweep."""
        if source.text_sha256 not in self._texts:
            self._texts[source.text_sha256] = source.read_text()
        return self._texts[source.text_sha256]

    def all_futures(self) -> list[Future]:
        """Every current reference and its parts (to cancel them all)."""
        return [*self.futures.values(),
                *(part for f in self.futures.values() for part in self._parts.get(f.key, []))]

    def release(self) -> None:
        """Let go of every future: Dask forgets them once no client holds them."""
        self.futures.clear()
        self._parts.clear()

    def failed(self, job: Job, dask_key: str) -> bool:
        """Whether ``dask_key`` is the current reference of ``job``'s model and it failed."""
        future = self.futures.get(reference_key(job.model, job.eval, job.calibration))
        return future is not None and future.key == dask_key and future.status == "error"

    def park(self, job: Job, attempt: int, avoid: str | None, future: Future) -> None:
        self.parked.setdefault(future.key, []).append((job, attempt, avoid, future))

    def unpark_done(self, spread_to: Callable[[list[Job]], list[str]]
                    ) -> list[tuple[Job, int, str | None, Future]]:
        """The parked attempts whose reference is done, highest priority first, after copying
        a finished reference to the workers ``spread_to(jobs)`` names.

        Dask starts a task where its dependencies are: submitted while the reference is on one
        worker, a model's jobs would all be queued there and spread only by work stealing.
        With the reference copied to every worker that can take them, Dask places each job by
        the workers' load and room. (A failed reference goes to the jobs as it is: each records
        the error.)
        """
        ready = []
        for key, entries in list(self.parked.items()):
            future = entries[0][3]
            if not future.done():
                continue
            del self.parked[key]
            if future.status == "finished":
                try:
                    self.client.replicate([future],
                                          workers=spread_to([e[0] for e in entries]) or None)
                except Exception as error:  # noqa: BLE001 - a worker left meanwhile: the jobs
                    log.info("reference %s not copied to every worker (%s)", key, error)
            ready += sorted(entries, key=lambda e: -e[0].priority)
        return ready

    def take_parked(self) -> list[tuple[Job, int, str | None, Future]]:
        """Every parked attempt, no longer parked."""
        taken = [entry for entries in self.parked.values() for entry in entries]
        self.parked = {}
        return taken

    def started(self, dask_key: str, address: str) -> bool:
        """Note that a worker began the part ``dask_key``; False if it is no part of a
        reference of this sweep."""
        if dask_key not in self._deadlines:
            return False
        self._starts[dask_key] = (self.clock(), address)
        return True

    def overdue(self) -> list[tuple[str, str]]:
        """Cut every reference with a part running past its deadline: (Dask key of the part,
        worker address) of each of its running parts, for the caller to restart those workers
        (a cancelled task keeps its thread and device until it returns; a hung one never does).
        A hung reference would hold every job of its model; its jobs then fail (an attempt
        each) and their retries get a new reference."""
        self._settle()
        now, cut = self.clock(), []
        live = {part.key: part for part in self.all_futures()}
        for key in [k for k in self._starts if k not in live or live[k].done()]:
            del self._starts[key]
        late = {self._whole[key]: key for key, (started, _) in self._starts.items()
                if now - started > self._deadlines[key]}
        for whole, key in late.items():
            log.warning("reference %s: no result after %gs; restarting the workers of its "
                        "running parts", key, self._deadlines[key])
            for part in [k for k in self._starts if self._whole[k] == whole]:
                cut.append((part, self._starts.pop(part)[1]))
                self._cut.add(part)
            self._cut.add(whole)
            self._cancel(whole)
        return cut

    def _settle(self) -> None:
        """Let go of the parts of every reference that is done: a finished one holds what they
        computed (so their results need not stay on the workers), and a failed one's
        unfinished parts would only keep workers busy."""
        for whole in self.futures.values():
            if whole.done():
                for part in self._parts.pop(whole.key, []):
                    if not part.done():
                        part.cancel()

    def was_cut(self, dask_key: str) -> bool:
        return dask_key in self._cut

    def unfit(self, room: float) -> dict[str, float]:
        """The parts of references waiting to start that ask for more device memory than
        ``room``: Dask key -> bytes asked."""
        return {part.key: self._requests[part.key] for part in self.all_futures()
                if part.key in self._requests and not part.done()
                and part.key not in self._starts and self._requests[part.key] > room}

    def abandon(self, dask_key: str) -> list[tuple[Job, int, str | None, Future]]:
        """Cancel the reference that ``dask_key`` (a part of it) belongs to; return the
        attempts that were parked on it."""
        whole = self._whole.get(dask_key, dask_key)
        self._cancel(whole)
        return self.parked.pop(whole, [])

    def _cancel(self, whole: str) -> None:
        for part in self._parts.get(whole, []):
            part.cancel()
        for future in self.futures.values():
            if future.key == whole:
                future.cancel()
