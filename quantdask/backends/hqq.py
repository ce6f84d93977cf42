"""HQQ (half-quadratic quantization): calibration-free grouped weight quantization, an optional
backend.

Install with ``pip install 'quantdask[hqq]'``. Every linear layer (``nn.Linear`` and its
subclasses, and GPT-2's ``Conv1D``, turned into the equivalent ``nn.Linear`` first) but the
skipped ones becomes an ``hqq`` ``HQQLinear`` whose scales and zeros HQQ's solver fits to the
weight; no data is needed. It runs on CPU and CUDA, in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantdask.backends.base import (
    Backend,
    HostWork,
    Sizing,
    missing_library,
    named_in,
    require_library,
    skip_label,
)
from quantdask.backends.capabilities import Dequantizes, ModuleAlone, Searchable
from quantdask.backends.options import LM_HEAD, BackendOptions, option, skip_modules_option
from quantdask.backends.per_module import (
    check_modules,
    mixed_label,
    module_format,
    modules_option,
    unknown_modules,
)
from quantdask.errors import SpecError, UnsupportedHere

BITS = (1, 2, 3, 4, 8)


MODULE_KEYS = ("bits", "group_size")  # what a module's own format may set (``modules``)


@dataclass(frozen=True)
class HqqOptions(BackendOptions):
    """HQQ's options."""

    bits: int | None = option(int, choices=BITS, help="bits per weight")
    group_size: int | None = option(int, choices=(16, 32, 64, 128, 256), default=64,
                                    help="weights sharing one scale and zero (default 64)")
    axis: int | None = option(
        int, choices=(0, 1), default=1,
        help="1 (default): groups along the input features; 0: along the outputs")
    skip_modules: tuple[str, ...] | None = skip_modules_option()
    modules: dict | None = modules_option(MODULE_KEYS)

    def complete(self) -> HqqOptions:
        return complete_options(self)


def complete_options(options: HqqOptions) -> HqqOptions:
    if options.bits is None:
        raise SpecError("bits", f"is required for hqq: one of {', '.join(map(str, BITS))}")
    check_modules(options, MODULE_KEYS)
    return options


def module_bits(name: str, options: HqqOptions) -> tuple[int, int] | None:
    """The (bits, group_size) module ``name`` is quantized with (``per_module``); None where
    ``modules`` keeps it unquantized."""
    own = module_format(name, options, MODULE_KEYS)
    return None if own is None else (own["bits"] or 0, own["group_size"] or 0)


def config_label(options: HqqOptions) -> str:
    label = f"hqq {options.bits}b g{options.group_size}"
    if options.axis != 1:
        label += f" axis{options.axis}"
    return label + mixed_label(options) + skip_label(options.skip_modules, LM_HEAD)


HQQ = ("hqq.core.quantize", "hqq", "'quantdask[hqq]'")  # module, name, what to install


def _is_linear(module_class: type) -> bool:
    import torch
    from transformers.pytorch_utils import Conv1D

    return issubclass(module_class, (torch.nn.Linear, Conv1D))


def selects(name: str, module_class: type, options: HqqOptions) -> bool:
    """Every linear layer (subclasses and ``Conv1D`` too) but the skipped modules and those
    ``modules`` keeps."""
    return (_is_linear(module_class) and not named_in(name, options.skip_modules)
            and module_bits(name, options) is not None)


def ungroupable(options: HqqOptions, sizes: dict[str, int]) -> str | None:
    """Why HQQ cannot group the weights of layers of these element counts (by name) with
    each one's group size, or None (HQQ groups the flattened weight: its size must be a
    multiple of the group)."""
    for name, size in sizes.items():
        _, group = module_bits(name, options) or (0, 0)
        if not group:  # Backend.normalize fills in the default
            return "hqq needs a group_size"
        if size % group:
            return (f"group_size={group} does not divide the {size:,} weights of {name}; choose "
                    "a group size that divides every layer's")
    return None


def check_hqq(options: HqqOptions, facts) -> str | None:
    """The driver's look before a sweep (``quantdask plan``): a reason it cannot run, or None."""
    missing = missing_library(*HQQ)
    if missing or not facts.weight_modules:  # unknown modules: the worker looks again
        return missing
    linears = {name for name, module_class, _ in facts.weight_modules
               if _is_linear(module_class) and not named_in(name, options.skip_modules)}
    return unknown_modules(options, linears, "hqq") or ungroupable(
        options, {name: size for name, module_class, size in facts.weight_modules
                  if selects(name, module_class, options)})


