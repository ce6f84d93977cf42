"""Where a job may run: its estimated device memory against what each worker advertises.

Each worker advertises its device's memory as the Dask resource ``DEVICE_MEMORY`` in bytes
(``quantdask.preload``, or ``--resources GPU=1,DEVICE_MEMORY=<bytes>``). Each job asks for its
estimate of that resource besides its share of a GPU, so Dask's scheduler starts it only on a
worker with that much memory free: a large job lands only on a large GPU, small ones spread, and
several share a GPU when the sweep's ``jobs_per_gpu`` and their estimates allow. A job that fits
on no worker is refused before anything runs, with the numbers.

>>> placement = place_jobs(expand_grid(sweep), client, "runs/demo")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Set
from dataclasses import dataclass, field, replace
from statistics import median

import polars as pl
from distributed import Client

from quantdask.backends import BASELINE, BackendOptions, get_backend
from quantdask.backends.base import ModelFacts
from quantdask.errors import PlacementError, SpecError
from quantdask.spec.settings import EvalSettings
from quantdask.spec.sweep import DEVICE_MEMORY, Job
from quantdask.words import Status
from quantdask.worker.logits import SLICE_BUDGET_BYTES

log = logging.getLogger("quantdask.placement")

SAFETY = 1.2
"""Headroom on every estimate: an allocator's fragmentation, buffers the estimate leaves out."""
LOGIT_COPIES = 3
"""The eval's float32 logits, their log-softmax, and one temporary, alive at once."""


@dataclass(frozen=True)
class MemoryEstimate:
    """A job's device memory in bytes (None: nothing to go on) and what it rests on;
    ``measured`` is the job's own measured peak when it ran before."""

    bytes: int | None
    basis: str
    measured: int | None = None


def config_bytes(backend: str, options: BackendOptions, eval: EvalSettings,
                 facts: ModelFacts) -> int:
    """Device memory a job needs by its config alone: the weights at the backend's bits (as
    loaded when it does not quantize) plus one slice of the eval's logits. 0 when the
    checkpoint is unknown."""
    if not facts.weight_bytes:
        return 0
    bits = get_backend(backend).weight_bits
    weight_bits = bits(options, facts.loaded_bits) if bits is not None else facts.loaded_bits
    weights = facts.weight_bytes * weight_bits / facts.checkpoint_bits
    # The eval's logits exist a slice of positions at a time (quantdask.worker.logits).
    batch_logits = eval.batch_size * eval.seq_len * facts.vocab_size * 4
    row = eval.batch_size * facts.vocab_size * 4
    logits = min(batch_logits, max(SLICE_BUDGET_BYTES, row)) * LOGIT_COPIES
    return int(weights + logits)


def estimate_device_memory(job: Job, facts: ModelFacts, done: pl.DataFrame) -> MemoryEstimate:
    """``job``'s device memory: its own measured peak if it ran before (in ``done``, earlier
    done results); else its config's figure scaled by how the measured peaks of this model's
    other jobs compare with theirs; else its config's figure alone. ``SAFETY`` on top."""
    # A peak measured while packed jobs ran beside it is theirs too: not this job's figure.
    shared = (pl.col("peak_shared").fill_null(False) if "peak_shared" in done.columns
              else pl.lit(False))
    rows = (done.filter((pl.col("model") == job.model.label)
                        & pl.col("peak_device_mem_bytes").is_not_null() & ~shared).to_dicts()
            if done.height else [])
    own = [r["peak_device_mem_bytes"] for r in rows if r["job_id"] == job.id]
    if own:
        return MemoryEstimate(int(max(own) * SAFETY), "its measured peak", measured=max(own))
    prior = config_bytes(job.backend, job.options, job.eval, facts)
    ratios = []
    for row in rows:
        options = stored_options(row)
        theirs = 0 if options is None else config_bytes(row["backend"], options, job.eval, facts)
        if theirs:
            ratios.append(row["peak_device_mem_bytes"] / theirs)
    if prior and ratios:
        return MemoryEstimate(int(prior * median(ratios) * SAFETY),
                              f"config, scaled by {len(ratios)} measured peaks of this model")
    if prior:
        return MemoryEstimate(int(prior * SAFETY), "checkpoint size and config")
    if rows:
        return MemoryEstimate(int(median(r["peak_device_mem_bytes"] for r in rows) * SAFETY),
                              f"{len(rows)} measured peaks of this model")
    return MemoryEstimate(None, "nothing known")


