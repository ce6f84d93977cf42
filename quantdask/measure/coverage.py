"""What a backend really quantized: the share of a model's weights it holds in quantized form,
and what it left in full precision, by module.

A backend may quantize all of a model, part of it (a mixture-of-experts model whose experts are
fused 3-D parameters that bitsandbytes does not replace) or none of it (a model whose layers are
a class the backend does not recognize). A result must say which: ``quantized_share`` is the
same measure on every model, and a quantized config that quantized nothing is not ``done``.

The same walk splits the model's stored bytes (``size_bytes``) into the quantized part (the
quantized weights with their quantization constants) and the rest, by dtype: the rest is in
whatever dtype the backend leaves it (AutoRound's export casts it to 16 bits, bitsandbytes keeps
the model's), so methods compare on ``bits_per_quantized_weight``, not on ``bits_per_weight``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quantdask.backends.packed import packed_shape
from quantdask.measure.usage import stored_tensors

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
    """Weights held quantized and weights left in full precision (by module role); and the
    stored bytes of each part, the rest's by dtype (empty when not measured)."""

    quantized_params: int
    full_precision: dict[str, int] = field(default_factory=dict)
    quantized_bytes: int = 0
    unquantized_by_dtype: dict[str, int] = field(default_factory=dict)

    @property
    def total_params(self) -> int:
        return self.quantized_params + sum(self.full_precision.values())

    @property
    def quantized_share(self) -> float:
        return self.quantized_params / self.total_params if self.total_params else 0.0

    @property
    def unquantized_bytes(self) -> int:
        return sum(self.unquantized_by_dtype.values())

    @property
    def size_bytes(self) -> int:
        return self.quantized_bytes + self.unquantized_bytes

    @property
    def bits_per_quantized_weight(self) -> float | None:
        """8 x quantized_bytes / quantized_params; None when nothing is quantized."""
        return 8.0 * self.quantized_bytes / self.quantized_params if self.quantized_params \
            else None

    def unquantized_dtypes(self) -> str:
        """The rest's dtypes as shares of its bytes, largest first, e.g.
        ``float16 93%, float32 7%`` (empty when nothing stays unquantized)."""
        total = self.unquantized_bytes
        ranked = sorted(self.unquantized_by_dtype.items(), key=lambda kv: (-kv[1], kv[0]))
        return ", ".join(f"{dtype} {_percent(n / total)}" for dtype, n in ranked if n)

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
    shape = packed_shape(module)
    return 0 if shape is None else shape[0] * shape[1]


def _plain_bias(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A bias a quantized layer keeps as a plain tensor attribute, neither parameter nor buffer
    (HQQ's ``HQQLinear``): still weights of the model, in full precision."""
    import torch

    bias = module.__dict__.get("bias")
    return [("bias", bias)] if isinstance(bias, torch.Tensor) else []


def coverage(model: torch.nn.Module, originals: dict[str, torch.Tensor] | None = None,
             stored_bytes=None) -> Coverage:
    """Count ``model``'s weights by whether they are held quantized; a shared (tied) parameter
    counts once. With ``originals`` (the checkpoint's state dict), a float parameter whose
    values differ from the checkpoint's counts as quantized too (simulated quantization).
    Parameters (and a bias a layer keeps as a plain tensor); buffers hold no weights in the
    backends quantdask knows but GPTQ-style packed layers (:func:`packed_linear_weights`,
    whose float ``bias`` buffer counts as full precision).

    The stored bytes (:func:`~quantdask.measure.usage.stored_tensors`, counted by the backend's
    ``stored_bytes``) split along the same line: every entry of a module that holds quantized
    weights is the quantized part (the weights and their constants: absmax, quant maps, scales,
    zeros, packing metadata) but the full-precision weights it keeps (a bias); all else is
    the rest.

    >>> import torch
    >>> covered = coverage(torch.nn.Linear(4, 2))
    >>> covered.quantized_params, covered.unquantized_bytes, covered.unquantized_dtypes()
    (0, 40, 'float32 100%')
    """
    seen: set[int] = set()
    quantized = 0
    left: Counter[str] = Counter()
    modules: set[str] = set()
    holders: set[str] = set()  # modules holding quantized weights
    kept: set[str] = set()  # the state-dict keys of the weights left in full precision
    for name, module in model.named_modules():
        modules.add(name)
        packed = packed_linear_weights(module)
        if packed:
            quantized += packed
            holders.add(name)
            bias = module._buffers.get("bias")  # a bias parameter is counted below
            if bias is not None:
                left[module_role(name, type(module))] += bias.numel()
                kept.add(_key(name, "bias"))
        for pname, param in [*module.named_parameters(recurse=False), *_plain_bias(module)]:
            if id(param) in seen:
                continue
            seen.add(id(param))
            held = quantized_weights(param, module)
            if not held and originals is not None and _changed(
                    param, originals.get(_key(name, pname))):
                held = param.numel()
            if held:
                quantized += held
                holders.add(name)
            else:
                left[module_role(name, type(module))] += param.numel()
                kept.add(_key(name, pname))
    quantized_bytes = 0
    rest: Counter[str] = Counter()
    for key, tensor, nbytes in stored_tensors(model, stored_bytes):
        if _owner(key, modules) in holders and key not in kept:
            quantized_bytes += nbytes
        else:
            rest[str(tensor.dtype).removeprefix("torch.")] += nbytes
    return Coverage(quantized, dict(left), quantized_bytes, dict(rest))


def _key(module: str, name: str) -> str:
    return f"{module}.{name}" if module else name


def _owner(key: str, modules: set[str]) -> str:
    """The module a state-dict entry belongs to: the longest module name prefixing it
    (``q_proj.weight.absmax`` and ``q_proj.weight.quant_state.bitsandbytes__nf4``: ``q_proj``)."""
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:end])
        if name in modules:
            return name
    return ""
