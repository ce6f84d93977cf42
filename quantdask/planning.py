"""A sweep's plan before any GPU time is spent: order, state, and what each job will cost.

>>> plan_sweep(load_sweep("data/demo_sweep.yaml"), "runs/demo")  # doctest: +SKIP

Jobs are listed in the order the scheduler starts them (higher priority first, then the sweep's
own order). "Here" means this machine: whether it has a CUDA GPU decides the device-dependent
checks, so plan on the machine (or kind of machine) the workers run on. Each gets an estimate of
its device memory and duration from earlier runs in the run
directory (the same job, else the same model and backend, else the same model), or of its memory
from the checkpoint's size when nothing has run yet; and the reason it cannot run here when a
backend's check, or an earlier run of the same job, says so.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from statistics import median
from typing import Any

import polars as pl

from quantdask.backends import get_backend
from quantdask.backends.base import ModelFacts
from quantdask.cluster import cuda_device_count
from quantdask.spec import Job, Sweep, expand_grid

log = logging.getLogger("quantdask.planning")

PLAN_COLUMNS = ["order", "job_id", "model", "backend", "config_label", "priority", "state",
                "reason", "est_device_mem_bytes", "est_duration_s", "estimate_from"]
MEMORY_PER_WEIGHT_BYTE = 2.0
"""Without history: the unquantized weights are read and a quantized copy built beside them."""


def _linear_widths(directory: Path, trust_remote_code: bool) -> dict[str, int]:
    """Every ``nn.Linear`` of the model and its input width, from its config alone: the model
    is built on PyTorch's meta device, which allocates nothing."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return {name: module.in_features for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)}


def model_facts(job: Job) -> ModelFacts:
    """What the driver can learn of ``job``'s model from its local files (nothing for a hub
    id: the plan downloads nothing)."""
    directory = Path(job.model.location)
    if job.model.hub or not directory.is_dir():
        return ModelFacts(linear_in_features={}, weight_bytes=0, cuda=cuda_device_count() > 0)
    weight_bytes = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin")
                       for f in directory.glob(pattern))
    try:
        widths = _linear_widths(directory, job.model.trust_remote_code)
    except Exception as error:  # noqa: BLE001 - not a causal LM, remote code, ...: the plan
        log.warning("no layer shapes for %s (%s); shape checks are left to the workers",
                    job.model.label, error)  # goes on, and the workers still check
        widths = {}
    return ModelFacts(linear_in_features=widths, weight_bytes=weight_bytes,
                      cuda=cuda_device_count() > 0)


def _history(run_dir: str | os.PathLike | None) -> pl.DataFrame:
    from quantdask.store import read_results

    if run_dir is None or not Path(run_dir).is_dir():
        return pl.DataFrame()
    return read_results(run_dir)


def _estimate(job: Job, done: pl.DataFrame, facts: ModelFacts) -> tuple[Any, Any, str]:
    """(device memory bytes, duration s, what the estimate rests on)."""
    if not done.is_empty():
        for basis, rows in (
                ("this job", done.filter(pl.col("job_id") == job.id)),
                ("same model and backend", done.filter((pl.col("model") == job.model.label)
                                                       & (pl.col("backend") == job.backend))),
                ("same model", done.filter(pl.col("model") == job.model.label))):
            if not rows.is_empty():
                memory = [m for m in rows["peak_device_mem_bytes"].to_list() if m is not None]
                wall = [w for w in rows["wall_s"].to_list() if w is not None]
                return (int(median(memory)) if memory else None,
                        float(median(wall)) if wall else None, basis)
    if facts.weight_bytes:
        return int(facts.weight_bytes * MEMORY_PER_WEIGHT_BYTE), None, "checkpoint size"
    return None, None, "nothing known"


def plan_sweep(sweep: Sweep, run_dir: str | os.PathLike | None = None) -> pl.DataFrame:
    """Every job of ``sweep`` in scheduling order with its state (``finished``, ``to run``,
    ``unsupported``), the reason for an unsupported one, and its estimated device memory and
    duration (see the module docstring)."""
    from quantdask.store import RunStore
    from quantdask.worker import quiet_libraries

    quiet_libraries()  # the checks import the backends' libraries; their notices are noise here
    jobs = expand_grid(sweep)
    history = _history(run_dir)
    finished = RunStore(run_dir).finished_job_ids() if history.height else set()
    done = history.filter(pl.col("status") == "done") if history.height else history
    skipped = ({r["job_id"]: r["error_message"] for r in
                history.filter(pl.col("status") == "skipped").to_dicts()}
               if history.height else {})
    facts: dict[str, ModelFacts] = {}
    rows = []
    # The scheduler's order: Dask starts higher priorities first, submission order among equals.
    for order, job in enumerate(sorted(jobs, key=lambda j: -j.priority), start=1):
        if job.model.label not in facts:
            facts[job.model.label] = model_facts(job)
        model = facts[job.model.label]
        check = get_backend(job.backend).check
        reason = check(job.options, model) if check is not None else None
        state = ("finished" if job.id in finished else "unsupported" if reason else "to run")
        if reason is None and job.id in skipped:
            # A rerun tries it again (it may run on other machines): to run, with the note.
            reason = f"skipped when it last ran: {skipped[job.id]}"
        memory, duration, basis = _estimate(job, done, model)
        rows.append({"order": order, "job_id": job.id, "model": job.model.label,
                     "backend": job.backend, "config_label": job.config_label,
                     "priority": job.priority, "state": state, "reason": reason,
                     "est_device_mem_bytes": memory, "est_duration_s": duration,
                     "estimate_from": basis})
    return pl.DataFrame(rows, schema={"order": pl.Int64, "job_id": pl.String,
                                      "model": pl.String, "backend": pl.String,
                                      "config_label": pl.String, "priority": pl.Int64,
                                      "state": pl.String, "reason": pl.String,
                                      "est_device_mem_bytes": pl.Int64,
                                      "est_duration_s": pl.Float64,
                                      "estimate_from": pl.String})
