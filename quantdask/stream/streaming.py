"""A model run one decoder layer at a time, its weights read from the checkpoint as each layer's
turn comes: for models whose full-precision weights do not fit the device (or the host).

:class:`StreamedModel` builds the model with its decoder layers left empty (PyTorch's meta
device: nothing allocated) and reads everything else (embeddings, final norm, head) from the
checkpoint. :meth:`StreamedModel.log_probs` then runs every window through the stack:

1. one pass of the model's own forward per batch, with decoder layer 0 real (read from the
   checkpoint) and the later ones stand-ins that note the arguments the model gives them
   (attention masks, position embeddings, per-layer masks: each family's own, never copies)
   and pass their input through; layer 0's output per batch is kept;
2. each later layer read (memory-mapped safetensors: only that layer's tensors), optionally
   quantized (``quantize_layer``), run over every batch's hidden states with the arguments
   noted for it, then dropped: weights cross the bus once per pass, whatever the windows;
3. the model's own forward again per batch with the first layer a stand-in that returns the
   final hidden states, through ``logits.sliced_log_probs``: the final norm and the head
   (soft-capping, scaling) as in a plain forward, a slice of positions at a time.

Layers run the same operations on the same batches as a resident forward, so the full-precision
figures are the same to the bit. Each layer's read bytes and seconds are kept
(:attr:`StreamedModel.timings`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from quantdask.backends.capabilities import ModuleAlone
from quantdask.errors import UnsupportedHere
from quantdask.measure.checkpoint_reader import CheckpointReader
from quantdask.measure.layers import decoder_layers
from quantdask.measure.logits import LogProbSlice, sliced_log_probs
from quantdask.util import format_bytes

if TYPE_CHECKING:
    import torch

    from quantdask.backends.base import Backend
    from quantdask.backends.options import BackendOptions
    from quantdask.process.model_source import ModelSource

LayerHook = Callable[["torch.nn.Module", str], "torch.nn.Module"]
"""``quantize_layer(layer, its module name) -> layer``: a decoder layer as a job runs it."""
log = logging.getLogger("quantdask.job")  # the running attempt's own log

LayerSeen = Callable[[str, "torch.nn.Module", dict[str, "torch.Tensor"]], "LayerWatch | None"]
"""``on_layer(its module name, layer as run, its full-precision state)``: each layer's turn;
what it returns watches the layer while it runs (``LayerWatch``)."""


class LayerWatch(Protocol):
    """Watches one layer while it runs over the batches (``layers.OutputErrors``): entered
    around its run, told each batch's window rows before that batch runs."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> Any: ...

    def batch(self, rows: slice) -> None: ...


@dataclass(frozen=True)
class LayerTiming:
    """One decoder layer's turn in a pass: the bytes read from the checkpoint, the seconds to
    read (and quantize) it, and the seconds it ran over every batch."""

    index: int
    bytes_read: int
    load_s: float
    run_s: float


@dataclass
class _Batches:
    """What the stack needs per batch (keyed by its first row): the hidden states between
    layers, and each stand-in layer's noted arguments."""

    hidden: dict[int, Any] = field(default_factory=dict)
    arguments: list[dict[int, tuple[tuple, dict]]] = field(default_factory=list)
    current: int | None = None  # the batch the model's forward runs now
    recording: bool = False  # the stand-ins note their arguments (the first pass)
    tuple_output: int = 0  # 0: a layer returns a tensor; n: a tuple of n


class _Stop(BaseException):  # noqa: N818 - not an error: no library handler may catch it
    """Ends the first pass's forward once the last layer's arguments are noted."""


