"""Work every job of a model shares, done once per model: the eval windows and the unquantized
model's next-token log-probabilities, which KL divergence and top-1 agreement compare against.

:func:`compute_reference_shard` computes it in parts and :func:`combine_reference` joins them
(:func:`compute_reference` does both in one process). The driver's
:class:`~quantdask.plan.references.ModelReferences` submits it once per model and hands its
future to each of that model's jobs, so Dask moves the result to each worker once and nothing is
recomputed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dask.sizeof import sizeof

from quantdask.errors import JobTimeout
from quantdask.measure.metrics import (
    QualityMeter,
    eval_windows,
    exact_sum,
    reference_slice,
    tail_offsets,
    text_ids,
)
from quantdask.measure.usage import PeakMemory
from quantdask.process import cpu_share
from quantdask.process.attempt import attempt_scope
from quantdask.process.model_source import cached_model_source
from quantdask.process.runtime import worker_task
from quantdask.records import Peaks, Quality, TaskItemRow, TaskRow, WindowRow
from quantdask.words import KLKind, WorkerTaskKind

if TYPE_CHECKING:
    import torch

    from quantdask.sweepfile.model import ModelSpec
    from quantdask.sweepfile.settings import CalibrationSettings, EvalSettings
    from quantdask.sweepfile.tasks import TaskSettings

log = logging.getLogger("quantdask.reference")

TAIL_WARNING = 0.05
"""Warn when the reference's top k leave more than this share of the probability mass out."""
REFERENCE_TOPIC = "quantdask-reference"
"""Dask event topic: one event each time a worker computes a reference (to count them)."""
BASELINE_TASKS_TOPIC = "quantdask-baseline-tasks"
"""Dask event topic: one event each time a worker scores a baseline's tasks."""


@dataclass
class Reference:
    """Eval windows (samples x seq_len token ids) and the unquantized model's next-token
    distribution at each position but the last, in the compact form :func:`reference_slice`
    makes: ``log_probs`` (samples x seq_len-1 x k, float32) of the tokens ``ids`` (int32),
    ``rest``, the log of the mass outside them, and ``tail_ids`` / ``tail_log_probs``, tokens
    sampled from that rest; with ``eval.kl_top_k: all`` (or a vocabulary small enough), every
    token's log-prob and no ``ids``. ``target_log_probs`` (float64): each position's log-prob
    of the token that follows it. ``baseline``: the unquantized model's own scores on the
    windows, and ``kl_kind``, what the jobs' KL against this reference is.
    ``calibration``: the sweep's calibration windows (samples x seq_len token ids) when it has
    a calibration block, cut once per model here for its calibrated jobs. ``baseline_tasks``:
    the unquantized model's task rows (:mod:`quantdask.measure.tasks`) when the sweep has a
    tasks block, scored once per model beside the log-probs."""

    key: str
    windows: torch.Tensor
    log_probs: torch.Tensor
    ids: torch.Tensor | None = None
    rest: torch.Tensor | None = None
    tail_ids: torch.Tensor | None = None
    tail_log_probs: torch.Tensor | None = None
    target_log_probs: torch.Tensor | None = None
    baseline: Quality | None = None
    kl_kind: KLKind = KLKind.EXACT
    kl_tail_mass: float = 0.0
    baseline_peaks: Peaks | None = None  # the largest any shard of it needed
    baseline_windows: list[WindowRow] = field(default_factory=list)  # the windows frame's rows
    calibration: torch.Tensor | None = None
    calibration_error: str | None = None  # why the calibration windows could not be cut
    tasks: BaselineTasks | None = None  # the baseline's task rows and what scoring them took
    dtype: str = ""  # what its log-probs were computed in: float32, or the model's own dtype

    @property
    def baseline_tasks(self) -> list[TaskRow]:
        """The baseline's rows of the tasks frame (none without a tasks block)."""
        return self.tasks.rows if self.tasks is not None else []

    @property
    def distribution(self) -> dict[str, torch.Tensor]:
        """The tensors :class:`~quantdask.measure.metrics.QualityMeter` compares against."""
        return {name: t for name, t in (
            ("log_probs", self.log_probs), ("ids", self.ids), ("rest", self.rest),
            ("tail_ids", self.tail_ids), ("tail_log_probs", self.tail_log_probs),
            ("target_log_probs", self.target_log_probs)) if t is not None}

    @property
    def nbytes(self) -> int:
        tensors = (self.windows, *self.distribution.values(), self.calibration)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@sizeof.register(Reference)
