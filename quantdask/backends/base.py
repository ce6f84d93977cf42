"""What a quantization backend is: a small core (a name, the options it accepts, a quantize
function, a label, a plan-time check, its size accounting) plus the capabilities it has
(``capabilities``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, Generic, Protocol, TypeVar, cast

from quantdask.backends.capabilities import (
    Calibrated,
    Capability,
    Dequantizes,
    Lacks,
    ModuleAlone,
    OwnRuntime,
    Searchable,
    StreamedFit,
)
from quantdask.backends.options import BackendOptions, Option, options_class
from quantdask.errors import SpecError, UnsupportedHere
from quantdask.util import import_offline

if TYPE_CHECKING:
    import torch


def named_in(name: str, names: tuple[str, ...] | list[str] | None) -> bool:
    """Whether module ``name`` is one of ``names``: the same, inside one, or ending in one
    (``lm_head`` matches ``lm_head`` and ``model.lm_head``)."""
    if names is None:  # an unset skip_modules: its default is filled by Backend.normalize
        raise TypeError(f"no module names to match {name!r} against: normalize the options")
    return any(name == n or name.startswith(f"{n}.") or name.endswith(f".{n}") for n in names)


def require_library(module: str, name: str, install: str):
    """``module`` imported on this worker, or :class:`UnsupportedHere` saying how to install
    ``name`` (the job is skipped with that reason, not failed)."""
    try:
        return import_offline(module)  # (bitsandbytes would fetch a kernel as it imports)
    except ImportError as err:
        raise UnsupportedHere(f"{name} is not installed on this worker ({err}); "
                              f"pip install {install}") from err


def missing_library(module: str, name: str, install: str) -> str | None:
    """The driver's look (a backend's ``check``): why ``module`` cannot be imported, or None."""
    try:
        require_library(module, name, install)
    except UnsupportedHere as err:
        return str(err)
    return None


def skip_label(skip: tuple[str, ...] | None, default: tuple[str, ...] | None = None) -> str:
    """A config label's suffix naming the skipped modules, unless they are the default."""
    return "" if not skip or tuple(skip) == default else " skip=" + ",".join(skip)


class ModelSource(Protocol):
    """What a backend's hooks may call on the unquantized model they are given: its spec
    (``location``, ``trust_remote_code``), config, transformers class, tokenizer and dtype;
    ``build(device, quantization_config=None)`` a new model from the weights the job holds;
    ``empty_model()`` the model on the meta device."""

    spec: Any  # the sweep file's ModelSpec (a layer above this one)
    config: Any
    model_class: Any
    tokenizer: Any
    dtype: torch.dtype
    param_count: int

    def build(self, device: str, quantization_config: Any = None) -> torch.nn.Module: ...

    def empty_model(self) -> Any: ...


@dataclass(frozen=True)
class ModelFacts:
    """What the driver knows of a model without loading it (for ``Backend.check``)."""

    linear_in_features: dict[str, int]  # 2-D weight name (without .weight) -> input width
    weight_bytes: int  # the checkpoint's size on disk
    cuda: bool  # whether this machine has a CUDA GPU (where the plan assumes jobs run)
    checkpoint_bits: int = 16  # bits per weight as stored (float32: 32)
    loaded_bits: int = 16  # bits per weight once loaded (the model spec's dtype, else stored)
    vocab_size: int = 0  # the eval's logits are (batch, seq_len, vocab_size)
    # Every module holding a ``weight`` parameter: (name, class, weights in it), from the model
    # built on the meta device; and all the model's weights (tied ones once). Empty: unknown.
    weight_modules: tuple[tuple[str, type, int], ...] = ()
    fused_weights: tuple[str, ...] = ()  # 3-D parameters (fused experts), by full name
    param_count: int = 0
    # From config.json: the most positions it takes (None: its family sets no hard limit, or
    # unknown), and the shape of its KV cache (0: unknown), for the generation's memory.
    max_positions: int | None = None
    layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    model_type: str = ""  # config.json's (the family: "llama"); empty: unknown
    hidden_size: int = 0  # the width of the hidden states between decoder layers (0: unknown)
    tied_head: bool = False  # the output head is the embedding (config.json's tie_word_embeddings)


