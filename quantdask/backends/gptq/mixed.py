"""GPTQ mixes: bits and group size per module (the ``modules`` option, which a search's
allocations give), fitted by gptqmodel with its ``dynamic`` config and saved as one checkpoint
that ``GPTQModel.load`` (and vLLM) loads. Plain transformers ``from_pretrained`` refuses such a
checkpoint: it builds every layer at the config's one bits and group size, and the mixed layers'
tensors do not fit them (checked on transformers 5.25 and gptqmodel 7.6.0: "size mismatch").

A search cannot probe GPTQ itself (each layer is fitted on the outputs of the layers quantized
before it), so its probes use a stated proxy: round-to-nearest at the same bits and group size,
symmetric as gptqmodel's quantizer rounds (scales stored in half precision), holding the bytes
the checkpoint stores for the layer.

>>> gptq_layer_bytes(in_features=256, out_features=512, bits=4, group_size=128)
69120
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from quantdask.backends.packed import dequantize_packed_layer
from quantdask.backends.per_module import (
    expert_projections,
    fused_expert_params,
    module_format,
)

if TYPE_CHECKING:
    import torch

MODULE_KEYS = ("bits", "group_size")

SHIPS_AS = ("one checkpoint, the verifying job's artifact (artifacts: {keep: done}), with "
            "gptqmodel's dynamic bits and group size per module: it loads with GPTQModel.load "
            "and vLLM, not with plain transformers from_pretrained, which reads one bits and "
            "group size for the whole model")

UNEXPORTED = ("a GPTQ mix is fitted on the calibration data, not written from the allocation: "
              "its checkpoint is the verifying job's artifact (artifacts: {keep: done})")

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""The linears vLLM runs as one fused layer (its ``qkv_proj`` and ``gate_up_proj``), which
take one bits and group size: a GPTQ search ties them unless its ``tie`` says otherwise."""

PROXY = "round-to-nearest at the same bits and group size, a proxy for GPTQ's fit"


def dynamic_config(options) -> dict[str, dict[str, int]] | None:
    """gptqmodel's ``dynamic`` for ``options.modules``: each module's full name (an exact
    pattern) to its bits and group size; a layer's fused experts (``search.members``) as a
    pattern of the per-expert linears gptqmodel quantizes them as (defuser's
    ``experts.3.gate_proj``), so every expert of the layer takes the same."""
    modules = options.modules or {}
    return {_dynamic_key(name): dict(module_format(name, options, MODULE_KEYS) or {})
            for name in sorted(modules)} or None


def _dynamic_key(name: str) -> str:
    """A module's ``dynamic`` key: its name, or for fused experts a positive pattern (``+:``)
    matching each expert's linears."""
    import re

    experts = expert_projections(name)
    if experts is None:
        return name
    module, projections = experts
    return f"+:^{re.escape(module)}\\.\\d+\\.({'|'.join(projections)})$"


def mixable(linears: set[str], options, model=None) -> set[str]:
    """The names a GPTQ mix may give a format: ``linears``, and fused experts parameters
    (``search.members``): ``model``'s, or, without it (at spec time, from the config alone),
    each ``modules`` name that reads as one (the worker checks it on the model)."""
    if model is None:
        return linears | {name for name in options.get("modules") or {} if expert_projections(name)}
    return linears | set(fused_expert_params(model))




def expert_shapes(model) -> dict[str, tuple[int, int]]:
    """(in, out) of one expert's linear in each of ``model``'s fused experts parameters, by
    the parameter's name: what gptqmodel fits per expert, for the width checks."""
    shapes = {}
    for name in fused_expert_params(model):
        experts, rows, row_length = model.get_parameter(name).shape
        _, projections = expert_projections(name) or ("", ("",))
        shapes[name] = (int(row_length), int(rows) // len(projections))
    return shapes


def layer_formats(options, names) -> dict[str, tuple[int, int]]:
    """name -> (bits, group size) each of ``names`` is quantized with."""
    found = {}
    for name in names:
        own = module_format(name, options, MODULE_KEYS) or {}
        found[name] = (own.get("bits", options.bits), own.get("group_size", options.group_size))
    return found


def gptq_layer_bytes(in_features: int, out_features: int, bits: int, group_size: int,
                     bias: bool = False) -> int:
    """What a GPTQ checkpoint stores for one layer: packed codes (``qweight``), a zero point
    per group and output (``qzeros``, packed), a half-precision scale per group and output,
    a 32-bit group index per input, and a half-precision bias."""
    groups = 1 if group_size <= 0 else -(-in_features // group_size)
    codes = in_features * out_features * bits // 8
    zeros = groups * out_features * bits // 8
    return codes + zeros + groups * out_features * 2 + in_features * 4 + (
        out_features * 2 if bias else 0)


def _round_to_nearest(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``weight`` (out, in) rounded as gptqmodel's symmetric quantizer rounds, per group of
    ``group_size`` inputs, and dequantized (scales through half precision, as stored)."""
    import torch

    out_features, in_features = weight.shape
    group = in_features if group_size <= 0 else group_size
    w = weight.detach().float().reshape(out_features, -1, group)
    maxq = 2 ** bits - 1
    top = torch.maximum(w.amin(-1).abs(), w.amax(-1)).clamp(min=0)
    top = torch.where(top == 0, torch.ones_like(top), top)  # an all-zero group: +-1
    scale = (2 * top / maxq).half().float().unsqueeze(-1)
    zero = (maxq + 1) / 2
    codes = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
    return (scale * (codes - zero)).reshape(out_features, in_features)


def rtn_proxy(module: torch.nn.Module, options) -> torch.nn.Module:
    """A copy of linear ``module`` holding its round-to-nearest weight at ``options``' bits
    and group size (the search's proxy of GPTQ) and ``checkpoint_bytes``, what the GPTQ
    checkpoint stores for it."""
    import torch
    from transformers.pytorch_utils import Conv1D

    weight = cast("torch.Tensor", module.weight).detach()
    bias = cast("torch.Tensor | None", module.bias)
    if isinstance(module, Conv1D):  # stored (in, out)
        weight = weight.t()
    out_features, in_features = weight.shape
    proxy = torch.nn.Linear(in_features, out_features, bias=bias is not None,
                            device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        proxy.weight.copy_(_round_to_nearest(weight, options.bits, options.group_size))
        if bias is not None:
            proxy.bias.copy_(bias)
    # fused experts (search.members) stack their experts' matrices: each is a layer stored
    matrices = getattr(module, "matrices", 1)
    proxy.checkpoint_bytes = matrices * gptq_layer_bytes(  # type: ignore[assignment]
        in_features, out_features // matrices, options.bits, options.group_size,
        bias is not None)
    return proxy


def dequantize_gptq_layer(module: torch.nn.Module) -> torch.Tensor | None:
    """A packed GPTQ layer's weight in float, or a proxy's (:func:`rtn_proxy`)."""
    if hasattr(module, "checkpoint_bytes"):
        return cast("torch.Tensor", module.weight).detach()
    return dequantize_packed_layer(module)
