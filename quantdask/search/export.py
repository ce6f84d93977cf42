"""A search's allocation as the file its runtime loads, from a finished run without probing
again: the allocation frame keeps each verified allocation's options (``config``) and the
model's location, and the backend writes the file (``Searchable.export``: for GGUF, llama.cpp's
quantizer with a type per tensor). ``quantdask export allocation`` calls it.

>>> export_allocation("runs/mix", "mix", 5.0, "out/")  # doctest: +SKIP
Exported(path=PosixPath('out/llama-Q4_K_M-mixed.gguf'), ...)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from quantdask.backends import get_backend
from quantdask.backends.capabilities import Searchable
from quantdask.errors import SpecError, UnsupportedHere
from quantdask.store.run_store import RunStore, read_frame
from quantdask.sweepfile.model import ModelSpec
from quantdask.words import Status


@dataclass(frozen=True)
class Exported:
    """The file written for one allocation: its path and bytes, the allocation's job and
    budget, what the probes predicted, and what its job measured (None: it did not finish)."""

    path: Path
    file_bytes: int
    search: str
    job_id: str
    budget_bits_per_weight: float
    candidate: int
    predicted_kl: float
    predicted_bytes: int
    measured_kl: float | None


def export_allocation(run_dir: str | os.PathLike, search: str, budget: float,
                      to: str | os.PathLike, candidate: int = 1) -> Exported:
    """Write the allocation ``search`` chose at ``budget`` bits per weight (its ``candidate``-th
    best) in ``run_dir`` as its runtime's file under ``to``. A search, budget or candidate the
    run has not solved is a :class:`SpecError` naming the ones it has."""
    frame = read_frame(run_dir, "allocation")
    ours = frame.filter(pl.col("search") == search) if not frame.is_empty() else frame
    if ours.is_empty():
        known = sorted(set(frame["search"])) if not frame.is_empty() else []
        raise SpecError("--search", f"no search {search!r} in {run_dir}; " + (
            f"its searches: {', '.join(known)}" if known else "it recorded no search"))
    mixed = ours.filter(pl.col("role") == "mixed")
    chosen = mixed.filter(((pl.col("budget_bits_per_weight") - budget).abs() < 1e-9)
                          & (pl.col("candidate") == candidate))
    if chosen.is_empty():
        solved = sorted({(row["budget_bits_per_weight"], row["candidate"])
                         for row in mixed.iter_rows(named=True)})
        raise SpecError("--budget", f"search {search} solved no allocation at {budget:g} bits "
                                    f"per weight, candidate {candidate}; it solved: "
                                    + ", ".join(f"{b:g} (candidate {c})" for b, c in solved))
    row = chosen.row(0, named=True)
    if not row.get("config"):
        raise SpecError("--search", f"search {search} was recorded without its options (an "
                                    "older quantdask): run the sweep again (its probes are "
                                    "kept, so only the allocation is solved again)")
    backend = get_backend(row["backend"])
    searchable = backend.has(Searchable)
    if searchable is None or searchable.export is None:
        why = searchable.unexported_why if searchable is not None else "it cannot be searched"
        raise SpecError("--search", f"{backend.name}'s allocations are not written as a file: "
                                    f"{why}")
    options = backend.normalize(json.loads(row["config"]), "config")
    location = row["model_location"]
    model = (ModelSpec(path=location) if os.path.isdir(location)
             else ModelSpec(hub=location))
    try:
        path = Path(searchable.export(model, options, to))
    except UnsupportedHere as refused:  # (this allocation's formats: torchao's int4 on a CPU)
        raise SpecError("--search", f"{backend.name} cannot write this allocation as a file: "
                                    f"{refused}") from refused
    return Exported(path, path.stat().st_size, search, row["job_id"],
                    row["budget_bits_per_weight"], candidate, row["predicted_kl"],
                    row["predicted_bytes"], _measured(run_dir, row["job_id"]))


def _measured(run_dir: str | os.PathLike, job_id: str) -> float | None:
    results = RunStore(run_dir).read_results()
    done = results.filter((pl.col("job_id") == job_id) & (pl.col("status") == Status.DONE))
    return None if done.is_empty() else done["kl_divergence"][0]
