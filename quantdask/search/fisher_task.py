"""A Fisher search's tasks on a worker (``search.fisher``): one forward and backward pass over a
batch of calibration windows, and a chunk of (unit, format) cells scored on every batch's
capture. Both use the worker's kept full-precision model (``probe_task.kept_model``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from quantdask.backends import get_backend
from quantdask.backends.quantized_store import store_for
from quantdask.errors import UnsupportedHere
from quantdask.job.faults import inject_fault
from quantdask.measure.layers import decoder_layers
from quantdask.process.runtime import worker_task
from quantdask.search.cells import ProbedCell, ProbedChunk
from quantdask.search.fisher import Captured, capture_batch, fisher_score, scored_modules
from quantdask.search.members import member_bytes
from quantdask.search.probe_task import kept_model, probe_lock, unit_layer, unit_weights
from quantdask.search.probes import rest_bytes, state_bytes, swapped_weight
from quantdask.words import WorkerTaskKind

if TYPE_CHECKING:
    from quantdask.backends.options import BackendOptions
    from quantdask.backends.quantized_store import QuantizedStore
    from quantdask.measure.reference import Reference
    from quantdask.sweepfile.model import ModelSpec
    from quantdask.words import FaultKind


def fisher_pass(model: ModelSpec, reference: Reference, rows: tuple[int, int],
                members: list[str], keep: int, seed: int,
                faults: Sequence[tuple[int, FaultKind]] = ()) -> Captured:
    """The capture of windows ``rows`` of ``reference`` (``fisher.capture_batch``) for every
    module whose output ``members``' weights make, ``keep`` positions of it."""
    from quantdask.process.runtime import torch_device

    with probe_lock, worker_task(WorkerTaskKind.FISHER_PASS, model.label):
        for attempt, kind in faults:
            inject_fault(kind, attempt)
        built = kept_model(model)
        scored = scored_modules(built, members)
        modules = [*dict.fromkeys(m for found in scored.values() for m in found)]
        device, _, _ = torch_device()
        captured = capture_batch(built, reference.windows, rows, modules, keep, seed, device)
        return dataclasses.replace(captured, modules_of=scored)


def capture_part(captured: Captured, members: list[str]) -> Captured:
    """A task beside a pass's capture: the part a chunk of ``members``' cells reads
    (``Captured.only``), so that a chunk's worker is sent and holds that, not every unit's."""
    return captured.only(members)


def fisher_chunk(model: ModelSpec, captures: list[Captured], backend: str,
                 formats: dict[str, BackendOptions | None],
                 cells: list[tuple[str, tuple[str, ...], str]],
                 units: dict[str, tuple[str, ...]],
                 faults: Sequence[tuple[int, FaultKind]] = ()) -> ProbedChunk:
    """Score ``cells`` ((unit, its members, format label)) on ``captures``: each a row with
    its Fisher ``score`` (nats per token, before the search's fit; ``kl`` left null) and its
    stored bytes, from the same quantized weight a probe swaps in; a format the backend
    cannot apply to a unit is a row with its reason."""
    from distributed import get_worker

    chosen = get_backend(backend)
    with probe_lock, worker_task(WorkerTaskKind.PROBE, model.label):
        for attempt, kind in faults:
            inject_fault(kind, attempt)
        built = kept_model(model)
        prefix, _ = decoder_layers(built)
        scored = scored_modules(built, [m for _, members, _ in cells for m in members])
        store = store_for(model, built, chosen)
        out = []
        for unit, members, label in cells:
            began = time.perf_counter()
            cell = ProbedCell(unit=unit, format=label, layer=unit_layer(unit, members[0], prefix),
                              params=sum(unit_weights(built, m) for m in members),
                              worker=get_worker().address, method="fisher")
            options = formats[label]
            try:
                score, size = _score(built, captures, chosen, options, members, scored, store)
            except UnsupportedHere as error:
                cell = dataclasses.replace(cell, error=str(error))
            else:
                cell = dataclasses.replace(cell, score=score, bytes=size,
                                           kl=0.0 if options is None else None,
                                           kl_se=0.0 if options is None else None)
            out.append(dataclasses.replace(cell, seconds=time.perf_counter() - began))
        base = next((o for o in formats.values() if o is not None), None)
        return ProbedChunk(out, rest_bytes(built, units, chosen, base))


def _score(model, captures: list[Captured], backend, options: BackendOptions | None,
           members: tuple[str, ...], scored: dict[str, list[str]],
           store: QuantizedStore | None) -> tuple[float, int]:
    """(Fisher score, stored bytes) of ``members`` in ``options`` (None: kept, 0)."""
    if options is None:
        return 0.0, sum(member_bytes(model, m, state_bytes) for m in members)
    score, size = 0.0, 0
    for name in members:
        weight, held, stored = swapped_weight(model, name, backend, options, store)
        score += fisher_score(model, captures, scored[name], weight.float() - held.data.float())
        size += stored
    return score, size