class StreamedModel:
    """``source``'s model with its decoder layers streamed from the checkpoint (see the
    module), on ``device``; ``quantize_layer`` makes each layer what a job measures."""

    def __init__(self, source: ModelSource, device: str,
                 quantize_layer: LayerHook | None = None,
                 on_layer: LayerSeen | None = None):
        import torch

        self.device, self.quantize_layer, self.on_layer = device, quantize_layer, on_layer
        self.watch: LayerWatch | None = None  # what on_layer returned for the layer just read
        model = source.empty_model()
        self.model = model.eval()
        self.prefix, self.layers = decoder_layers(model)
        self.skeletons = list(self.layers)  # the empty layers, copied for each turn
        self.reader = CheckpointReader(source.spec.location, model)
        tied = model.get_expanded_tied_weights_keys(all_submodels=True)
        for names, parameter in _shared(model).items():
            outside = [n for n in names if not n.startswith(f"{self.prefix}.")]
            found = next((n for n in outside if n in self.reader), None)
            if found is None and outside and tied.get(outside[0]) not in self.reader:
                raise UnsupportedHere(f"the checkpoint holds no tensor for {outside[0]}")
            if found is not None:
                value = torch.nn.Parameter(self.reader.read(found).to(
                    device=device, dtype=parameter.dtype), requires_grad=False)
                for name in outside:
                    assign(model, name, value, parameter=True)
        for target, origin in tied.items():  # a head the checkpoint leaves to its embedding
            if target not in self.reader:
                assign(model, target, model.get_parameter(origin), parameter=True)
        for name, buffer in model.named_buffers():
            if not name.startswith(f"{self.prefix}."):
                assign(model, name, buffer.to(device), parameter=False)
        self.timings: list[LayerTiming] = []
        self.no_grad = torch.inference_mode

    def _set(self, root: torch.nn.Module, name: str, like: torch.nn.Parameter,
             full_name: str) -> None:
        value = self.reader.read(full_name).to(device=self.device, dtype=like.dtype)
        assign(root, name, value, parameter=True)

    def layer(self, index: int) -> torch.nn.Module:
        """Decoder layer ``index`` read from the checkpoint onto the device, then made what
        the job measures (``quantize_layer``)."""
        layer = copy.deepcopy(self.skeletons[index])
        prefix = f"{self.prefix}.{index}"
        for name, parameter in list(layer.named_parameters()):
            self._set(layer, name, parameter, f"{prefix}.{name}")
        for name, buffer in list(layer.named_buffers()):
            assign(layer, name, buffer.to(self.device), parameter=False)
        originals = {name: tensor.detach() for name, tensor in layer.state_dict().items()}
        if self.quantize_layer is not None:
            layer = self.quantize_layer(layer, prefix)
        self.watch = (self.on_layer(prefix, layer, originals) if self.on_layer is not None
                      else None)
        return layer

    def read_layers(self) -> None:
        """Read (and quantize) each layer in turn without running it (``on_layer`` sees
        each): a baseline's coverage."""
        self.timings = []
        for index in range(len(self.skeletons)):
            began, read = time.perf_counter(), self.reader.bytes_read
            let_go(self.layer(index))
            self._took(LayerTiming(index, self.reader.bytes_read - read,
                                   time.perf_counter() - began, 0.0))

    def _took(self, timing: LayerTiming) -> None:
        """Note a layer's turn, and say so in the job's log: a streamed pass of a large
        model runs for minutes, and its log is what ``quantdask logs`` shows meanwhile."""
        self.timings.append(timing)
        log.info("layer %d/%d streamed: %s read in %.2f s, ran in %.2f s", timing.index + 1,
                 len(self.skeletons), format_bytes(timing.bytes_read), timing.load_s,
                 timing.run_s)

    @contextlib.contextmanager
    def outside_layers(self) -> Iterator[torch.nn.Module]:
        """The model holding no decoder layer (each an identity) while the block runs: what
        it holds outside them, for counting."""
        import torch

        for index in range(len(self.skeletons)):
            self.layers[index] = torch.nn.Identity()
        try:
            yield self.model
        finally:
            for index, skeleton in enumerate(self.skeletons):
                self.layers[index] = skeleton

    def log_probs(self, windows: torch.Tensor, batch_size: int,
                  on_batch: Callable[[slice], None] | None = None) -> Iterator[LogProbSlice]:
        """The windows' next-token log-probs, as ``logits.sliced_log_probs`` yields them,
        with the stack streamed (see the module); :attr:`timings` holds this pass's layers."""
        self.timings = []
        batches = self._first_layer(windows, batch_size)
        for index in range(1, len(self.skeletons)):
            self._run_layer(index, batches)
        yield from self._head(windows, batch_size, batches, on_batch)

    def _first_layer(self, windows: torch.Tensor, batch_size: int) -> _Batches:
        batches = _Batches(arguments=[{} for _ in self.skeletons])
        began, read = time.perf_counter(), self.reader.bytes_read
        first = self.layer(0)
        loaded = time.perf_counter()

        def keep(module, args, output):
            batches.tuple_output = len(output) if isinstance(output, tuple) else 0
            assert batches.current is not None  # set before each batch's forward
            batches.hidden[batches.current] = output[0] if isinstance(output, tuple) else output
            if len(self.skeletons) == 1:
                raise _Stop  # nothing after it to note: no head, no logits

        hook = first.register_forward_hook(keep)
        batches.recording = True
        self.layers[0] = first
        for index in range(1, len(self.skeletons)):
            self.layers[index] = _StandIn(self.skeletons[index], batches, index)
        try:
            with self.no_grad(), self._watching() as watch:
                for start in range(0, windows.size(0), batch_size):
                    batches.current = start
                    watch(slice(start, min(start + batch_size, windows.size(0))))
                    try:
                        self.model(input_ids=windows[start:start + batch_size].to(self.device),
                                   use_cache=False)
                    except _Stop:  # the last stand-in has noted its arguments
                        pass
        finally:
            hook.remove()
            batches.current, batches.recording = None, False
            for index, skeleton in enumerate(self.skeletons):
                self.layers[index] = skeleton
            let_go(first)
        self._took(LayerTiming(0, self.reader.bytes_read - read, loaded - began,
                               time.perf_counter() - loaded))
        return batches

    def _run_layer(self, index: int, batches: _Batches) -> None:
        began, read = time.perf_counter(), self.reader.bytes_read
        layer = self.layer(index)
        loaded = time.perf_counter()
        try:
            with self.no_grad(), self._watching() as watch:
                for start, (args, kwargs) in batches.arguments[index].items():
                    hidden = batches.hidden[start]
                    watch(slice(start, start + hidden.size(0)))
                    output = layer(hidden, *args, **kwargs)
                    batches.hidden[start] = output[0] if isinstance(output, tuple) else output
        finally:  # an error (out of memory, say) must not keep the layer for the retry
            let_go(layer)
        self._took(LayerTiming(index, self.reader.bytes_read - read, loaded - began,
                               time.perf_counter() - loaded))

    @contextlib.contextmanager
    def _watching(self) -> Iterator[Callable[[slice], None]]:
        """The layer just read runs inside its watch (if any), which each batch's rows are
        told to: yields the function to tell them to."""
        watch, self.watch = self.watch, None
        if watch is None:
            yield lambda rows: None
            return
        with watch:
            yield watch.batch

    def _head(self, windows: torch.Tensor, batch_size: int, batches: _Batches,
              on_batch: Callable[[slice], None] | None) -> Iterator[LogProbSlice]:
        """The final norm and the head on the last layer's output (see the module)."""
        for index in range(len(self.skeletons)):
            self.layers[index] = _StandIn(self.skeletons[index], batches, index, final=index == 0)

        def batch_of(rows: slice) -> None:
            batches.current = rows.start
            if on_batch is not None:
                on_batch(rows)

        try:
            yield from sliced_log_probs(self.model, windows, batch_size, self.device,
                                        on_batch=batch_of)
        finally:
            batches.current = None
            for index, skeleton in enumerate(self.skeletons):
                self.layers[index] = skeleton


