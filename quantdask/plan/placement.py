"""Where a job may run: its estimated device memory against what each worker advertises.

Each worker advertises its device's memory as the Dask resource ``DEVICE_MEMORY`` in bytes
(``quantdask.preload``, or ``--resources GPU=1,DEVICE_MEMORY=<bytes>``). Each job asks for its
estimate of that resource besides its share of a GPU, so Dask's scheduler starts it only on a
worker with that much memory free: a large job lands only on a large GPU, small ones spread, and
several share a GPU when the sweep's ``jobs_per_gpu`` and their estimates allow. A job's
estimate is the largest of its phases' figures (``phase_memory``: quantize, score, tasks, speed)
until it has a measured peak of its own. A job that fits on no worker is refused before anything
runs, with the numbers and the phase that sets its peak.

>>> placement = place_jobs(expand_grid(sweep), client, "runs/demo")  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Set
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any

import polars as pl
from distributed import Client

from quantdask.backends import BASELINE, get_backend
from quantdask.backends.base import ModelFacts
from quantdask.errors import PlacementError, SpecError
from quantdask.plan.phase_memory import (
    QUANTIZE,
    SCORE,
    UPPER_BOUNDS,
    peak_note,
    phase_bytes,
    streamed_bytes,
)
from quantdask.plan.run_history import done_phases, done_results, stored_options
from quantdask.process.slot_memory import METRIC, SlotMemory, check_offers
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.sweep import DEVICE_MEMORY, Job
from quantdask.util import format_bytes

log = logging.getLogger("quantdask.placement")

SAFETY = 1.2
"""Headroom on every estimate: an allocator's fragmentation, buffers the estimate leaves out."""


@dataclass(frozen=True)
class MemoryEstimate:
    """A job's device memory in bytes (None: nothing to go on) and what it rests on;
    ``measured`` is the job's own measured peak when it ran before. ``peak_phase`` is the
    phase that sets it (``phase_memory``'s names, or the phases frame's for a measured peak;
    None: unknown), ``peak_note`` says why in words, and ``firm`` is the figure without the
    phases whose figure is only an upper bound (the task phase's): what must fit somewhere."""

    bytes: int | None
    basis: str
    measured: int | None = None
    peak_phase: str | None = None
    peak_note: str = ""
    firm: int | None = None


def _measured_peak_phase(job_id: str, phases: pl.DataFrame) -> str | None:
    """The phase of ``job_id`` with the largest measured peak in the phases frame."""
    if not phases.height or "phase" not in phases.columns:
        return None
    rows = (phases.filter(pl.col("job_id") == job_id)
            .drop_nulls("peak_device_mem_bytes").sort("peak_device_mem_bytes"))
    return rows["phase"][-1] if rows.height else None


def _ran_phases(job_id: str, phases: pl.DataFrame) -> set[str]:
    """The phases ``job_id`` ran (empty: not in the phases frame, from before it existed)."""
    if not phases.height or "phase" not in phases.columns:
        return set()
    return set(phases.filter(pl.col("job_id") == job_id)["phase"].to_list())


def _peak_ratios(job: Job, rows: list[dict], facts: ModelFacts, phases: pl.DataFrame,
                 host: bool, resting: int) -> list[float]:
    """Measured peak / config figure of each of ``rows`` (this model's other done jobs), each
    figure over the phases that job ran (a job that ran no speed phase is not compared with
    a figure for one)."""
    ratios = []
    for row in rows:
        options = stored_options(row)
        theirs = ({} if options is None
                  else phase_bytes(row["backend"], options, job, facts, host))
        ran = _ran_phases(row["job_id"], phases)
        figure = max((b for phase, b in theirs.items() if not ran or phase in ran), default=0)
        if figure:
            ratios.append(_own(row["peak_device_mem_bytes"], resting) / figure)
    return ratios


def _own(peak: int, resting: int) -> int:
    """What a job's measured peak added to its worker: on a CPU slot the peak is the worker's
    RSS, its ``resting`` memory included (what the slot's offer leaves out; elsewhere 0)."""
    return max(1, peak - resting)


def _from_figures(job: Job, facts: ModelFacts, figures: dict[str, int], scale: float,
                  basis: str) -> MemoryEstimate:
    """The estimate of a job whose phases' figures are ``figures``, each times ``scale``."""
    phase = max(figures, key=lambda name: figures[name])  # the first of equals
    firm = max(b for name, b in figures.items() if name not in UPPER_BOUNDS)
    return MemoryEstimate(int(figures[phase] * scale), basis, peak_phase=phase,
                          peak_note=peak_note(phase, job, facts), firm=int(firm * scale))


