"""A sweep's plan before any GPU time is spent: order, state, and what each job will cost.

>>> plan_sweep(load_sweep("data/demo_sweep.yaml"), "runs/demo")  # doctest: +SKIP

Jobs are listed in the order the scheduler starts them (``sweepfile.sweep.start_order``: higher
priority first, then the sweep's own order; the driver releases the jobs that waited for
their model's reference in it too). "Here" means this machine: whether it has a CUDA GPU
decides the device-dependent checks, so plan on the machine (or kind of machine) the workers
run on. Each job gets the device-memory estimate the scheduler places it by
(``placement.estimate_device_memory``) on a GPU and on a CPU slot (what it adds to the
worker's RSS there: the checkpoint's pages it reads count), a duration from earlier runs in
the run directory (the same job, else the same model and backend, else the same model; with
none, from the model's shapes at this machine's matmul rate: ``plan.shape_prices``), and the
reason it cannot run here when a backend's check, or an earlier run of the same job, says so.
Lengths the model
cannot take are refused first (``lengths.check_lengths``); each row names the most positions
its model takes (null: its family sets no hard limit) and the phase that sets the job's peak.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from statistics import median

import polars as pl

from quantdask.backends import get_backend
from quantdask.backends.base import ModelFacts
from quantdask.measure.coverage import Coverage, module_role
from quantdask.plan.lengths import check_lengths
from quantdask.plan.model_facts import model_facts
from quantdask.plan.module_names import check_module_names
from quantdask.plan.placement import (
    done_phases,
    estimate_device_memory,
    streamed_estimate,
    unstreamable_model,
)
from quantdask.plan.runtime_tasks import check_runtime_tasks
from quantdask.plan.shape_prices import job_seconds
from quantdask.sweepfile.sweep import Job, Sweep, expand_grid, start_order
from quantdask.words import PlanState, Status

log = logging.getLogger("quantdask.planning")


PLAN_COLUMNS = ["order", "job_id", "model", "backend", "config_label", "priority", "state",
                "reason", "quantized_share", "est_device_mem_bytes", "memory_from",
                "peak_phase", "est_host_rss_bytes", "est_duration_s", "duration_from",
                "max_positions",
                "positions_from", "streamed", "est_streamed_bytes"]


def _nothing_quantized(backend: str, facts: ModelFacts) -> str:
    """Why a config will quantize nothing: the classes that hold the model's weights."""
    held: dict[str, int] = {}
    for name, cls, count in facts.weight_modules:
        role = module_role(name, cls)
        held[role] = held.get(role, 0) + count
    return (f"would quantize no layer: {backend} replaces none of this model's layers (its "
            f"weights are in {Coverage(0, held).by_class()})")


def _history(run_dir: str | os.PathLike | None) -> pl.DataFrame:
    from quantdask.store.readers import read_results

    if run_dir is None or not Path(run_dir).is_dir():
        return pl.DataFrame()
    return read_results(run_dir)


def _duration(job: Job, done: pl.DataFrame) -> tuple[float | None, str]:
    """(duration s, what it rests on): the median wall time of this job, else of the same
    model and backend, else of the same model."""
    if not done.is_empty():
        for basis, rows in (
                ("this job", done.filter(pl.col("job_id") == job.id)),
                ("same model and backend", done.filter((pl.col("model") == job.model.label)
                                                       & (pl.col("backend") == job.backend))),
                ("same model", done.filter(pl.col("model") == job.model.label))):
            wall = [w for w in rows["wall_s"].to_list() if w is not None]
            if wall:
                return float(median(wall)), basis
    return None, "nothing run yet"