@dataclass(frozen=True)
class SavedQuantized:
    """A quantized model a backend saved (a :class:`StreamedFit`): its folder, the
    transformers quantization config to load it with (None: the one saved in it), and what
    to do to each loaded module after loading (``prepare(module)``; None: nothing)."""

    directory: str
    loading: Any = None
    prepare: Callable[[torch.nn.Module], None] | None = None


@dataclass(frozen=True)
class HostWork:
    """What a backend's job holds on a CPU slot beyond the weights (there the device is the
    host: the worker's RSS, which its nanny counts), in decoder layers as loaded: while it
    quantizes, while its quantized model runs forward (beside the eval's logits), and in a
    streamed pass (the layer read, its quantized copy and their working memory). Measured on
    two float32 llamas of 340 MB, with 6 and 24 layers (``benchmarks/slot_memory.py``,
    RESULTS.md section 18); the default, for a backend not measured, is above every one
    measured."""

    quantize: float = 4.0
    forward: float = 1.5
    streamed: float = 6.0
    # Whole-model copies as loaded, beside the read weights, while it quantizes: a backend
    # that tunes a copy of the model, or converts it to float32 to tune it (measured per
    # backend on a bf16 checkpoint, where that conversion is two copies).
    model_copies: float = 0.0
    # What a job holds per vocabulary entry beyond the tokenizer (GGUF: the converted file's
    # parsed header).
    bytes_per_token: int = 0
    # What importing its library adds to a worker that had not (its first job there pays
    # it, and the pages stay): measured, beside torch, transformers and bitsandbytes, which
    # every slot imports as it starts.
    imports: int = 0


OptionsT = TypeVar("OptionsT", bound=BackendOptions)
"""A backend's options dataclass: what its hooks receive."""

QuantizeFn = Callable[Concatenate["ModelSource", OptionsT, str, ...], "torch.nn.Module"]
"""quantize(source, options, device) -> a model ready for evaluation on ``device`` (a
calibrated backend's also takes ``calibration=``; see ``Backend.quantize``)."""


@dataclass(frozen=True)
class Sizing:
    """A backend's size accounting: what it quantizes and what that costs.

    ``quantizes``: False for a backend that is not a quantizer (the baseline). For one that
    is, an attempt whose model holds no quantized weight is skipped as unsupported in the
    coverage phase ("no layer was quantized"), and ``quantdask plan`` marks a config
    unsupported when ``selects`` picks nothing.

    ``selects(name, module_class, options) -> bool``: whether the backend quantizes the module
    ``name`` of class ``module_class`` (``ModelFacts.weight_modules``: the model built on the
    meta device); on the driver, for the plan's predicted quantized share. It should agree
    with what ``quantize`` replaces; the coverage phase measures the truth.

    ``stored_bytes(tensor) -> int``: what one tensor of the quantized model's ``state_dict``
    counts toward ``size_bytes`` and ``bits_per_weight``, for a layout that stores more than
    the weight needs (padding); default: the bytes it stores (``tensor_nbytes``).

    ``weight_bits(options, loaded_bits) -> float``: the bits one weight takes on the device at
    the job's peak, its scales and constants included, given the bits it is loaded at (the
    device-memory estimate placement and ``quantdask plan`` use until the job has a measured
    peak of its own); default: the weights stay as loaded.

    ``host_work(options) -> HostWork``: what a job of it holds beyond the weights on a CPU
    slot, where placement counts the worker's RSS (:class:`HostWork`); default ``HostWork()``."""

    quantizes: bool = True
    selects: Callable[[str, type, Any], bool] | None = None
    stored_bytes: Callable[[torch.Tensor], int] | None = None
    weight_bits: Callable[[Any, int], float] | None = None
    host_work: Callable[[Any], HostWork] | None = None

    def host(self, options: BackendOptions) -> HostWork:
        """``host_work(options)``, or the default."""
        return self.host_work(options) if self.host_work is not None else HostWork()

    def predicted_share(self, options: BackendOptions, facts: ModelFacts) -> float | None:
        """The share of the model's weights this config will quantize, from the modules
        ``selects(name, module_class, options)`` picks (None: unknown)."""
        if not self.quantizes:
            return 0.0
        if self.selects is None or not facts.weight_modules or not facts.param_count:
            return None
        picked = sum(n for name, cls, n in facts.weight_modules
                     if self.selects(name, cls, options))
        return picked / facts.param_count


