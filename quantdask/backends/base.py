"""What a quantization backend is: a name, the options it accepts, and a quantize function."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quantdask.backends.options import BackendOptions, Option, options_class
from quantdask.errors import SpecError, UnsupportedHere

if TYPE_CHECKING:
    import torch

    from quantdask.worker.model_source import ModelSource


def named_in(name: str, names: tuple[str, ...] | list[str]) -> bool:
    """Whether module ``name`` is one of ``names``: the same, inside one, or ending in one
    (``lm_head`` matches ``lm_head`` and ``model.lm_head``)."""
    return any(name == n or name.startswith(f"{n}.") or name.endswith(f".{n}") for n in names)


def require_library(module: str, name: str, install: str):
    """``module`` imported on this worker, or :class:`UnsupportedHere` saying how to install
    ``name`` (the job is skipped with that reason, not failed)."""
    try:
        return importlib.import_module(module)
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


QuantizeFn = Callable[["ModelSource", BackendOptions, str], "torch.nn.Module"]
"""quantize(source, options, device) -> a model ready for evaluation on ``device``."""


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


@dataclass(frozen=True)
class Backend:
    """A quantization backend registered under ``name``.

    ``options`` declares every accepted option: a frozen dataclass subclassing
    :class:`BackendOptions` (or, as backends of one's own may, a dict of name to :class:`Option`,
    made into one); once built, ``options`` is the name -> :class:`Option` mapping and
    ``options_type`` the dataclass, whose instances (the canonical option sets, from
    ``normalize``) every function below receives. ``complete`` rejects impossible combinations
    (raise :class:`SpecError` naming the option) and fills defaults that depend on other options;
    ``label`` makes a short human name for a config; ``dequantize_layer(module)`` returns a
    quantized layer's weight dequantized to float (None for a module it did not quantize), for
    per-layer error: a backend without it gets no per-layer rows. ``check(options, facts)``
    is a cheap look on the driver before a sweep (``quantdask plan``): the reason a config
    cannot run here (a missing library, a shape it cannot take), or None; the worker still
    decides (raising :class:`UnsupportedHere`). ``weight_bits(options, loaded_bits)`` is what a
    weight takes on the device at the job's peak, scales included, given the bits it is loaded
    at (the device-memory estimate; None: weights stay as loaded). A job of a backend that
    ``quantizes`` but leaves every weight in full precision is skipped as unsupported.
    ``selects(name, module_class, options)`` says whether the backend quantizes a module of
    that name and class, which lets ``quantdask plan`` predict the quantized share.
    ``stored_bytes(tensor)`` is what one of the backend's tensors counts toward ``size_bytes``
    when a layout stores more than the weight needs (padding: None counts what is stored).
    A ``calibrated`` backend fits its quantization to data: a sweep of it needs a
    ``calibration`` block, and its ``quantize`` is called with ``calibration=``, a
    :class:`~quantdask.worker.calibration.Calibration` holding the token windows and the block to
    time its data-driven step in (``calibrate_s``). ``prepare_save(model)`` puts a quantized
    model (in memory) in the state ``save_pretrained`` must see, just before an artifact is
    saved (bitsandbytes: its 4-bit weights repacked for the CPU, unpacked).
    """

    name: str
    quantize: QuantizeFn
    options: type[BackendOptions] | Mapping[str, Option] = BackendOptions
    complete: Callable[[BackendOptions], BackendOptions] | None = None
    label: Callable[[BackendOptions], str] | None = None
    dequantize_layer: Callable[[torch.nn.Module], torch.Tensor | None] | None = None
    check: Callable[[BackendOptions, ModelFacts], str | None] | None = None
    weight_bits: Callable[[BackendOptions, int], float] | None = None
    description: str = ""
    quantizes: bool = True  # False for the baseline: a job that quantized nothing is fine there
    selects: Callable[[str, type, BackendOptions], bool] | None = None
    stored_bytes: Callable[[torch.Tensor], int] | None = None
    calibrated: bool = False  # quantize(..., calibration=) gets the sweep's calibration data
    saves: bool = True  # its models save with save_pretrained and reload with from_pretrained
    prepare_save: Callable[[torch.nn.Module], None] | None = None
    options_type: type[BackendOptions] | None = None  # set from ``options``

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

    def normalize(self, options: dict, where: str) -> BackendOptions:
        """Validate ``options`` (a config as written) and fill defaults: the canonical option
        set, an ``options_type`` instance (its ``as_dict()`` is what job ids hash).

        >>> from quantdask.backends import get_backend
        >>> get_backend("hqq").normalize({"bits": 4}, "options")
        HqqOptions(bits=4, group_size=64, axis=1, skip_modules=('lm_head',))
        """
        if not isinstance(options, dict):
            raise SpecError(where, f"must be a mapping of option to value, got {options!r}")
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            allowed = ", ".join(self.options) or "none"
            raise SpecError(f"{where}.{unknown[0]}",
                            f"unknown option for backend {self.name!r}; allowed: {allowed}")
        resolved = {}
        for name, spec in self.options.items():
            if name in options:
                resolved[name] = spec.validate(f"{where}.{name}", options[name])
            elif spec.default is not None:
                resolved[name] = spec.default
        typed = self.options_type(**resolved)
        if self.complete is None:
            return typed
        try:
            completed = self.complete(typed)
        except SpecError as err:
            raise SpecError(f"{where}.{err.field}", err.message) from None
        if isinstance(completed, BackendOptions):
            return completed
        return self.options_type(**completed)  # a complete written against dicts returns one

    def config_label(self, options: BackendOptions) -> str:
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