def layer_quantizer(backend: Backend, options: BackendOptions) -> LayerHook:
    """Each streamed decoder layer as ``backend`` quantizes it with ``options``: every module
    the backend selects replaced by its ``ModuleAlone`` quantization (with its own format from
    ``modules``), as the backend's whole-model ``quantize`` replaces it."""
    from quantdask.backends.per_module import module_options

    refusal = backend.stream_refusal()
    if refusal:
        raise UnsupportedHere(refusal)

    alone, selects = backend.has(ModuleAlone), backend.sizing.selects
    if alone is None or selects is None:
        raise UnsupportedHere(backend.refusal(ModuleAlone) or
                              f"{backend.name} does not say which modules it quantizes")

    def quantize_layer(layer: torch.nn.Module, prefix: str) -> torch.nn.Module:
        for name, module in list(layer.named_modules()):
            full = f"{prefix}.{name}"
            if not name or not selects(full, type(module), options):
                continue
            own = module_options(backend, options, full)
            if own is not None:
                parent, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, child,
                        alone.quantize(module, own))
        return layer

    return quantize_layer


@functools.cache
def _standin_class():
    import torch

    class StandIn(torch.nn.Module):
        """A decoder layer's place while the stack streams: it notes the arguments the
        model's forward gives the layer (``final``: returns the stack's output instead) and
        passes its input through; attributes the model reads of its layers (a layer's
        attention type) are the real layer's."""

        def __init__(self, skeleton, batches: _Batches, index: int, final: bool = False):
            super().__init__()
            self.skeleton = [skeleton]  # a list: not registered as a child module
            self.batches, self.index, self.final = batches, index, final

        def __getattr__(self, name: str):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.__dict__["skeleton"][0], name)

        def forward(self, *args, **kwargs):
            batches = self.batches
            hidden = args[0] if args else kwargs.pop("hidden_states")
            if batches.current is not None:
                if self.final:
                    hidden = batches.hidden[batches.current]
                elif batches.recording:
                    batches.arguments[self.index][batches.current] = (args[1:], kwargs)
                    if self.index == len(batches.arguments) - 1:
                        raise _Stop  # the first pass needs no final norm, head or logits
            if batches.tuple_output:
                return (hidden, *([None] * (batches.tuple_output - 1)))
            return hidden

    return StandIn


