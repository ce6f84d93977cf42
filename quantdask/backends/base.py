"""What a quantization backend is: a name, the options it accepts, and a quantize function."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, Generic, TypeVar

from quantdask.backends.options import BackendOptions, Option, options_class
from quantdask.errors import SpecError, UnsupportedHere
from quantdask.util import import_offline

if TYPE_CHECKING:
    import torch

    from quantdask.process.model_source import ModelSource


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


OptionsT = TypeVar("OptionsT", bound=BackendOptions)
"""A backend's options dataclass: what its hooks receive."""

QuantizeFn = Callable[Concatenate["ModelSource", OptionsT, str, ...], "torch.nn.Module"]
"""quantize(source, options, device) -> a model ready for evaluation on ``device`` (a
calibrated backend's also takes ``calibration=``; see ``Backend.quantize``)."""


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
    param_count: int = 0
    # From config.json: the most positions it takes (None: its family sets no hard limit, or
    # unknown), and the shape of its KV cache (0: unknown), for the generation's memory.
    max_positions: int | None = None
    layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    model_type: str = ""  # config.json's (the family: "llama"); empty: unknown
    hidden_size: int = 0  # the width of the hidden states between decoder layers (0: unknown)


@dataclass(frozen=True)
class SavedQuantized:
    """A quantized model a backend saved (``Backend.quantize_streamed``): its folder, the
    transformers quantization config to load it with (None: the one saved in it), and what
    to do to each loaded module after loading (``prepare(module)``; None: nothing)."""

    directory: str
    loading: Any = None
    prepare: Callable[[torch.nn.Module], None] | None = None