def estimate_device_memory(job: Job, facts: ModelFacts, done: pl.DataFrame,
                           phases: pl.DataFrame | None = None, host: bool = False,
                           resting: int = 0) -> MemoryEstimate:
    """``job``'s device memory: its own measured peak if it ran before (in ``done``, earlier
    done results); else the largest of its phases' figures by config (``phase_memory``)
    scaled by how the measured peaks of this model's other jobs compare with their figures
    (over the phases each ran, from ``phases``, the phases frame); else that figure alone.
    ``SAFETY`` on top. On CPU slots (``host``) every figure is what the job adds to its
    worker's RSS, and a measured peak counts less the slots' ``resting`` memory."""
    phases = pl.DataFrame() if phases is None else phases
    # A peak measured while packed jobs ran beside it is theirs too: not this job's figure.
    shared = (pl.col("peak_shared").fill_null(False) if "peak_shared" in done.columns
              else pl.lit(False))
    # A streamed job's peak is one layer's, no measure of a resident one.
    if "streamed" in done.columns:
        shared = shared | pl.col("streamed").fill_null(False)
    rows = (done.filter((pl.col("model") == job.model.label)
                        & pl.col("peak_device_mem_bytes").is_not_null() & ~shared).to_dicts()
            if done.height else [])
    own = [_own(r["peak_device_mem_bytes"], resting) for r in rows if r["job_id"] == job.id]
    if own:
        phase = _measured_peak_phase(job.id, phases)
        return MemoryEstimate(int(max(own) * SAFETY), "its measured peak", measured=max(own),
                              peak_phase=phase, peak_note=phase or "")
    figures = phase_bytes(job.backend, job.options, job, facts, host)
    ratios = _peak_ratios(job, rows, facts, phases, host, resting)
    if figures and ratios:
        return _from_figures(job, facts, figures, median(ratios) * SAFETY,
                             f"config, scaled by {len(ratios)} measured peaks of this model")
    if figures:
        return _from_figures(job, facts, figures, SAFETY, "checkpoint size and config")
    if rows:
        return MemoryEstimate(int(median(_own(r["peak_device_mem_bytes"], resting)
                                         for r in rows) * SAFETY),
                              f"{len(rows)} measured peaks of this model")
    return MemoryEstimate(None, "nothing known")


