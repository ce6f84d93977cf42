"""Sensitivity probes of a mixed-precision search: the KL that one unit (a linear layer, or
every linear of one decoder layer) adds when it alone takes one format, measured on the
calibration windows against their full-precision reference, and its stored bytes.

A :class:`Prober` holds the full-precision model and the hidden states entering each decoder
layer for each batch of the windows, captured in one pass. A cell of a unit in layer L swaps
the unit's dequantized weights in, then runs the model's own forward with the layers before L
passed through and layer L fed the captured states: the embedding and the layers after L are
the model's own code, and nothing before L is computed again. The KL comes from the same
meter as the eval's (``metrics.QualityMeter``), with its standard error over the windows. The
weights are put back after each cell.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quantdask.backends.capabilities import Dequantizes, ModuleAlone, Searchable
from quantdask.measure.layers import decoder_layers
from quantdask.measure.metrics import measure_quality
from quantdask.measure.usage import stored_tensors
from quantdask.search.members import fused_experts, member_bytes, member_weight, quantizable

if TYPE_CHECKING:
    import torch

    from quantdask.backends.base import Backend
    from quantdask.backends.options import BackendOptions
    from quantdask.backends.quantized_store import QuantizedStore
    from quantdask.measure.metrics import QualityMeter

KEEP = "keep"
"""The format that leaves a unit in full precision (KL 0 by construction, not probed)."""


@dataclass(frozen=True)
class CellMeasure:
    """One (unit, format) cell: the KL it adds alone (nats per token, with its standard
    error over the windows), its stored bytes, and the seconds the probe took."""

    unit: str
    format: str
    kl: float
    kl_se: float | None
    bytes: int
    seconds: float



def linear_units(model: torch.nn.Module, granularity: str,
                 skip: tuple[str, ...] = ("lm_head",), embeddings: bool = False,
                 experts: bool = False) -> dict[str, tuple[str, ...]]:
    """The search's units, each the names of its members (``search.members``): ``linear``,
    each linear of the decoder layers; ``block``, each decoder layer's linears together
    (named by the layer). Modules outside the decoder layers (the head) are not units, unless
    ``embeddings``: then the token embedding and the output are a unit each (one, when they
    share their weight). With ``experts``, each fused experts parameter is a member too (a
    unit of its own at ``linear``) and their routers are none (``search.members``)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    prefix, _ = decoder_layers(model)
    units: dict[str, tuple[str, ...]] = {}
    if embeddings:
        units.update({name: (name,) for name in embedding_modules(model)})
    fused, routers = fused_experts(model, prefix) if experts else ([], set())
    linears = [name for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear | Conv1D) and name not in routers]
    for name in sorted([*linears, *fused], key=_in_model_order(model)):
        if name in skip:
            continue
        index = layer_index(name, prefix)
        if index is None:
            continue
        unit = name if granularity == "linear" else f"{prefix}.{index}"
        units[unit] = (*units.get(unit, ()), name)
    return units