def _reference_size(reference: Reference) -> int:
    # Dask weighs data to decide what to keep and spill; a reference can be gigabytes.
    return reference.nbytes


def reference_key(model: ModelSpec, settings: EvalSettings,
                  calibration: CalibrationSettings | None = None,
                  tasks: TaskSettings | None = None) -> str:
    """A Dask key naming the reference of ``model`` on ``settings``' windows (with
    ``calibration``'s windows and ``tasks``' baseline scores, when given)."""
    parts = {"model": model.identity(), "eval": settings.identity()}
    if calibration is not None:
        parts["calibration"] = calibration.identity()
    if tasks is not None:
        parts["tasks"] = tasks.identity()
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
    peaks: Peaks
    dtype: str = ""  # the model's, as it computed these log-probs


@sizeof.register(ReferenceShard)
def _shard_size(shard: ReferenceShard) -> int:
    return sum(t.numel() * t.element_size() for t in (shard.windows, *shard.compact.values()))


def compute_reference(model: ModelSpec, settings: EvalSettings, text: str,
                      timeout_s: float = float("inf"),
                      calibration: CalibrationSettings | None = None,
                      tasks: TaskSettings | None = None) -> Reference:
    """The whole reference of ``model`` on ``settings``' windows, computed here in one go (the
    driver splits it over workers: :func:`compute_reference_shard`, :func:`combine_reference`).

    Raises :class:`JobTimeout` when that took longer than ``timeout_s``."""
    shard = compute_reference_shard(model, settings, text, (0, settings.samples), timeout_s)
    scored = compute_baseline_tasks(model, tasks, timeout_s) if tasks is not None else None
    return combine_reference(model, settings, shard, calibration=calibration,
                             calibration_text=calibration.read_text() if calibration else None,
                             tasks=tasks, baseline_tasks=scored)


@dataclass
class BaselineTasks:
    """The unquantized model's task rows, with the time and peak memory scoring them took;
    ``error`` says why there are none when scoring them failed (``"RuntimeError: ..."``)."""

    rows: list[TaskRow]
    seconds: float
    peak_device_mem_bytes: int
    peak_host_rss_bytes: int
    error: str | None = None
    items: list[TaskItemRow] = field(default_factory=list)  # each question's scores


def compute_baseline_tasks(model: ModelSpec, tasks: TaskSettings,
                           timeout_s: float = float("inf")) -> BaselineTasks:
    """Score the unquantized model on ``tasks``, once per model: a part of its reference that
    runs beside the log-probs (the driver's ``ModelReferences``), every job of the model
    comparing its own scores with these.

    A failure to score them (an exception, or more than ``timeout_s``) is the baseline's
    alone: it comes back as ``error``, with no rows, and the reference, the baseline's quality
    figures and the quantized jobs' own task scores stand (their recovery is then null, with
    the reason)."""
    from quantdask.process.runtime import torch_device

    rows: list[TaskRow] = []
    items: list[TaskItemRow] = []
    error = None
    with attempt_scope(f"tasks-{model.label}", take_samples=False,
                       task=(WorkerTaskKind.BASELINE_TASKS, model.label)) as scope, \
            cpu_share.busy():
        source, _ = cached_model_source(model)
        device, _, cuda = torch_device()
        with PeakMemory(cuda) as peak:
            try:
                rows, items = _score_unquantized(source, device, tasks)
            except Exception as failure:  # noqa: BLE001 - the baseline's task rows fail alone
                error = f"{type(failure).__name__}: {failure}"
                log.exception("%s: the baseline's task scoring failed; the quantized jobs "
                              "keep their own scores, without recovery", model.label)
    _announce(model.label, BASELINE_TASKS_TOPIC)
    elapsed = scope.elapsed()
    if error is None and elapsed > timeout_s:
        late = JobTimeout("its model's baseline task scores", elapsed, timeout_s)
        rows, items = [], []
        error = f"{type(late).__name__}: {late}"
        log.error("%s: %s", model.label, error)
    return BaselineTasks(rows, elapsed, peak.peak_device_bytes, peak.peak_rss_bytes, error,
                         items)


