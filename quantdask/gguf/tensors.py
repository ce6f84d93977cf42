"""One tensor in one of llama.cpp's tensor types (``Q4_K``, ``Q6_K``, ``Q8_0``, ``F16`` ...), as
llama.cpp's quantizer writes it: the rows quantized by libggml's own ``ggml_quantize_chunk``
(the function ``llama_model_quantize`` calls on each tensor, so the bytes are the file's), read
back by libggml's own ``dequantize_row_*`` (gguf-py's ``dequantize`` for the float types; the
same floats, 20-60x faster on K-quants), and the type llama.cpp falls back to when a row's length is
not a multiple of the type's block (``tensor_type_fallback`` in src/llama-quant.cpp).

A search probes a module in the type its file will hold: these bytes, dequantized.

>>> written_type("Q4_K", 576), written_type("Q4_K", 512), written_type("Q8_0", 40)
('Q5_0', 'Q4_K', 'F16')
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from quantdask.errors import SpecError
from quantdask.gguf.source import gguf_module

if TYPE_CHECKING:
    import numpy as np
    import torch

TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1",
                "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K")
"""The tensor types a module may be given (those llama.cpp quantizes without an importance
matrix; ``F32`` keeps it as converted)."""

FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
            "IQ4_XS": "IQ4_NL"}
"""What llama.cpp writes instead of a 256-block type on rows it does not divide."""

_LOCK = threading.Lock()
_GGML: ctypes.CDLL | None = None


def check_tensor_type(name: str, where: str = "tensor_type") -> str:
    """``name`` as llama.cpp spells it, or a :class:`SpecError` listing the types."""
    upper = str(name).strip().upper()
    if upper not in TENSOR_TYPES:
        raise SpecError(where, f"{name!r} is not a tensor type a module can take; one of "
                               f"{', '.join(TENSOR_TYPES)} (llama.cpp's own names: Q4_K, not "
                               "Q4_K_M, which names a whole file's mix)")
    return upper


def ggml_type(name: str):
    """Tensor type ``name`` as ggml numbers it (gguf-py's ``GGMLQuantizationType``)."""
    return gguf_module().GGMLQuantizationType[name]


def block(name: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of tensor type ``name``."""
    gguf = gguf_module()
    return gguf.GGML_QUANT_SIZES[ggml_type(name)]


def written_type(name: str, row_length: int) -> str:
    """The type llama.cpp writes for ``name`` on rows of ``row_length`` weights: ``name``,
    its fallback, or F16 when neither block divides the row."""
    if row_length % block(name)[0] == 0:
        return name
    fallen = FALLBACK.get(name, name)
    return fallen if row_length % block(fallen)[0] == 0 else "F16"


def tensor_bytes(name: str, rows: int, row_length: int) -> int:
    """What a (rows, row_length) tensor of type ``name`` stores, in bytes."""
    weights, size = block(written_type(name, row_length))
    return rows * (row_length // weights) * size


def _ggml() -> ctypes.CDLL:
    """libggml-base of the installed llama-cpp-python (the runtime's own quantizer)."""
    global _GGML
    if _GGML is None:
        import llama_cpp

        folder = Path(llama_cpp.__file__).parent / "lib"
        found = sorted(folder.glob("libggml-base.*"))
        if not found:
            raise RuntimeError(f"libggml-base is not in {folder}")
        library = ctypes.CDLL(str(found[0]))
        library.ggml_quantize_chunk.restype = ctypes.c_size_t
        library.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                                ctypes.c_void_p]
        _GGML = library
    return _GGML


def quantize_rows(weight: torch.Tensor, name: str) -> np.ndarray:
    """``weight`` (out_features, in_features) in type ``name`` as llama.cpp writes it (with
    its fallback): the tensor's bytes, one row of blocks per output feature."""
    import numpy as np

    name = written_type(name, int(weight.shape[1]))
    rows, row_length = (int(n) for n in weight.shape)
    source = np.ascontiguousarray(weight.detach().to("cpu").float().numpy())
    if name in ("F32", "F16", "BF16"):
        gguf = gguf_module()
        return gguf.quants.quantize(source, ggml_type(name)).view(np.uint8).reshape(rows, -1)
    out = np.empty(tensor_bytes(name, rows, row_length), dtype=np.uint8)
    with _LOCK:  # ggml_quantize_init's tables are made once, not thread-safe
        written = _ggml().ggml_quantize_chunk(int(ggml_type(name)), source.ctypes.data,
                                              out.ctypes.data, 0, rows, row_length, None)
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, not {out.nbytes}")
    return out.reshape(rows, -1)


def dequantize_rows(data: np.ndarray, name: str) -> torch.Tensor:
    """The float weight of bytes ``data`` (rows of blocks) of type ``name`` (as written)."""
    import numpy as np
    import torch

    weights, size = block(name)
    rows = int(data.shape[0])
    unpack = _dequantizer(name)
    if unpack is None:
        gguf = gguf_module()
        return torch.from_numpy(gguf.quants.dequantize(data, ggml_type(name)).copy()).float()
    source = np.ascontiguousarray(data, dtype=np.uint8)
    count = source.nbytes // size * weights
    out = np.empty(count, dtype=np.float32)
    unpack(source.ctypes.data, out.ctypes.data, count)
    return torch.from_numpy(out.reshape(rows, -1))


def _dequantizer(name: str):
    """libggml's ``dequantize_row_<type>`` (one call for every row: blocks are contiguous), or
    None for a type it has none for here (the float types)."""
    if name in ("F32", "F16", "BF16"):
        return None
    found = getattr(_ggml(), f"dequantize_row_{name.lower().replace('_k', '_K')}", None)
    if found is not None:
        found.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        found.restype = None
    return found


# What llama.cpp's quantizer keeps as converted whatever it is told (``tensor_allows_quantization``
# in src/llama-quant.cpp): routers, norms and a few small tensors, by name.
_NEVER_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "altup", "laurel",
                    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight")


def quantized_here(name: str) -> bool:
    """Whether llama.cpp's quantizer may give GGUF tensor ``name`` a quantized type."""
    return name.endswith("weight") and not any(part in name for part in _NEVER_QUANTIZED)