UNQUANTIZED = Sizing(quantizes=False, host_work=lambda options: HostWork(0.0, 0.0, 0.5))
"""The sizing of a backend that quantizes nothing (the baseline)."""

CapabilityT = TypeVar("CapabilityT", bound=Capability)


@dataclass(frozen=True)
class Backend(Generic[OptionsT]):
    """A quantization backend registered under ``name`` (``register_backend``): a small core
    (its options, a ``quantize`` function, a label, a plan-time check and its size accounting)
    plus the :mod:`~quantdask.backends.capabilities` it has (calibration, per-layer weights,
    the search's one-module quantization, a streamed fit, saving).

    When: at spec time, on the driver, as a sweep is built (``Sweep``, ``load_sweep``), before
    anything runs: ``options`` (and its ``complete``) check and complete each config, ``label``
    names it. At plan time, on the driver: ``check`` and ``sizing`` (``quantdask plan``, the
    device-memory estimate every sweep places its jobs by). On a worker, in the phases of each
    attempt (``job.phases.PHASES``): ``quantize`` (quantize), ``sizing`` (coverage), and each
    capability where it applies.

    What an exception does on the worker (``job.job.not_done_record``; the same for one the
    later phases meet in the returned model, its forward included): :class:`UnsupportedHere`
    (a missing library, a shape it cannot take, needs CUDA) and ``NotImplementedError`` (the
    library has no kernel or op for this layer or tensor) record the job ``skipped`` with the
    reason, never retried; an allocation failure (``MemoryError``,
    ``torch.cuda.OutOfMemoryError``) is ``out_of_memory``, retried on a whole device with half
    the eval batch; anything else is ``job_error``, retried with backoff up to the sweep's
    ``retries``, then recorded ``failed`` with its traceback. An attempt past the sweep's
    ``timeout_s`` fails as ``timeout`` (its worker is restarted). A bad config is found
    earlier: a :class:`SpecError` at spec time refuses the sweep.

    The driver sends the backend with every attempt, pickled by cloudpickle: hooks are plain
    functions (a notebook's travel by value) that import their heavy libraries inside
    (``require_library``: an install hint, and the job skipped where it is missing).

    >>> register_backend(Backend("rtn", round_to_nearest, options=RtnOptions))  # doctest: +SKIP
    """

    name: str
    """The registry key: what a sweep's ``backend:`` names, the prefix of its job ids and part of
    what they hash (renaming a backend changes its jobs' ids)."""

    quantize: QuantizeFn[OptionsT]
    """``quantize(source, options, device) -> torch.nn.Module``: the quantized model on
    ``device``, in eval mode. Called on the worker in the quantize phase of every attempt (its
    time is ``quantize_s``; its peak memory counts in the job's).

    ``source`` is the model's :class:`ModelSource`: ``source.build(device,
    quantization_config=None)`` makes a new model from the weights the job holds (a
    transformers ``quantization_config`` quantizes as it loads); ``source.tokenizer``,
    ``.config``, ``.dtype`` and ``.spec`` (the model spec) are there too. Replace the built
    model's weights, never write into them: they are the originals coverage and the per-layer
    errors compare against, shared with jobs packed beside it. ``options`` is the completed
    option set (an ``options`` instance); ``device`` is torch's (``cuda:0``, ``cpu``). The
    model returned is what every later phase measures: a transformers causal LM
    (``model(input_ids=...).logits``; ``generate`` for speed, lm-eval's ``HFLM`` for tasks).
    Raise :class:`UnsupportedHere` for a config this worker cannot run. A :class:`Calibrated`
    backend's is called with ``calibration=`` too."""

    options: type[OptionsT] | type[BackendOptions] | Mapping[str, Option] = BackendOptions
    """The options a config may give: a frozen dataclass subclassing :class:`BackendOptions`,
    a field per option made by ``option(...)`` (type, choices, check, default, help), whose
    ``complete()`` rejects impossible combinations and fills the defaults that depend on other
    options; or a dict of name -> :class:`Option`, made into one. Once built, ``options`` is
    the dataclass (``option_specs`` the name -> :class:`Option` mapping). ``normalize`` checks
    each config against it at spec time: an unknown option or a bad value is a
    :class:`SpecError` naming it (``backends[0].grid.bits``). A completed option set's
    ``as_dict()`` is hashed into the job id and is the results' ``config``."""

    label: Callable[[OptionsT], str] | None = None
    """``label(options) -> str``: the config's short name for people (``nf4 dq``,
    ``int8 t=6``): the results' ``config_label``, shown by tables, charts and logs and matched
    by a sweep's ``faults`` and ``handle.logs``. Called at spec time; not in the job id.
    Default: the set options as ``k=v``, else the backend's name."""

    check: Callable[[OptionsT, ModelFacts], str | None] | None = None
    """``check(options, facts) -> str | None``: why the config cannot run here (a missing
    library: ``missing_library``; a layer shape it cannot take here), or None. Called on
    the driver by ``quantdask plan`` (``plan.planning.plan_sweep``) for each job, with the
    :class:`ModelFacts` read from the model's files (nothing loaded): a reason marks the job
    ``unsupported`` in the plan. Cheap, and it should not raise. The worker still decides: a
    sweep runs the job anyway, and ``quantize`` raises :class:`UnsupportedHere` there."""

    sizing: Sizing = Sizing()
    """What it quantizes and what that costs (:class:`Sizing`)."""

    capabilities: tuple[Capability | Lacks, ...] = ()
    """The capabilities it has, and those it lacks with the reason (:class:`Lacks`)."""

    description: str = ""
    """One line for people: what the backend does, and how to install its library."""

    def __post_init__(self):
        declared = self.options
        if isinstance(declared, type) and issubclass(declared, BackendOptions):
            kind = declared
        elif isinstance(declared, Mapping) and not declared:
            kind = BackendOptions
        else:
            kind = options_class(self.name, declared)
        object.__setattr__(self, "options", kind)
        if self.has(Searchable) and not (self.probe_quantizer() and self.has(Dequantizes)):
            raise TypeError(f"backend {self.name!r}: a Searchable backend also quantizes one "
                            "module alone (ModuleAlone, or its Searchable.proxy) and gives its "
                            "weight back (Dequantizes)")

    def probe_quantizer(self) -> ModuleAlone | None:
        """What a search's probes quantize one module with: the search's stated proxy
        (``Searchable.proxy``) where the backend has one, else its :class:`ModuleAlone`."""
        searchable = self.has(Searchable)
        proxy = searchable.proxy if searchable is not None else None
        return proxy or self.has(ModuleAlone)

    @property
    def options_type(self) -> type[OptionsT]:
        """The options dataclass (what ``options`` holds once built)."""
        return cast("type[OptionsT]", self.options)

    @property
    def option_specs(self) -> dict[str, Option]:
        """Each option's name and :class:`Option`."""
        return self.options_type.declared()

    def has(self, kind: type[CapabilityT]) -> CapabilityT | None:
        """The capability of class ``kind`` this backend has, or None."""
        return next((c for c in self.capabilities if isinstance(c, kind)), None)

    def refusal(self, kind: type[Capability]) -> str | None:
        """None when this backend has capability ``kind``; else the capability's refusal, with
        the reason this backend gives (:class:`Lacks`) or the capability's usual one."""
        if self.has(kind) is not None:
            return None
        why = next((c.why for c in self.capabilities
                    if isinstance(c, Lacks) and c.capability is kind), kind.usual_why)
        return kind.refusal(self.name, why)

    @property
    def calibrated(self) -> bool:
        """Whether it calibrates on data (:class:`Calibrated`), with some config at least."""
        return self.has(Calibrated) is not None

    def calibrates(self, options: BackendOptions) -> bool:
        """Whether its config ``options`` calibrates on data (``Calibrated.when``)."""
        found = self.has(Calibrated)
        return found is not None and (found.when is None or found.when(options))

    @property
    def module_keys(self) -> tuple[str, ...]:
        """The options each module may set of its own (:class:`Searchable`; none without)."""
        found = self.has(Searchable)
        return found.module_keys if found is not None else ()

    def stream_refusal(self, model_type: str = "") -> str | None:
        """Why this backend cannot quantize a streamed ``model_type`` model's layers one at a
        time (``stream.streaming``), or None: it quantizes each module alone
        (:class:`ModuleAlone`), fits block by block from the checkpoint (:class:`StreamedFit`,
        on the families it names), or quantizes nothing at all."""
        runtime = self.has(OwnRuntime)
        if runtime is not None:
            return StreamedFit.refusal(self.name, f"its jobs run in {runtime.runtime}, which "
                                                  "loads the whole file")
        if not self.sizing.quantizes or self.has(ModuleAlone) is not None:
            return None
        fit = self.has(StreamedFit)
        if fit is not None:
            return fit.family_refusal(self.name, model_type)
        given = next((c.why for c in self.capabilities
                      if isinstance(c, Lacks) and c.capability is StreamedFit), None)
        usual = StreamedFit.calibrated_why if self.calibrated else StreamedFit.usual_why
        return StreamedFit.refusal(self.name, given or usual)

    def normalize(self, options: dict, where: str) -> OptionsT:
        """Validate ``options`` (a config as written) and fill defaults: the canonical option
        set, an ``options`` instance (its ``as_dict()`` is what job ids hash).

        >>> from quantdask.backends import get_backend
        >>> get_backend("hqq").normalize({"bits": 4}, "options")
        HqqOptions(bits=4, group_size=64, axis=1, skip_modules=('lm_head',), modules=None)
        """
        if not isinstance(options, dict):
            raise SpecError(where, f"must be a mapping of option to value, got {options!r}")
        kind, declared = self.options_type, self.option_specs
        unknown = sorted(set(options) - set(declared))
        if unknown:
            allowed = (f"allowed: {', '.join(declared)}" if declared
                       else "it takes no options")
            raise SpecError(f"{where}.{unknown[0]}",
                            f"unknown option for backend {self.name!r}; {allowed}")
        resolved = {}
        for name, spec in declared.items():
            if name in options:
                resolved[name] = spec.validate(f"{where}.{name}", options[name])
            elif spec.default is not None:
                resolved[name] = spec.default
        try:
            completed = kind(**resolved).complete()
        except SpecError as err:
            raise SpecError(f"{where}.{err.field}", err.message) from None
        if isinstance(completed, BackendOptions):
            return completed
        return kind(**completed)  # a complete written against dicts returns one

    def config_label(self, options: OptionsT) -> str:
        if self.label is not None:
            return self.label(options)
        return " ".join(f"{k}={v}" for k, v in options.as_dict().items()) or self.name


def tensor_nbytes(tensor) -> int:
    """Bytes a tensor stores; for a tensor subclass (torchao), the sum of its inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(tensor, n)) for n in names
                   if getattr(tensor, n) is not None)
    return tensor.numel() * tensor.element_size()