def _in_model_order(model: torch.nn.Module):
    """A sort key putting member names in the model's own order (its modules', then each
    module's parameters')."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}

    def key(name: str) -> tuple[int, int]:
        if name in order:
            return order[name], 0
        return order[name.rpartition(".")[0]], 1
    return key


def embedding_modules(model: torch.nn.Module) -> list[str]:
    """The names of the token embedding and the output module (the output left out where it
    shares the embedding's weight)."""
    found: Any = model  # a transformers model
    embedding, output = found.get_input_embeddings(), found.get_output_embeddings()
    names = {id(module): name for name, module in model.named_modules()}
    tied = output is None or output.weight is embedding.weight
    return [names[id(embedding)], *([] if tied else [names[id(output)]])]


def layer_index(module_name: str, prefix: str) -> int | None:
    """The decoder layer a module belongs to (``model.layers.3.mlp.up_proj`` -> 3), or None."""
    found = re.match(rf"{re.escape(prefix)}\.(\d+)(\.|$)", module_name)
    return int(found.group(1)) if found else None


class Prober:
    """Probes cells of one full-precision ``model`` on ``windows`` against ``reference`` (a
    ``Reference.distribution`` of the same windows); see the module."""

    def __init__(self, model: torch.nn.Module, windows: torch.Tensor,
                 reference: dict[str, torch.Tensor], batch_size: int, device: str):
        self.model, self.windows, self.reference = model, windows, reference
        self.batch_size, self.device = batch_size, device
        self.prefix, self.layers = decoder_layers(model)
        self.states: list[dict[int, torch.Tensor]] = [{} for _ in self.layers]
        self.tuple_output: list[int] = [0] * len(self.layers)  # 0: a tensor; n: a tuple of n
        self.batch: int | None = None  # the captured batch (its first row) being run
        self._capture()

    def _capture(self) -> None:
        """One full-precision pass: each layer's input hidden states, by batch."""
        hooks = []
        for index, layer in enumerate(self.layers):
            hooks.append(layer.register_forward_pre_hook(self._capturing(index),
                                                         with_kwargs=True))
            hooks.append(layer.register_forward_hook(self._output_form(index)))
        try:
            measure_quality(self.model, self.windows, self.reference, self.batch_size,
                            self.device, on_batch=self._on_batch)
        finally:
            for hook in hooks:
                hook.remove()
            self.batch = None

    def _on_batch(self, rows: slice) -> None:
        self.batch = rows.start

    def _capturing(self, index: int):
        def hook(module, args, kwargs):
            if self.batch is not None:
                self.states[index][self.batch] = _hidden(args, kwargs).detach().clone()
        return hook

    def _output_form(self, index: int):
        def hook(module, args, output):
            self.tuple_output[index] = len(output) if isinstance(output, tuple) else 0
        return hook

    @contextlib.contextmanager
    def starting_at(self, index: int) -> Iterator[None]:
        """The model's forward, on the captured batches, starts at decoder layer ``index``
        (earlier layers pass their input through; layer ``index`` takes the captured
        states). Other inputs (a sliced head's probe) run the whole model."""
        originals = [self.layers[i] for i in range(index)]
        for i, layer in enumerate(originals):
            self.layers[i] = _pass_through(layer, self, self.tuple_output[i])

        def feed(module, args, kwargs):
            if self.batch is None:
                return None
            state = self.states[index][self.batch]
            if args:
                return (state, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": state}

        hook = self.layers[index].register_forward_pre_hook(feed, with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()
            for i, layer in enumerate(originals):
                self.layers[i] = layer
            self.batch = None

    def rest_bytes(self, units: dict[str, tuple[str, ...]], backend: Backend | None = None,
                   options: BackendOptions | None = None) -> int:
        """What the model stores outside ``units`` (:func:`rest_bytes`)."""
        return rest_bytes(self.model, units, backend, options)

    def measure(self, first_layer: int | None = 0) -> tuple[float, float | None]:
        """The model's KL against the reference as it is now (mean, standard error), run from
        decoder layer ``first_layer`` (None: the whole model, from its embedding)."""
        scores = self.meter(first_layer).scores()
        return scores.kl_divergence, scores.kl_se

    def meter(self, first_layer: int | None = 0) -> QualityMeter:
        """The model as it is now measured against the reference (its meter), run from
        decoder layer ``first_layer`` (None: the whole model)."""
        with self.starting_at(first_layer) if first_layer is not None else contextlib.nullcontext():
            meter = measure_quality(self.model, self.windows, self.reference, self.batch_size,
                                    self.device, on_batch=self._on_batch)
        self.batch = None
        return meter

    def first_layer(self, modules: tuple[str, ...]) -> int | None:
        """Where a probe of ``modules`` starts: the first decoder layer among them; None (the
        whole model) for the token embedding, the last layer for a module after them all."""
        embedding = self.model.get_input_embeddings()  # type: ignore[operator]
        if any(member_weight(self.model, m) is embedding.weight for m in modules):
            return None
        return min(i if (i := layer_index(m, self.prefix)) is not None else len(self.layers) - 1
                   for m in modules)

    def probe(self, unit: str, modules: tuple[str, ...], format: str, backend: Backend,
              options: BackendOptions | None, weigh=None) -> CellMeasure:
        """Cell (``unit``, ``format``): each of ``modules`` quantized alone by ``backend``
        with ``options`` (None: kept, KL 0; ``weigh``: as :func:`swapped_in`'s), its KL
        measured, the weights put back."""
        began = time.perf_counter()
        if options is None:
            size = sum(member_bytes(self.model, m, state_bytes) for m in modules)
            return CellMeasure(unit, format, 0.0, 0.0, size, time.perf_counter() - began)
        members = [(m, options) for m in modules]
        if len({layer_index(m, self.prefix) for m in modules}) > 1:  # the whole model's
            meter, size = self.whole(members, backend, weigh)
            scores = meter.scores()
            kl, se = scores.kl_divergence, scores.kl_se
        else:
            with swapped_in(self.model, members, backend, weigh) as size:
                kl, se = self.measure(self.first_layer(modules))
        return CellMeasure(unit, format, kl, se, size, time.perf_counter() - began)

    def whole(self, members: list[tuple[str, BackendOptions]], backend: Backend, weigh=None
              ) -> tuple[QualityMeter, int]:
        """The model with every (member, options) of ``members`` swapped in, measured whole
        from its embedding, and the bytes they store. A decoder layer's members are swapped
        in as the layer starts and put back as it ends, every window in one batch: the model
        never holds more than one layer's quantized copy (a 1.5B model's would double its
        memory), and each layer is quantized once."""
        by_layer: dict[int | None, list[tuple[str, BackendOptions]]] = {}
        for name, options in members:
            by_layer.setdefault(layer_index(name, self.prefix), []).append((name, options))
        sizes: dict[str, int] = {}
        held: list = []

        def enter(index: int):
            def hook(module, args, kwargs=None):
                held.append(swapped_in(self.model, by_layer[index], backend, weigh))
                sizes[f"layer {index}"] = held[-1].__enter__()
            return hook

        def leave(module, args, output):
            held.pop().__exit__(None, None, None)

        hooks = []
        for index in (i for i in by_layer if i is not None):
            hooks.append(self.layers[index].register_forward_pre_hook(enter(index)))
            hooks.append(self.layers[index].register_forward_hook(leave))
        batch, self.batch_size = self.batch_size, int(self.windows.size(0))
        try:
            with swapped_in(self.model, by_layer.get(None, []), backend, weigh) as outside:
                meter = self.meter(None)
        finally:
            self.batch_size = batch
            for hook in hooks:
                hook.remove()
            while held:
                held.pop().__exit__(None, None, None)
        return meter, outside + sum(sizes.values())


@contextlib.contextmanager
def swapped_in(model: torch.nn.Module, members: list[tuple[str, BackendOptions]],
               backend: Backend, weigh=None) -> Iterator[int]:
    """``model`` with each (member, options) of ``members`` quantized alone and swapped in
    (``weigh``: :func:`swapped_weight`, or a cache of its results), yielding the bytes they
    store; every weight put back after."""
    weigh = weigh or swapped_weight
    size, swapped = 0, []
    try:
        for name, options in members:
            weight, held, stored = weigh(model, name, backend, options)
            size += stored
            swapped.append((held, held.data))
            held.data = weight
        yield size
    finally:
        for held, original in swapped:
            held.data = original


def swapped_weight(model: torch.nn.Module, name: str, backend: Backend,
                   options: BackendOptions, store: QuantizedStore | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Member ``name`` of ``model`` quantized alone by ``backend`` with ``options`` (its probe
    quantizer: ``ModuleAlone`` or its stated proxy) and back in float: (the weight in the
    layout, dtype and device of the parameter it replaces, that parameter, the bytes it
    stores). The one quantization the probes, the Fisher scores and the refinement's offspring
    share; with ``store`` (``backends.quantized_store``), made once per machine."""
    from transformers.pytorch_utils import Conv1D

    alone, layer_weights = backend.probe_quantizer(), backend.has(Dequantizes)
    if alone is None or layer_weights is None:
        raise ValueError(backend.refusal(ModuleAlone if alone is None else Dequantizes))
    module, held = quantizable(model, name)
    if store is None:
        quantized = alone.quantize(module, options)
    else:
        quantized = store.quantized([name, options.as_dict()],
                                    lambda: alone.quantize(module, options))
    size = getattr(quantized, "checkpoint_bytes", None) or state_bytes(
        quantized, backend.sizing.stored_bytes)  # (a proxy's: the file's count)
    weight = layer_weights.dequantize(quantized)
    if weight is None:
        raise ValueError(f"{backend.name}: no dequantized weight for {name}")
    original = held.data
    if isinstance(module, Conv1D) and not isinstance(quantized, Conv1D):
        weight = weight.t()  # (out, in) of a layer stored (in, out), square too
    if held.dim() == 3:  # fused experts, quantized as one linear of all their rows
        weight = weight.reshape(original.shape)
    if weight.shape != original.shape:
        raise ValueError(f"{backend.name}: {name}'s weight came back "
                         f"{tuple(weight.shape)}, not {tuple(original.shape)}")
    return (weight.to(dtype=original.dtype, device=original.device).contiguous(), held,
            int(size))


def weighed_through(store: QuantizedStore | None):
    """A ``weigh`` for :func:`swapped_in` that quantizes through ``store`` (None: the default,
    each member quantized again)."""
    return None if store is None else functools.partial(swapped_weight, store=store)


def rest_bytes(model: torch.nn.Module, units: dict[str, tuple[str, ...]],
               backend: Backend | None = None, options: BackendOptions | None = None) -> int:
    """What ``model`` stores outside ``units`` (the head, the embeddings, the norms): the part
    of its size no allocation changes; as ``backend``'s file with ``options`` stores it where
    the backend counts it (``Searchable.rest_bytes``)."""
    searchable = backend.has(Searchable) if backend is not None else None
    if searchable is not None and searchable.rest_bytes is not None and options is not None:
        return searchable.rest_bytes(model, units, options)
    inside = sum(member_bytes(model, m, state_bytes)
                 for modules in units.values() for m in modules)
    return state_bytes(model) - inside


def _hidden(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def state_bytes(module: torch.nn.Module, stored_bytes=None) -> int:
    """What a module's state stores, as the coverage phase counts a model's (``size_bytes``,
    with the backend's ``stored_bytes``)."""
    return sum(size for _, _, size in stored_tensors(module, stored_bytes))


def _pass_through(layer: torch.nn.Module, prober: Prober, tuple_output: int
                  ) -> torch.nn.Module:
    """A stand-in for a decoder layer: on a captured batch it returns its input hidden states
    in the layer's output form (a tensor, or a tuple of ``tuple_output``); on any other input
    it runs the layer."""
    import torch

    class PassThrough(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, *args, **kwargs):
            if prober.batch is None:
                return self.layer(*args, **kwargs)
            hidden = _hidden(args, kwargs)
            return (hidden, *([None] * (tuple_output - 1))) if tuple_output else hidden

    return PassThrough()
