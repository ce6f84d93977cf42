"""What a backend really quantized: the share of a model's weights it holds in quantized form,
and what it left in full precision, by module.

A backend may quantize all of a model, part of it (a mixture-of-experts model whose experts are
fused 3-D parameters that bitsandbytes does not replace) or none of it (a model whose layers are
a class the backend does not recognize). A result must say which: ``quantized_share`` is the
same measure on every model, and a quantized config that quantized nothing is not ``done``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def quantized_weights(param: torch.Tensor, module: torch.nn.Module | None = None) -> int:
    """How many weights ``param`` (of ``module``) holds in quantized form (its logical element
    count), or 0.

    Recognized forms: a bitsandbytes 4-bit parameter (packed bytes plus a ``quant_state`` that
    knows the original shape), an HQQ layer's packed ``W_q`` (the layer's ``meta`` knows the
    shape), a tensor subclass wrapping quantized data (torchao), and integer or sub-16-bit
    storage (bitsandbytes LLM.int8 rows, float8 weights).
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    state = getattr(param, "quant_state", None)
    if state is not None and getattr(state, "shape", None) is not None:
        return math.prod(state.shape)
    meta = getattr(module, "meta", None)
    if param is getattr(module, "W_q", None) and isinstance(meta, dict) and "shape" in meta:
        return math.prod(meta["shape"])
    if is_traceable_wrapper_subclass(param):
        return param.numel()
    if not param.dtype.is_floating_point or param.element_size() < 2:
        return param.numel()
    return 0


def module_role(name: str, module_class: type) -> str:
    """A module's role across layers: its last non-numeric name and its class, e.g.
    ``experts (MixtralExperts)`` for every ``model.layers.N.mlp.experts``."""
    parts = [p for p in name.split(".") if p and not re.fullmatch(r"\d+", p)]
    return f"{parts[-1] if parts else 'model'} ({module_class.__name__})"


@dataclass(frozen=True)
class Coverage:
    """Weights held quantized and weights left in full precision (by module role)."""

    quantized_params: int
    full_precision: dict[str, int] = field(default_factory=dict)

    @property
    def total_params(self) -> int:
        return self.quantized_params + sum(self.full_precision.values())

    @property
    def quantized_share(self) -> float:
        return self.quantized_params / self.total_params if self.total_params else 0.0

    def summary(self, top: int = 3) -> str:
        """What stayed in full precision by module role, largest first, as shares of all
        weights, e.g. ``experts (MixtralExperts) 84%, embed_tokens (Embedding) 6%, 4 more 1%``."""
        return self._ranked(self.full_precision, top)

    def by_class(self, top: int = 3) -> str:
        """The same by module class alone, e.g. ``FalconLinear 57%, Embedding 43%``."""
        classes: Counter[str] = Counter()
        for role, count in self.full_precision.items():
            classes[role[role.rindex("(") + 1:-1]] += count
        return self._ranked(classes, top)

    def _ranked(self, counts: dict[str, int], top: int) -> str:
        if not counts or not self.total_params:
            return ""
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        shown = [f"{what} {_percent(n / self.total_params)}" for what, n in ranked[:top]]
        rest = sum(n for _, n in ranked[top:])
        if rest:
            shown.append(f"{len(ranked) - top} more {_percent(rest / self.total_params)}")
        return ", ".join(shown)


def _percent(share: float) -> str:
    return f"{share:.0%}" if share >= 0.01 or share == 0 else "<1%"


def _changed(param: torch.Tensor, original: torch.Tensor | None) -> bool:
    """Whether a float parameter differs from the checkpoint's: simulated quantization
    (quantized and dequantized back to float in place) changes the values, not the dtype."""
    import torch

    if original is None or tuple(original.shape) != tuple(param.shape):
        return False
    # Compared at the parameter's own precision: a model loaded in float16 from a float32
    # checkpoint holds rounded values, which is a cast, not quantization.
    return not torch.equal(param.detach().cpu(), original.to(param.dtype))


def packed_linear_weights(module: torch.nn.Module) -> int:
    """The weights a GPTQ-style packed linear layer holds (``in x out``), or 0: AutoRound's
    export, like GPTQ's and AWQ's, stores integer codes in a ``qweight`` buffer beside
    ``qzeros`` and ``scales``, with no weight parameter."""
    import torch

    qweight = getattr(module, "qweight", None)
    sizes = [getattr(module, a, None) for a in ("infeatures", "outfeatures")]
    if not isinstance(qweight, torch.Tensor) or not all(isinstance(n, int) for n in sizes):
        return 0
    return sizes[0] * sizes[1]


def _plain_bias(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A bias a quantized layer keeps as a plain tensor attribute, neither parameter nor buffer
    (HQQ's ``HQQLinear``): still weights of the model, in full precision."""
    import torch

    bias = module.__dict__.get("bias")
    return [("bias", bias)] if isinstance(bias, torch.Tensor) else []


def coverage(model: torch.nn.Module,
             originals: dict[str, torch.Tensor] | None = None) -> Coverage:
    """Count ``model``'s weights by whether they are held quantized; a shared (tied) parameter
    counts once. With ``originals`` (the checkpoint's state dict), a float parameter whose
    values differ from the checkpoint's counts as quantized too (simulated quantization).
    Parameters (and a bias a layer keeps as a plain tensor); buffers hold no weights in the
    backends quantdask knows but GPTQ-style packed layers (:func:`packed_linear_weights`,
    whose float ``bias`` buffer counts as full precision)."""
    seen: set[int] = set()
    quantized = 0
    left: Counter[str] = Counter()
    for name, module in model.named_modules():
        packed = packed_linear_weights(module)
        if packed:
            quantized += packed
            bias = module._buffers.get("bias")  # a bias parameter is counted below
            if bias is not None:
                left[module_role(name, type(module))] += bias.numel()
        for pname, param in [*module.named_parameters(recurse=False), *_plain_bias(module)]:
            if id(param) in seen:
                continue
            seen.add(id(param))
            held = quantized_weights(param, module)
            if not held and originals is not None and _changed(
                    param, originals.get(f"{name}.{pname}" if name else pname)):
                held = param.numel()
            if held:
                quantized += held
            else:
                left[module_role(name, type(module))] += param.numel()
    return Coverage(quantized, dict(left))