def stored_options(row: dict) -> BackendOptions | None:
    """The options of a results row (its ``config``, as JSON); None when its backend no longer
    takes them."""
    try:
        return get_backend(row["backend"]).normalize(json.loads(row["config"]), "config")
    except SpecError:
        return None


def done_results(run_dir: str | os.PathLike | None) -> pl.DataFrame:
    """The done results already in ``run_dir`` (empty without any)."""
    from quantdask.store.run_store import read_results

    if run_dir is None or not os.path.isdir(run_dir):
        return pl.DataFrame()
    results = read_results(run_dir)
    return results.filter(pl.col("status") == Status.DONE) if results.height else results


def _job_takers(client: Client) -> dict[str, dict]:
    """The workers now that take jobs (those with a ``GPU`` resource): address -> resources,
    with the worker's name under ``"name"``."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return {address: {**w.get("resources", {}), "name": str(w["name"])}
            for address, w in workers.items() if w.get("resources", {}).get("GPU", 0) > 0}


def advertised_memory(client: Client) -> dict[str, float | None]:
    """Each job-taking worker's name -> the ``DEVICE_MEMORY`` it advertises (None: none)."""
    return {w["name"]: w.get(DEVICE_MEMORY) for w in _job_takers(client).values()}


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


def place_jobs(jobs: list[Job], client: Client, run_dir: str | os.PathLike | None = None,
               finished: Set[str] = frozenset()) -> Placement:
    """``jobs`` with device-memory requests for the workers of ``client`` (see the module
    docstring). Raises :class:`PlacementError` naming every job that fits nowhere (the
    ``finished`` ones, which will not run, excepted). Placement by memory is off (jobs ask for a
    GPU share only) while no worker advertises ``DEVICE_MEMORY``."""
    from quantdask.driver.model_facts import model_facts

    advertised = advertised_memory(client)
    known = {name: memory for name, memory in advertised.items() if memory}
    if not known:
        log.warning("placement by device memory is off for this sweep: %s",
                    f"no worker advertises {DEVICE_MEMORY} (start workers with --preload "
                    "quantdask.preload)" if advertised else "no worker has joined yet")
        return Placement(list(jobs))
    if len(known) < len(advertised):
        log.warning("workers %s advertise no %s: jobs that need an estimate will not go there "
                    "(start them with --preload quantdask.preload)",
                    ", ".join(sorted(set(advertised) - set(known))), DEVICE_MEMORY)
    largest_worker, largest = max(known.items(), key=lambda item: item[1])
    done = done_results(run_dir)
    facts: dict[str, ModelFacts] = {}
    placed, too_big, reference_bytes = [], [], {}
    for job in jobs:
        if job.model.label not in facts:
            facts[job.model.label] = model_facts(job, layers=False)
        estimate = estimate_device_memory(job, facts[job.model.label], done)
        need = estimate.bytes
        if need is None:
            placed.append(job)
            continue
        if need > largest and estimate.measured is not None and estimate.measured <= largest:
            need = int(largest)  # it ran within this much before: the headroom gives way
        if need > largest and job.id not in finished:
            too_big.append((job.id, f"{job.model.label} {job.config_label}", need,
                            estimate.basis))
        placed.append(replace(job, device_memory_bytes=min(need, int(largest))))
        if job.backend == BASELINE:
            # The model's reference runs the unquantized model, as its baseline job does.
            reference_bytes[job.model.label] = min(need, int(largest))
    if too_big:
        raise PlacementError(too_big, largest, largest_worker)
    return Placement(placed, largest, reference_bytes)