def _row(order: int, job: Job, model: ModelFacts, stream: str, finished: set[str],
         skipped: dict[str, str], done: pl.DataFrame, phases: pl.DataFrame) -> dict:
    """One job's plan row (see ``plan_sweep``), its model's positions left out."""
    backend = get_backend(job.backend)
    reason = backend.check(job.options, model) if backend.check is not None else None
    if reason is None and job.streamed:
        reason = backend.stream_refusal(model.model_type) or unstreamable_model(job.model)
    share = backend.sizing.predicted_share(job.options, model)
    if reason is None and share == 0 and backend.sizing.quantizes:
        reason = _nothing_quantized(job.backend, model)
    state = (PlanState.FINISHED if job.id in finished
             else PlanState.UNSUPPORTED if reason else PlanState.TO_RUN)
    if reason is None and job.id in skipped:
        # A rerun tries it again (it may run on other machines): to run, with the note.
        reason = f"skipped when it last ran: {skipped[job.id]}"
    memory = estimate_device_memory(job, model, done, phases)
    # On a CPU slot the device is the host: what the job adds to its worker's RSS there.
    host_memory = estimate_device_memory(job, model, done, phases, host=True)
    duration, duration_basis = _duration(job, done)
    if duration is None:
        duration, duration_basis = job_seconds(job, model)
    return {"order": order, "job_id": job.id, "model": job.model.label,
            "backend": job.backend, "config_label": job.config_label,
            "priority": job.priority, "state": state, "reason": reason,
            "quantized_share": share,
            "est_device_mem_bytes": memory.bytes, "memory_from": memory.basis,
            "peak_phase": memory.peak_phase,
            "est_host_rss_bytes": host_memory.bytes,
            "est_duration_s": duration, "duration_from": duration_basis,
            # auto: placement decides against the workers' memory (null here)
            "streamed": {"always": True, "never": False}.get(stream),
            "est_streamed_bytes": streamed_estimate(job, model).bytes}


def plan_sweep(sweep: Sweep, run_dir: str | os.PathLike | None = None) -> pl.DataFrame:
    """Every job of ``sweep`` in scheduling order with its state (``finished``, ``to run``,
    ``unsupported``), the reason for an unsupported one, and its estimated device memory and
    duration (see the module docstring)."""
    from quantdask.process.runtime import quiet_libraries
    from quantdask.store.run_store import RunStore

    quiet_libraries()  # the checks import the backends' libraries; their notices are noise here
    limits = check_lengths(sweep)
    jobs = expand_grid(sweep)
    check_module_names(jobs)
    check_runtime_tasks(jobs)
    sweep.check_searches_resident(jobs)
    history = _history(run_dir)
    phases = done_phases(run_dir) if history.height else pl.DataFrame()
    finished = (RunStore(run_dir).finished_job_ids() if run_dir is not None and history.height
                else set())
    done = history.filter(pl.col("status") == Status.DONE) if history.height else history
    skipped = ({r["job_id"]: r["error_message"] for r in
                history.filter(pl.col("status") == Status.SKIPPED).to_dicts()}
               if history.height else {})
    facts: dict[str, ModelFacts] = {}
    rows = []
    for order, job in enumerate(start_order(jobs), start=1):
        if job.model.label not in facts:
            facts[job.model.label] = model_facts(job)
        rows.append(_row(order, job, facts[job.model.label], sweep.stream, finished, skipped,
                         done, phases) | {"max_positions": limits[job.model.label].positions,
                                          "positions_from": limits[job.model.label].source})
    return pl.DataFrame(rows, schema={"order": pl.Int64, "job_id": pl.String,
                                      "model": pl.String, "backend": pl.String,
                                      "config_label": pl.String, "priority": pl.Int64,
                                      "state": pl.String, "reason": pl.String,
                                      "quantized_share": pl.Float64,
                                      "est_device_mem_bytes": pl.Int64,
                                      "memory_from": pl.String,
                                      "peak_phase": pl.String,
                                      "est_host_rss_bytes": pl.Int64,
                                      "est_duration_s": pl.Float64,
                                      "duration_from": pl.String,
                                      "max_positions": pl.Int64,
                                      "positions_from": pl.String,
                                      "streamed": pl.Boolean,
                                      "est_streamed_bytes": pl.Int64})
