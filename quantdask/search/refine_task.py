"""A refinement's offspring on a worker: one whole mix scored by its KL on the refinement's
calibration windows, in the backend's runtime where it has a scorer of its own
(``Searchable.score_mix``: GGUF's file written by llama.cpp's quantizer and run in llama.cpp),
else in torch on the probe model with every unit's quantized weight swapped in (HQQ, torchao;
GPTQ's stated proxy). The quantized weights are kept between offspring (most units keep their
format from one mix to the next), up to :data:`QUANTIZED_CACHE_BYTES`."""

from __future__ import annotations

import functools
import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quantdask.backends import get_backend
from quantdask.backends.capabilities import Searchable
from quantdask.backends.quantized_store import store_for
from quantdask.job.faults import inject_fault
from quantdask.process.runtime import worker_task
from quantdask.search.probe_task import probe_lock, prober_for
from quantdask.search.probes import swapped_weight
from quantdask.words import WorkerTaskKind

if TYPE_CHECKING:
    import torch

    from quantdask.backends.base import Backend
    from quantdask.backends.options import BackendOptions
    from quantdask.backends.quantized_store import QuantizedStore
    from quantdask.measure.metrics import QualityMeter
    from quantdask.measure.reference import Reference
    from quantdask.sweepfile.model import ModelSpec
    from quantdask.words import FaultKind

QUANTIZED_CACHE_BYTES = 2 << 30
"""The dequantized weights a worker keeps between offspring, at most (least recently used
go first)."""

_quantized: OrderedDict[tuple, tuple] = OrderedDict()
_quantized_of: list = [None]  # the model they are of (another model's are dropped)


@dataclass(frozen=True)
class MixScore:
    """A whole mix's KL on the refinement windows (mean and standard error), each window's
    own (for paired differences), where it was measured, by whom and how long it took."""

    kl: float
    kl_se: float
    window_kl: list[float]
    measured_in: str
    worker: str
    seconds: float


def score_mix(model: ModelSpec, reference: Reference, batch_size: int, backend: str,
              formats: dict[str, BackendOptions | None], chosen: dict[str, str],
              units: dict[str, tuple[str, ...]], options: BackendOptions,
              faults: Sequence[tuple[int, FaultKind]] = ()) -> MixScore:
    """The mix ``chosen`` (unit -> format label) of ``model`` scored on ``reference``'s
    windows; ``options`` is the mix as its verifying job's options (what a runtime scorer
    quantizes)."""
    from distributed import get_worker

    began = time.perf_counter()
    found = get_backend(backend)
    searchable = found.has(Searchable)
    with probe_lock, worker_task(WorkerTaskKind.OFFSPRING, model.label):
        for attempt, kind in faults:
            inject_fault(kind, attempt)
        if searchable is not None and searchable.score_mix is not None:
            meter = searchable.score_mix(model, options, reference.windows,
                                         reference.distribution)
            where = searchable.scores_in
        else:
            meter, where = _in_torch(model, reference, batch_size, found, formats, chosen,
                                     units), "torch"
    scores = meter.scores()
    return MixScore(scores.kl_divergence, scores.kl_se or 0.0, window_kl(meter), where,
                    get_worker().address, time.perf_counter() - began)


def window_kl(meter: QualityMeter) -> list[float]:
    """Each window's mean KL over its positions."""
    return [float(v) for v in meter.kl.mean(dim=1)]


def _in_torch(model: ModelSpec, reference: Reference, batch_size: int, backend: Backend,
              formats: dict[str, BackendOptions | None], chosen: dict[str, str],
              units: dict[str, tuple[str, ...]]) -> QualityMeter:
    prober = prober_for(model, reference, batch_size)
    members = [(m, formats[label]) for unit, label in chosen.items()
               if formats[label] is not None for m in units[unit]]
    store = store_for(model, prober.model, backend)
    weigh = functools.partial(_cached_weight, store=store)
    return prober.whole(members, backend, weigh=weigh)[0]  # type: ignore[arg-type]


def _cached_weight(model: torch.nn.Module, name: str, backend: Backend,
                   options: BackendOptions, store: QuantizedStore | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``probes.swapped_weight``, kept (see the module), through ``store`` on a miss."""
    if _quantized_of[0] is not model:
        _quantized.clear()
        _quantized_of[0] = model
    key = (name, backend.name, json.dumps(options.as_dict(), sort_keys=True,
                                                     default=str))
    if key in _quantized:
        _quantized.move_to_end(key)
        return _quantized[key]
    found = _quantized[key] = swapped_weight(model, name, backend, options, store)
    held = sum(w.numel() * w.element_size() for w, _, _ in _quantized.values())
    while held > QUANTIZED_CACHE_BYTES and len(_quantized) > 1:
        weight, _, _ = _quantized.popitem(last=False)[1]
        held -= weight.numel() * weight.element_size()
    return found