def _job_takers(client: Client) -> dict[str, dict]:
    """The workers now that take jobs (those with a ``GPU`` resource): address -> resources,
    with the worker's name under ``"name"`` and, for a CPU slot with a memory limit, its
    :class:`SlotMemory` under ``"slot"``."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return {address: {**w.get("resources", {}), "name": str(w["name"]),
                      "slot": SlotMemory.from_metric(w.get("metrics", {}).get(METRIC))}
            for address, w in workers.items() if w.get("resources", {}).get("GPU", 0) > 0}


def slot_memories(client: Client) -> dict[str, SlotMemory]:
    """Each job-taking CPU slot with a memory limit: its name -> what it reported of its
    memory (its limit, the nanny's terminate fraction, its resting memory, its offer)."""
    return {w["name"]: w["slot"] for w in _job_takers(client).values() if w["slot"] is not None}


def advertised_memory(client: Client) -> dict[str, float | None]:
    """Each job-taking worker's name -> the ``DEVICE_MEMORY`` it advertises (None: none)."""
    return {w["name"]: w.get(DEVICE_MEMORY) for w in _job_takers(client).values()}


def most_room(client: Client) -> float:
    """The most ``DEVICE_MEMORY`` a job-taking worker advertises now (0: none)."""
    return max((memory or 0 for memory in advertised_memory(client).values()), default=0)


def workers_with_room(client: Client, need: float) -> dict[str, str]:
    """The job-taking workers now (address -> name) that advertise at least ``need`` bytes of
    device memory (all of them when ``need`` is 0)."""
    return {address: w["name"] for address, w in _job_takers(client).items()
            if not need or w.get(DEVICE_MEMORY, 0) >= need}


@dataclass
class Placement:
    """A sweep's jobs with their device-memory requests, and what the cluster offers."""

    jobs: list[Job]
    largest: float = 0.0  # the most DEVICE_MEMORY a worker advertises (0: placement is off)
    reference_bytes: dict[str, int] = field(default_factory=dict)  # model label -> bytes
    # The CPU slots' memory as they reported it, by worker name (none: GPUs, or no limit);
    # with them, estimates count what a job adds to its worker's RSS.
    slots: dict[str, SlotMemory] = field(default_factory=dict)

    def slot(self, name: str | None, client: Client) -> SlotMemory | None:
        """What the CPU slot called ``name`` reported of its memory (at placement, or now:
        a slot that joined since)."""
        if name is not None and name not in self.slots:
            self.slots.update(slot_memories(client))
        return self.slots.get(name) if name is not None else None

    def note_slot(self, name: str, metric: Any) -> None:
        """Keep what the slot called ``name`` reported as it began a task (its job-start
        event): once it is killed for memory, the scheduler no longer knows it."""
        slot = SlotMemory.from_metric(metric)
        if slot is not None:
            self.slots[name] = slot

    def room(self, client: Client) -> float:
        """The most a worker offers now; a larger worker that joined since raises what jobs
        may ask for (``capped``)."""
        room = most_room(client)
        if self.largest:  # (0: placement by memory is off, and stays off)
            self.largest = max(self.largest, room)
        return room

    def capped(self, job: Job) -> Job:
        """``job`` asking for no more than the largest worker has (an out-of-memory retry
        doubles its request)."""
        if self.largest and job.device_memory_bytes > self.largest:
            return replace(job, device_memory_bytes=int(self.largest))
        return job

    def reference_resources(self, job: Job) -> dict[str, float]:
        """What ``job``'s model reference asks for: it runs the unquantized model, as the
        baseline job does, and at least as much as ``job`` (whose out-of-memory retries ask
        for more)."""
        resources = {"GPU": job.gpu_share}
        need = max(self.reference_bytes.get(job.model.label, 0), job.device_memory_bytes)
        if need:
            resources[DEVICE_MEMORY] = float(min(need, self.largest) if self.largest else need)
        return resources


def _largest_worker(client: Client) -> tuple[str, float] | None:
    """The job-taking worker that advertises the most device memory, and how much; None
    (placement by memory off, said in the log) when none advertises any."""
    advertised = advertised_memory(client)
    known = {name: memory for name, memory in advertised.items() if memory}
    if not known:
        log.warning("placement by device memory is off for this sweep: %s",
                    f"no worker advertises {DEVICE_MEMORY} (start workers with --preload "
                    "quantdask.preload)" if advertised else "no worker has joined yet")
        return None
    if len(known) < len(advertised):
        log.warning("workers %s advertise no %s: jobs that need an estimate will not go there "
                    "(start them with --preload quantdask.preload)",
                    ", ".join(sorted(set(advertised) - set(known))), DEVICE_MEMORY)
    return max(known.items(), key=lambda item: item[1])


def place_jobs(jobs: list[Job], client: Client, run_dir: str | os.PathLike | None = None,
               finished: Set[str] = frozenset(), stream: str = "auto") -> Placement:
    """``jobs`` with device-memory requests for the workers of ``client`` (see the module
    docstring). With ``stream`` "auto", a model some job of which fits no worker resident
    streams its layers (every job of it: ``streaming_models``). Raises
    :class:`PlacementError` naming every job that fits nowhere (the ``finished`` ones, which
    will not run, excepted). Placement by memory is off (jobs ask for a GPU share only) while
    no worker advertises ``DEVICE_MEMORY``."""
    from quantdask.plan.model_facts import model_facts

    slots = check_offers(slot_memories(client))
    found = _largest_worker(client)
    if found is None:
        return Placement(list(jobs))
    largest_worker, largest = found
    # CPU slots: each figure is what a job adds to its worker's RSS (the slot's offer leaves
    # its resting memory out; a measured peak includes it).
    host = largest_worker in slots
    resting = slots[largest_worker].resting if host else 0
    done, phases = done_results(run_dir), done_phases(run_dir)
    facts: dict[str, ModelFacts] = {}
    for job in jobs:
        if job.model.label not in facts:
            facts[job.model.label] = model_facts(job, layers=False)
    estimates = {job.id: estimate_device_memory(job, facts[job.model.label], done, phases,
                                                host, resting) for job in jobs}
    if stream == "auto":
        streaming = streaming_models(jobs, estimates, facts, largest, finished, host)
        # A backend that cannot quantize one layer at a time stays resident (and is refused
        # below when it does not fit).
        jobs = [replace(job, streamed=True) if job.model.label in streaming
                and get_backend(job.backend).stream_refusal(facts[job.model.label].model_type)
                is None else job for job in jobs]
    placed, too_big, reference_bytes = [], [], {}
    for job in jobs:
        estimate = estimates[job.id]
        if job.streamed:
            estimate = streamed_estimate(job, facts[job.model.label], host)
        need = estimate.bytes
        if need is None:
            placed.append(job)
            continue
        # An upper bound alone (the task phase's) refuses nothing: that job asks for a whole
        # device at most, and an out-of-memory retry halves its batch.
        firm = _firm(estimate, largest)
        if firm > largest and job.id not in finished:
            note = estimate.peak_note
            if stream == "auto" and not job.streamed:
                note += _streaming_note(job, facts[job.model.label], host)
            too_big.append((job.id, f"{job.model.label} {job.config_label}", firm,
                            estimate.basis, note))
        placed.append(replace(job, device_memory_bytes=min(need, int(largest))))
        if job.backend == BASELINE:  # the model's reference runs the unquantized model
            reference_bytes[job.model.label] = reference_need(
                job, need, facts[job.model.label], largest, host, resting)
    if too_big:
        slot = slots.get(largest_worker)
        raise PlacementError(too_big, largest, largest_worker,
                             slot.describe() if slot is not None else "")
    return Placement(placed, largest, reference_bytes, slots)


def reference_need(baseline: Job, need: int, facts: ModelFacts, largest: float, host: bool,
                   resting: int) -> int:
    """What the reference of ``baseline``'s model asks for: what the baseline job does
    (``need``), or a 16-bit model's float32 reference's estimate where
    ``eval.reference_dtype`` resolved so, which is refused (a ``SpecError`` naming that field)
    when it fits no worker."""
    if not baseline.eval.reference_float32 or baseline.streamed:
        return min(need, int(largest))
    need = max(need, estimate_device_memory(baseline, replace(facts, loaded_bits=32),
                                            pl.DataFrame(), host=host, resting=resting).bytes
               or 0)
    if largest and need > largest:
        raise SpecError("eval.reference_dtype", f"{baseline.model.label}'s float32 reference needs "
                        f"~{format_bytes(need)}, more than the largest worker's "
                        f"{format_bytes(int(largest))}: give eval.reference_dtype: model, "
                        "or stream")
    return need


@functools.cache
def unstreamable_model(model: ModelSpec) -> str | None:
    """Why a model's checkpoint cannot be streamed (``checkpoint_reader.unstreamable``: no
    safetensors files, tensors converted as they load), or None; once per model and
    driver process."""
    from quantdask.measure.checkpoint_reader import unstreamable

    if model.hub:
        return ("a hub model streams from a local directory only: download it "
                "(huggingface-cli download) and give its path")
    return unstreamable(model)


def streamed_estimate(job: Job, facts: ModelFacts, host: bool = False) -> MemoryEstimate:
    """A streamed job's estimate (``phase_memory.streamed_bytes``, ``SAFETY`` on top)."""
    need = int(streamed_bytes(job, facts, host) * SAFETY) or None
    return MemoryEstimate(need, "streamed: one layer, the hidden states, the head",
                          peak_phase="stream", peak_note="stream: one decoder layer at a time",
                          firm=need)


def _streaming_note(job: Job, facts: ModelFacts, host: bool) -> str:
    """What streaming would need for a job that fits no worker resident, or why it cannot."""
    refusal = (get_backend(job.backend).stream_refusal(facts.model_type)
               or unstreamable_model(job.model))
    if refusal:
        return f"; it cannot stream one layer at a time: {refusal}"
    need = streamed_estimate(job, facts, host).bytes
    return f"; streamed one layer at a time it would need ~{format_bytes(need)}" if need else ""


def _firm(estimate: MemoryEstimate, largest: float) -> int:
    """What must fit a worker of ``estimate``: not an upper bound alone (the task phase's: that
    job asks for a whole device at most, and an out-of-memory retry halves its batch), and
    no more than the largest worker when the job ran within it before (the headroom gives
    way)."""
    firm = estimate.firm if estimate.firm is not None else estimate.bytes or 0
    if firm > largest and estimate.measured is not None and estimate.measured <= largest:
        return int(largest)
    return firm


def _weights_and_score(job: Job, facts: ModelFacts, host: bool) -> float:
    """A job's resident estimate for its weights and its eval alone (streaming helps with
    those, not with a speed batch's cache or a task batch); unknown: infinite."""
    figures = phase_bytes(job.backend, job.options, job, facts, host)
    core = [figures[phase] for phase in (QUANTIZE, SCORE) if phase in figures]
    return max(core) * SAFETY if core else float("inf")


def streaming_models(jobs: list[Job], estimates: dict[str, MemoryEstimate],
                     facts: dict[str, ModelFacts], largest: float,
                     finished: Set[str] = frozenset(), host: bool = False) -> set[str]:
    """The models to stream: those with a job still to run that fits no worker resident,
    when their checkpoint can stream and every job of the model fits one streamed (the
    reference and every job of such a model stream, one layer at a time; a model that fits
    neither way is refused resident, with what streaming would need or why it cannot)."""
    tight = {job.model.label for job in jobs if job.id not in finished
             and _firm(estimates[job.id], largest) > largest
             and _weights_and_score(job, facts[job.model.label], host) > largest}
    models = {job.model.label: job.model for job in jobs}
    return {model for model in tight if unstreamable_model(models[model]) is None
            and all(0 < (streamed_estimate(job, facts[model], host).bytes or 0) <= largest
                   for job in jobs if job.model.label == model and job.id not in finished)}