def _StandIn(skeleton, batches: _Batches, index: int, final: bool = False):  # noqa: N802
    return _standin_class()(skeleton, batches, index, final)


def let_go(layer: torch.nn.Module) -> None:
    """Free a dropped layer's memory now. Quantized layers hold reference cycles
    (bitsandbytes' parameters point back at their module) that only the cycle collector
    would free, late, and a full collection in a worker takes a third of a second: each module
    lets go of its tensors instead, so they go with their last reference. Then the freed heap
    goes back to the OS (glibc's ``malloc_trim``): a layer's tensors come from glibc's heap
    under its dynamic mmap threshold, and its free chunks would otherwise stay in the
    resident set a worker's memory limit counts."""
    import ctypes

    import torch

    for module in layer.modules():
        module._parameters.clear()
        module._buffers.clear()
        for name, value in list(vars(module).items()):
            if not name.startswith("_") and isinstance(value, torch.Tensor | dict):
                delattr(module, name)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


def _shared(model: torch.nn.Module) -> dict[tuple[str, ...], torch.nn.Parameter]:
    """Each parameter of ``model`` with every name it goes by (tied ones have two)."""
    names: dict[int, list[str]] = {}
    parameters = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
        parameters[id(parameter)] = parameter
    return {tuple(group): parameters[key] for key, group in names.items()}


def assign(root: torch.nn.Module, name: str, value: torch.Tensor, parameter: bool) -> None:
    """Put ``value`` in ``root`` under ``name`` (a parameter, or a buffer)."""
    import torch

    owner_name, _, leaf = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    if parameter:
        owner._parameters[leaf] = (value if isinstance(value, torch.nn.Parameter)
                                   else torch.nn.Parameter(value, requires_grad=False))
    else:
        owner._buffers[leaf] = value