def _as_linear(module):
    """``module`` as an ``nn.Linear`` computing the same: itself, or for GPT-2's ``Conv1D``
    (which stores its weight as (in, out)) a Linear of the transposed weight."""
    import torch
    from transformers.pytorch_utils import Conv1D

    if not isinstance(module, Conv1D):
        return module
    in_features, out_features = module.weight.shape
    linear = torch.nn.Linear(in_features, out_features, bias=module.bias is not None,
                             device="meta")
    linear.weight = torch.nn.Parameter(module.weight.detach().t().contiguous(),
                                       requires_grad=False)
    if module.bias is not None:
        linear.bias = torch.nn.Parameter(module.bias.detach(), requires_grad=False)
    return linear


def quantize_hqq(source, options: HqqOptions, device: str):
    hqq = require_library(*HQQ)
    model = source.build(device)
    linears = {name for name, module in model.named_modules() if _is_linear(type(module))
               and not named_in(name, options.skip_modules)}
    targets = {name: module for name, module in model.named_modules()
               if selects(name, type(module), options)}
    reason = unknown_modules(options, linears, "hqq") or ungroupable(
        options, {name: m.weight.numel() for name, m in targets.items()})
    if reason:
        raise UnsupportedHere(reason)
    dtype = next(model.parameters()).dtype
    for name, module in targets.items():
        bits, group = module_bits(name, options) or (0, 0)
        config = hqq.BaseQuantizeConfig(nbits=bits, group_size=group, axis=options.axis)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = hqq.HQQLinear(_as_linear(module), config, compute_dtype=dtype, device=device,
                              del_orig=True)
        layer.source_cls = type(module)  # per-layer stats: how the checkpoint holds the weight
        setattr(parent, child, layer)
    return model


def quantize_module(module, options: HqqOptions):
    """One linear layer as the ``HQQLinear`` that ``quantize_hqq`` makes of it with
    ``options`` (a search's probe); ``module`` keeps its weight."""
    import torch

    hqq = require_library(*HQQ)
    linear = _as_linear(module)
    weight = linear.weight.detach()
    copy = torch.nn.Linear(weight.size(1), weight.size(0), bias=linear.bias is not None,
                           device="meta")
    copy.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    if linear.bias is not None:
        copy.bias = torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    reason = ungroupable(options, {"the layer": weight.numel()})
    if reason:
        raise UnsupportedHere(reason)
    config = hqq.BaseQuantizeConfig(nbits=options.bits, group_size=options.group_size,
                                    axis=options.axis)
    layer = hqq.HQQLinear(copy, config, compute_dtype=weight.dtype, device=str(weight.device),
                          del_orig=True)
    layer.source_cls = type(module)
    return layer


def weight_bits(options: HqqOptions, loaded_bits: int) -> float:
    """The model is loaded onto the device whole and then quantized layer by layer, so the
    peak holds the weights as loaded."""
    return float(loaded_bits)


def dequantize_layer(module):
    """An HQQ layer's weight as float32, (out, in); None for any other module."""
    try:
        from hqq.core.quantize import HQQLinear
    except ImportError:
        return None
    if not isinstance(module, HQQLinear):
        return None
    return module.dequantize().float()


hqq_backend = Backend(
    name="hqq",
    quantize=quantize_hqq,
    options=HqqOptions,
    label=config_label,
    check=check_hqq,
    # On a CPU slot HQQ's optimizer works on float copies of each layer's weights, and its
    # quantized layers are counted here too (benchmarks/slot_memory.py).
    sizing=Sizing(selects=selects, weight_bits=weight_bits,
                  host_work=lambda options: HostWork(3.5, 1.5, 5.5, imports=112 * 2**20)),
    # Not Savable: layer-by-layer HQQLinear models have no from_pretrained format.
    capabilities=(Dequantizes(dequantize_layer), ModuleAlone(quantize_module),
                  Searchable(MODULE_KEYS, unexported_why=(
                      "transformers' HqqConfig keys a mix by a linear's tag (self_attn.q_proj), "
                      "not by layer, so a per-layer mix cannot be declared for it to load"))),
    description="HQQ 1-8 bit grouped weights, calibration-free (optional: "
                "pip install 'quantdask[hqq]')",
)
