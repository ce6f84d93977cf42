"""A module's weight as a GGUF tensor (what a search's probe of a GGUF format holds: the bytes
llama.cpp's quantizer writes, ``gguf.tensors``), its weight back in float (``Dequantizes``), and
the form a kept one takes on disk (``backends.quantized_store``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quantdask.backends.capabilities import KeptForm
from quantdask.gguf.source import LLAMA_CPP_COMMIT
from quantdask.gguf.tensors import dequantize_rows

if TYPE_CHECKING:
    import torch

_LINEAR: list[type] = []  # the module class, made on first use (torch loads lazily)


def gguf_linear(data, tensor_type: str, bias: torch.Tensor | None) -> torch.nn.Module:
    """A module's weight as a GGUF tensor: ``data`` its bytes (rows of blocks), the type
    written, and its bias, if any, in float (a GGUF keeps 1-D tensors F32)."""
    import torch

    if not _LINEAR:
        class GgufLinear(torch.nn.Module):
            def __init__(self, data, tensor_type: str, bias):
                super().__init__()
                self.tensor_type = tensor_type
                self.register_buffer("weight_bytes", torch.from_numpy(data))
                self.bias = None if bias is None else torch.nn.Parameter(
                    bias.detach().float().clone(), requires_grad=False)

        _LINEAR.append(GgufLinear)
    return _LINEAR[0](data, tensor_type, bias)


def module_tensors(module: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A :func:`gguf_linear` as tensors (its bytes, its bias) and its type (``KeptForm``)."""
    tensors = {"weight_bytes": module.weight_bytes}
    if module.bias is not None:
        tensors["bias"] = module.bias.data
    return tensors, {"tensor_type": module.tensor_type}


def tensors_module(tensors: dict[str, torch.Tensor], text: dict[str, str]) -> torch.nn.Module:
    """The :func:`gguf_linear` of :func:`module_tensors`' output."""
    return gguf_linear(tensors["weight_bytes"].numpy(), text["tensor_type"], tensors.get("bias"))


def dequantize_module(module: torch.nn.Module) -> torch.Tensor | None:
    """The float weight (out, in) a :func:`gguf_linear` holds; None for any other module."""
    if not (_LINEAR and isinstance(module, _LINEAR[0])):
        return None
    held: Any = module
    return dequantize_rows(held.weight_bytes.numpy(), held.tensor_type)


KEPT = KeptForm(module_tensors, tensors_module, f"llama.cpp {LLAMA_CPP_COMMIT}")
"""How a kept GGUF module is stored: its bytes, its bias, its type (``ModuleAlone.kept``)."""