@dataclass(frozen=True)
class Backend(Generic[OptionsT]):
    """A quantization backend registered under ``name`` (``register_backend``): the options it
    accepts, a ``quantize`` function, and optional hooks, each documented below with what it
    receives, returns and may raise, and when it is called. Every hook but ``quantize`` may be
    left out.

    When: at spec time, on the driver, as a sweep is built (``Sweep``, ``load_sweep``), before
    anything runs: ``options`` and ``complete`` check and complete each config, ``label``
    names it, ``calibrated`` asks for a calibration block. At plan time, on the driver:
    ``check`` and ``selects`` (``quantdask plan``), ``weight_bits`` (the device-memory
    estimate, also made when every sweep places its jobs). On a worker, in the phases of each
    attempt (``job.phases.PHASES``): ``quantize`` (quantize), ``quantizes`` and
    ``stored_bytes`` (coverage), ``dequantize_layer`` (layer weights), ``saves`` and
    ``prepare_save`` (artifacts).

    What an exception does on the worker (``job.job.not_done_record``; the same for one
    the later phases meet in the returned model, its forward included):
    :class:`UnsupportedHere` (a missing library, a shape it cannot take, needs CUDA) and
    ``NotImplementedError`` (the library has no kernel or op for this layer or tensor) record
    the job ``skipped`` with the reason, never retried; an allocation failure
    (``MemoryError``, ``torch.cuda.OutOfMemoryError``) is ``out_of_memory``, retried on a
    whole device with half the eval batch; anything else is ``job_error``, retried with
    backoff up to the sweep's ``retries``, then recorded ``failed`` with its traceback. An
    attempt past the sweep's ``timeout_s`` fails as ``timeout`` (its worker is restarted). A
    bad config is found earlier: a :class:`SpecError` at spec time refuses the sweep.

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

    ``source`` is the model's :class:`~quantdask.process.model_source.ModelSource`:
    ``source.build(device, quantization_config=None)`` makes a new model from the weights the
    job holds (a transformers ``quantization_config`` quantizes as it loads);
    ``source.tokenizer``, ``.config``, ``.dtype`` and ``.spec`` (the model spec) are there
    too. Replace the built model's weights, never write into them: they are the originals
    coverage and the per-layer errors compare against, shared with jobs packed beside it.
    ``options`` is the completed option set (an ``options_type`` instance); ``device`` is
    torch's (``cuda:0``, ``cpu``). The model returned is what every later phase measures: a
    transformers causal LM (``model(input_ids=...).logits``; ``generate`` for speed, lm-eval's
    ``HFLM`` for tasks). Raise :class:`UnsupportedHere` for a config this worker cannot run.

    A ``calibrated`` backend's is called with ``calibration=`` too, a
    :class:`~quantdask.measure.calibration.Calibration`: ``calibration.windows`` (samples x
    seq_len token ids, cut once per model with its reference), and ``with
    calibration.measure():`` to wrap the data-driven step in (``calibrate_s`` and its peaks).
    """

    options: type[OptionsT] | type[BackendOptions] | Mapping[str, Option] = BackendOptions
    """The options a config may give: a frozen dataclass subclassing :class:`BackendOptions`,
    a field per option made by ``option(...)`` (type, choices, check, default, help); or a
    dict of name -> :class:`Option`, made into one. Once built, ``options`` is the name ->
    :class:`Option` mapping and ``options_type`` the dataclass. ``normalize`` checks each
    config against it at spec time: an unknown option or a bad value is a :class:`SpecError`
    naming it (``backends[0].grid.bits``). A completed option set's ``as_dict()`` is hashed
    into the job id and is the results' ``config``."""

    complete: Callable[[OptionsT], OptionsT] | None = None
    """``complete(options) -> options``: reject impossible combinations, raising
    :class:`SpecError` named as in the config (``SpecError("group_size", "...")``; ``normalize``
    prefixes where it is), and fill defaults that depend on other options
    (``options.with_defaults(...)``). Called at spec time, after each option is checked and the
    declared defaults filled; what it returns is what every other hook receives and the job id
    hashes, so it must be deterministic. One written against dicts may return a dict."""

    label: Callable[[OptionsT], str] | None = None
    """``label(options) -> str``: the config's short name for people (``nf4 dq``,
    ``int8 t=6``): the results' ``config_label``, shown by tables, charts and logs and matched
    by a sweep's ``faults`` and ``handle.logs``. Called at spec time; not in the job id.
    Default: the set options as ``k=v``, else the backend's name."""

    dequantize_layer: Callable[[torch.nn.Module], torch.Tensor | None] | None = None
    """``dequantize_layer(module) -> Tensor | None``: a layer's quantized weight dequantized to
    float, (out_features, in_features); None for a module the backend left alone. Called on
    the worker in the layer-weights phase, before the model's first forward pass (kernels may
    repack weights then), for each module whose ``<name>.weight`` the unquantized model has,
    when the sweep's ``layer_stats`` is on. A layer that replaced one the checkpoint stores
    transposed (GPT-2's ``Conv1D``) keeps that class as ``source_cls``. An exception costs only
    that layer (logged, counted in ``layers_unmeasured``), never the job. The layers it
    measures are those whose output error the score phase takes too: without this hook a
    backend's jobs have no per-layer rows."""

    check: Callable[[OptionsT, ModelFacts], str | None] | None = None
    """``check(options, facts) -> str | None``: why the config cannot run here (a missing
    library: ``missing_library``; a layer shape it cannot take here), or None. Called on
    the driver by ``quantdask plan`` (``plan.planning.plan_sweep``) for each job, with the
    :class:`ModelFacts` read from the model's files (nothing loaded): a reason marks the job
    ``unsupported`` in the plan. Cheap, and it should not raise. The worker still decides: a
    sweep runs the job anyway, and ``quantize`` raises :class:`UnsupportedHere` there."""

    weight_bits: Callable[[OptionsT, int], float] | None = None
    """``weight_bits(options, loaded_bits) -> float``: the bits one weight takes on the device
    at the job's peak, its scales and constants included, given the bits it is loaded at (a
    backend that loads the whole model before quantizing it returns ``loaded_bits``). Called on
    the driver by the device-memory estimate (``plan.placement``) that ``quantdask plan``
    shows and each sweep places its jobs by, until the job has a measured peak of its own.
    Default (None): the weights stay as loaded."""

    description: str = ""
    """One line for people: what the backend does, and how to install its library."""

    quantizes: bool = True
    """False for a backend that is not a quantizer (the baseline). For one that is, an attempt
    whose model holds no quantized weight is skipped as unsupported in the coverage phase ("no
    layer was quantized"), and ``quantdask plan`` marks a config unsupported when ``selects``
    picks nothing."""

    selects: Callable[[str, type, OptionsT], bool] | None = None
    """``selects(name, module_class, options) -> bool``: whether the backend quantizes the
    module ``name`` of class ``module_class`` (``ModelFacts.weight_modules``: the model built
    on the meta device). Called on the driver by ``quantdask plan`` for the predicted quantized
    share (``predicted_share``); without it the share is unknown. It should agree with what
    ``quantize`` replaces; the coverage phase measures the truth."""

    stored_bytes: Callable[[torch.Tensor], int] | None = None
    """``stored_bytes(tensor) -> int``: what one tensor of the quantized model's
    ``state_dict`` counts toward ``size_bytes`` and ``bits_per_weight``, for a layout that
    stores more than the weight needs (padding). Called on the worker in the coverage phase,
    once per tensor. Default (None): the bytes it stores (``tensor_nbytes``)."""

    calibrated: bool = False
    """True for a backend that fits its quantization to data (AutoRound, GPTQ, AWQ): a sweep
    with it needs a ``calibration`` block (a :class:`SpecError` otherwise), the calibration
    settings join its jobs' ids, and ``quantize`` is called with ``calibration=``."""

    saves: bool = True
    """Whether the quantized model saves with ``save_pretrained`` and reloads with
    transformers' ``AutoModelForCausalLM.from_pretrained``. Read on the worker in the artifacts
    phase, which runs only when the sweep keeps artifacts: False is recorded as the job's
    ``artifact_error`` ("no save format"), as a failed save or reload is; the job keeps its
    result unless ``artifacts.required``, which raises it (classified as above)."""

    prepare_save: Callable[[torch.nn.Module], None] | None = None
    """``prepare_save(model) -> None``: put the quantized model, in place, in the state
    ``save_pretrained`` must see (bitsandbytes: 4-bit weights repacked for the CPU, unpacked).
    Called on the worker in the artifacts phase, just before the save, after every
    measurement of the model. An exception is recorded as a failed save."""

    quantize_module: Callable[[torch.nn.Module, OptionsT], torch.nn.Module] | None = None
    """``quantize_module(module, options) -> module``: one linear layer quantized alone, as
    ``quantize`` would quantize it with ``options``, on the layer's device, leaving ``module``
    as it was. Called on the worker by a mixed-precision search's probes, for each (unit,
    format) cell: ``dequantize_layer`` gives the weight the probe swaps in, and the returned
    module's state the cell's stored bytes. Backends without it cannot be searched (the
    search is refused before it runs, with ``unsearchable``)."""

    quantize_streamed: Callable[..., Any] | None = None
    """``quantize_streamed(source, options, device, calibration, directory) ->
    SavedQuantized``: a calibrated backend's fit made block by block from the checkpoint
    (never the whole model in memory), its quantized model saved in a folder under
    ``directory``, and how to load it. Called on the worker by a streamed job
    (``stream.streamed_job``), which then reads the saved layers one at a time
    (``stream.saved_layers``). Without it (and ``quantize_module``) the backend cannot
    quantize a streamed model (``stream_refusal``)."""

    stream_families: tuple[str, ...] = ()
    """With ``quantize_streamed``: the families (``model_type``) its streamed fit is checked
    on; others are refused for streaming, with the reason (empty: every family)."""

    not_streamable: str = ""
    """Without ``quantize_module`` or ``quantize_streamed``: why it cannot quantize a streamed
    model (``stream_refusal``; a general reason when empty)."""

    module_keys: tuple[str, ...] = ()
    """With ``quantize_module``: the options a module's own format sets in the ``modules``
    option (``backends.per_module``), which a search's candidates give each module."""

    unsearchable: str = ""
    """Without ``quantize_module``: why a mixed-precision search cannot use this backend."""

    options_type: type[OptionsT] | None = None
    """The options dataclass, set from ``options`` (not given)."""

    def __post_init__(self):
        declared = self.options
        if isinstance(declared, type) and issubclass(declared, BackendOptions):
            kind = declared
        elif self.options_type is not None and self.options_type.declared() == declared:
            kind = self.options_type  # dataclasses.replace(backend, ...): the same options
        elif isinstance(declared, Mapping) and not declared:
            kind = BackendOptions
        else:
            kind = options_class(self.name, declared)
        object.__setattr__(self, "options_type", kind)
        object.__setattr__(self, "options", kind.declared())

    def predicted_share(self, options: OptionsT, facts: ModelFacts) -> float | None:
        """The share of the model's weights this config will quantize, from the modules
        ``selects(name, module_class, options)`` picks (None: unknown)."""
        if not self.quantizes:
            return 0.0
        if self.selects is None or not facts.weight_modules or not facts.param_count:
            return None
        picked = sum(n for name, cls, n in facts.weight_modules
                     if self.selects(name, cls, options))
        return picked / facts.param_count

    def stream_refusal(self, model_type: str = "") -> str | None:
        """Why this backend cannot quantize a streamed ``model_type`` model's layers one at a
        time (``stream.streaming``), or None: it quantizes each module alone
        (``quantize_module``), fits block by block from the checkpoint (``quantize_streamed``,
        on ``stream_families`` when it names them; an unknown family passes here, and the
        worker checks), or quantizes nothing at all."""
        if not self.quantizes or self.quantize_module is not None:
            return None
        if self.quantize_streamed is not None:
            if model_type and self.stream_families and model_type not in self.stream_families:
                return (f"{self.name}'s block-by-block fit from the checkpoint is checked on "
                        f"the families {', '.join(self.stream_families)}, not {model_type!r}")
            return None
        why = self.not_streamable or (
            "it calibrates each layer on the activations of the layers quantized before it, "
            "which the stream does not carry block by block yet" if self.calibrated
            else "it quantizes whole models only")
        return f"{self.name} cannot quantize a streamed model, one layer at a time: {why}"

    def normalize(self, options: dict, where: str) -> OptionsT:
        """Validate ``options`` (a config as written) and fill defaults: the canonical option
        set, an ``options_type`` instance (its ``as_dict()`` is what job ids hash).

        >>> from quantdask.backends import get_backend
        >>> get_backend("hqq").normalize({"bits": 4}, "options")
        HqqOptions(bits=4, group_size=64, axis=1, skip_modules=('lm_head',), modules=None)
        """
        if not isinstance(options, dict):
            raise SpecError(where, f"must be a mapping of option to value, got {options!r}")
        kind, declared = self.options_type, self.options
        if kind is None or not isinstance(declared, Mapping):  # both set by __post_init__
            raise TypeError(f"backend {self.name!r} has no options set up; make it with Backend()")
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
        typed = kind(**resolved)
        if self.complete is None:
            return typed
        try:
            completed = self.complete(typed)
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