def _score_unquantized(source, device, tasks: TaskSettings
                       ) -> tuple[list[TaskRow], list[TaskItemRow]]:
    """The tasks and task items frames' rows of the unquantized model (built here, let go on
    return)."""
    from quantdask.measure.tasks import evaluate_tasks

    fp_model = source.build(device)
    return evaluate_tasks(fp_model, source.tokenizer, tasks)


def compute_reference_shard(model: ModelSpec, settings: EvalSettings, text: str,
                            rows: tuple[int, int], timeout_s: float = float("inf"),
                            streamed: bool = False) -> ReferenceShard:
    """Tokenize ``text`` into the eval windows and run the unquantized model over windows
    ``rows`` (start, stop); ``streamed``: its layers one at a time (``stream.streaming``),
    the same figures to the bit.

    Raises :class:`JobTimeout` when that took longer than ``timeout_s`` (the jobs waiting on it
    then fail as ``timeout``, as they do when the driver cuts a hung one)."""
    # Its device samples stay on the worker: the next job's record (or the sweep's end)
    # takes them.
    with attempt_scope(reference_key(model, settings), take_samples=False,
                       task=(WorkerTaskKind.REFERENCE, model.label)) as scope, \
            cpu_share.busy():  # borrows idle slots' cores (CPU slots)
        shard = _compute_shard(model, settings, text, rows, streamed)
    elapsed = scope.elapsed()
    if elapsed > timeout_s:
        raise JobTimeout("its model's reference (eval windows and baseline log-probs)", elapsed,
                         timeout_s)
    return shard


def reference_model(model: ModelSpec, settings: EvalSettings) -> ModelSpec:
    """The model as its reference computes it: in float32 where ``settings`` resolved it so
    for a 16-bit model (``eval.reference_dtype``), else as its jobs load it."""
    return dataclasses.replace(model, dtype="float32") if settings.reference_float32 else model


def _compute_shard(model: ModelSpec, settings: EvalSettings, text: str,
                   rows: tuple[int, int], streamed: bool = False) -> ReferenceShard:
    from quantdask.process.runtime import torch_device

    source, _ = cached_model_source(reference_model(model, settings), weights=not streamed)
    windows = eval_windows(text_ids(source.tokenizer, text, settings.bos_token_id),
                           settings.seq_len, settings.samples,
                           settings.bos_token_id)[rows[0]:rows[1]].clone()  # not the whole
    device, _, cuda = torch_device()
    meter = QualityMeter(windows, None)
    compact: dict[str, torch.Tensor] = {}
    tail: list[float] = []
    offsets = tail_offsets(range(*rows), windows.size(1) - 1)  # seeded by the global row
    with PeakMemory(cuda) as peak:
        for piece in _log_probs(source, windows, settings.batch_size, device, streamed):
            meter.add(piece.rows, piece.positions, piece.log_probs)
            for name, part in reference_slice(piece.log_probs, settings.top_k,
                                              settings.tail_samples,
                                              offsets[piece.rows, piece.positions]).items():
                if name not in compact:  # sized by the first slice: k, or the whole vocabulary
                    compact[name] = part.new_empty((windows.size(0), windows.size(1) - 1,
                                                    *part.shape[2:]))
                compact[name][piece.rows, piece.positions] = part
                if name == "rest":
                    tail.append(exact_sum(part.double().exp()))
    return ReferenceShard(rows, windows, compact, meter, tail, Peaks.of(peak),
                          str(source.dtype).removeprefix("torch."))


def _log_probs(source, windows: torch.Tensor, batch_size: int, device: str, streamed: bool):
    """The unquantized model's log-probs on ``windows``, resident or streamed (the model is
    let go when they have all been read)."""
    from quantdask.measure.logits import sliced_log_probs, streamed_log_probs

    if streamed:
        yield from streamed_log_probs(source, windows, batch_size, device)
    else:
        yield from sliced_log_probs(source.build(device), windows, batch_size, device)


