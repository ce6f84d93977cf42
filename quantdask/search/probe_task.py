"""A search's probe task on a worker: a chunk of (unit, format) cells measured by one
:class:`~quantdask.search.probes.Prober`, which the worker keeps between the chunks of the same
model and calibration reference (the model built, the hidden states captured once)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from quantdask.backends import get_backend
from quantdask.backends.quantized_store import store_for
from quantdask.errors import UnsupportedHere
from quantdask.job.faults import inject_fault
from quantdask.measure.layers import decoder_layers
from quantdask.process.model_source import cached_model_source
from quantdask.process.runtime import worker_task
from quantdask.search.cells import ProbedCell, ProbedChunk, SearchUnits
from quantdask.search.probes import Prober, layer_index, weighed_through
from quantdask.sweepfile.search import ALL_UNITS
from quantdask.words import WorkerTaskKind

if TYPE_CHECKING:
    import torch

    from quantdask.backends.options import BackendOptions
    from quantdask.measure.reference import Reference
    from quantdask.sweepfile.model import ModelSpec
    from quantdask.sweepfile.settings import EvalSettings
    from quantdask.words import FaultKind

_built: dict[str, torch.nn.Module] = {}  # one full-precision model per worker, for probing
_kept: dict[str, Prober] = {}  # its probers, by reference (the probes' and the refinement's)
probe_lock = threading.RLock()  # one probe, pass or offspring at a time: they share the model


def kept_model(model: ModelSpec) -> torch.nn.Module:
    """This worker's full-precision ``model`` as the probes build it, built on a miss (the one
    kept before it is dropped, with its probers: a worker holds one model for probing)."""
    from quantdask.process.runtime import torch_device

    key = json.dumps(model.identity(), sort_keys=True)
    with probe_lock:
        if key not in _built:
            _built.clear()
            _kept.clear()
            device, _, _ = torch_device()
            source, _ = cached_model_source(model)
            _built[key] = source.build(device)
        return _built[key]


def prober_for(model: ModelSpec, reference: Reference, batch_size: int) -> Prober:
    """This worker's prober of ``model`` on ``reference``'s windows, made on a miss (at most
    two are kept: the probes' windows and the refinement's)."""
    from quantdask.process.runtime import torch_device

    with probe_lock:
        built = kept_model(model)
        prober = _kept.get(reference.key)
        if prober is None or prober.model is not built:
            while len(_kept) >= 2:
                _kept.pop(next(iter(_kept)))
            device, _, _ = torch_device()
            prober = Prober(built, reference.windows, reference.distribution, batch_size,
                            device)
            _kept[reference.key] = prober
        prober.batch_size = batch_size  # half the last one's after running out of memory
        return prober


def search_reference(model: ModelSpec, settings: EvalSettings, text: str) -> Reference:
    """The search's calibration reference (``reference.compute_reference``) as a task whose
    deadline the driver keeps."""
    from quantdask.measure.reference import compute_reference

    with worker_task(WorkerTaskKind.SEARCH_REFERENCE, model.label):
        return compute_reference(model, settings, text)


def search_units(model: ModelSpec, granularity: str, embeddings: bool = False,
                 experts: bool = False) -> SearchUnits:
    """The search's units of ``model`` (name -> its members: linear modules; with
    ``embeddings`` the token embedding and output too, with ``experts`` fused experts) and
    the model's parameter count, read from the model as a probe builds it."""
    from quantdask.process.model_source import count_parameters
    from quantdask.search.probes import linear_units

    with worker_task(WorkerTaskKind.SEARCH_UNITS, model.label):
        source, _ = cached_model_source(model)
        built = source.build("cpu")
        units = linear_units(built, granularity, embeddings=embeddings, experts=experts)
        return SearchUnits(units, count_parameters(built),
                           {m: _shape(built, m) for members in units.values() for m in members},
                           len(decoder_layers(built)[1]))


def _shape(model, name: str) -> tuple[int, int]:
    """Member ``name``'s (weights, in + out widths): what a Fisher capture keeps of it per
    position (a fused experts parameter: its rows' length and all its rows)."""
    from quantdask.search.members import member_weight

    weight = member_weight(model, name)
    return int(weight.numel()), int(weight.shape[-1]) + int(weight.numel() // weight.shape[-1])


def probe_chunk(model: ModelSpec, reference: Reference, batch_size: int, backend: str,
                formats: dict[str, BackendOptions | None],
                cells: list[tuple[str, tuple[str, ...], str]],
                units: dict[str, tuple[str, ...]],
                faults: Sequence[tuple[int, FaultKind]] = ()) -> ProbedChunk:
    """Measure ``cells`` ((unit, its modules, format label)); returns the sensitivity rows
    (without the search's columns) and the bytes the model stores outside ``units``. A format
    the backend cannot apply to a unit (``UnsupportedHere``: a group size that does not divide
    it) is a row with its reason and no figures; any other error fails the task (retried).
    ``faults`` ((attempt, kind)) are injected first (the sweep's ``faults``, rehearsals)."""
    from distributed import get_worker

    chosen = get_backend(backend)
    # One probe at a time per worker (they swap weights of one shared model): its deadline
    # and its time start once it holds the worker's model.
    with probe_lock, worker_task(WorkerTaskKind.PROBE, model.label):
        for attempt, kind in faults:
            inject_fault(kind, attempt)
        prober = prober_for(model, reference, batch_size)
        weigh = weighed_through(store_for(model, prober.model, chosen))
        probed = []
        for unit, modules, label in cells:
            cell = ProbedCell(
                unit=unit, format=label,
                layer=unit_layer(unit, modules[0], prober.prefix),
                params=sum(unit_weights(prober.model, m) for m in modules),
                worker=get_worker().address)
            try:
                measured = prober.probe(unit, modules, label, chosen, formats[label], weigh)
            except UnsupportedHere as error:
                cell = dataclasses.replace(cell, error=str(error))
            else:
                cell = dataclasses.replace(cell, kl=measured.kl, kl_se=measured.kl_se,
                                           bytes=measured.bytes, seconds=measured.seconds)
            probed.append(cell)
        base = next((o for o in formats.values() if o is not None), None)
        return ProbedChunk(probed, prober.rest_bytes(units, chosen, base))


def unit_layer(unit: str, module: str, prefix: str) -> int:
    """A cell's decoder layer: -1 for every unit at once and for a module outside the
    layers (the token embedding, the output)."""
    found = None if unit == ALL_UNITS else layer_index(module, prefix)
    return -1 if found is None else found


def unit_weights(model, name: str) -> int:
    """How many weights member ``name`` of ``model`` holds."""
    from quantdask.search.members import member_weight

    return int(member_weight(model, name).numel())