def combine_reference(model: ModelSpec, settings: EvalSettings, *shards: ReferenceShard,
                      calibration: CalibrationSettings | None = None,
                      calibration_text: str | None = None, tasks: TaskSettings | None = None,
                      baseline_tasks: BaselineTasks | None = None) -> Reference:
    """The reference from its shards (in any order; together they cover every window once),
    with the baseline's figures: the unquantized model's scores over all of them, and the
    largest peak any shard needed; with ``calibration``, the calibration windows cut from
    ``calibration_text`` with the model's tokenizer; with ``tasks``, the baseline's task scores
    ``baseline_tasks`` (:func:`compute_baseline_tasks`). A task of the run's time account."""
    with worker_task(WorkerTaskKind.REFERENCE, model.label):
        return _combined(model, settings, shards, calibration, calibration_text, tasks,
                         baseline_tasks)


def _combined(model: ModelSpec, settings: EvalSettings, shards: tuple[ReferenceShard, ...],
              calibration: CalibrationSettings | None, calibration_text: str | None,
              tasks: TaskSettings | None, baseline_tasks: BaselineTasks | None) -> Reference:
    import torch

    from quantdask.measure.calibration import calibration_windows

    shards = tuple(sorted(shards, key=lambda shard: shard.rows))
    covered = [row for shard in shards for row in range(*shard.rows)]
    if covered != list(range(settings.samples)):
        raise ValueError(f"reference shards cover windows {[s.rows for s in shards]}, not "
                         f"0..{settings.samples}")
    windows = torch.cat([shard.windows for shard in shards])
    meter = QualityMeter.joined(windows, [shard.meter for shard in shards])
    compact = {name: torch.cat([shard.compact[name] for shard in shards])
               for name in shards[0].compact}
    key = reference_key(model, settings, calibration, tasks)
    calibration_ids, calibration_error = None, None
    if calibration is not None:
        # Only the tokenizer (not the model source: this small task has no resources), and a
        # bad calibration text fails the calibrated jobs alone, not the model's reference.
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                model.location, trust_remote_code=model.trust_remote_code,
                revision=model.revision)
            if calibration_text is None:
                raise ValueError("no calibration text was read")
            calibration_ids = calibration_windows(
                text_ids(tokenizer, calibration_text, settings.bos_token_id),
                calibration.seq_len, calibration.samples, calibration.seed,
                settings.bos_token_id)
        except Exception as error:  # noqa: BLE001 - recorded for the calibrated jobs
            calibration_error = f"{type(error).__name__}: {error}"
            log.error("%s: calibration windows not cut: %s", model.label, calibration_error)
    _announce(key)
    tail_mass = math.fsum(t for shard in shards for t in shard.tail) / meter.nll.numel()
    kind = (KLKind.EXACT if "ids" not in compact or tail_mass == 0
            else KLKind.ESTIMATE if settings.tail_samples else KLKind.LOWER_BOUND)
    if kind == KLKind.LOWER_BOUND and tail_mass > TAIL_WARNING:
        log.warning("%s: the top %s tokens hold only %.1f%% of the unquantized model's "
                    "probability mass on average: KL is a loose lower bound here (its "
                    "predictions are flat); eval.kl_tail_samples > 0 estimates the rest",
                    model.label, settings.kl_top_k, 100 * (1 - tail_mass))
    # The baseline job's figures: the unquantized model, evaluated here.
    peaks = functools.reduce(Peaks.max, (shard.peaks for shard in shards))
    return Reference(key=key, windows=windows, baseline=meter.scores(), kl_kind=kind,
                     kl_tail_mass=tail_mass, baseline_peaks=peaks, calibration=calibration_ids,
                     calibration_error=calibration_error, target_log_probs=-meter.nll,
                     baseline_windows=meter.window_rows(), tasks=baseline_tasks,
                     dtype=shards[0].dtype, **compact)


def _announce(key: str, topic: str = REFERENCE_TOPIC) -> None:
    try:
        from distributed import get_worker

        get_worker().log_event(topic, {"key": key})
    except ValueError:  # computed outside a Dask worker
        pass
