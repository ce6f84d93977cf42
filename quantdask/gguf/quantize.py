"""A full-precision GGUF quantized with llama.cpp's own quantizer, libllama's
``llama_model_quantize`` (through llama-cpp-python's bindings, the same source as the runtime),
and the types of the tensors it wrote, read back from the file: llama.cpp swaps a K-quant for
a legacy type on a tensor whose rows are not a multiple of 256, silently."""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantdask.gguf.source import read_gguf
from quantdask.gguf.tensors import ggml_type
from quantdask.gguf.types import canonical, ftype

_LOG: list[str] = []
_LOG_LOCK = threading.Lock()
_CALLBACK = None  # one for the process: llama.cpp keeps the pointer after the call returns


def _capture_log():
    """llama.cpp's log, kept in ``_LOG`` (its quantizer says why it failed only there)."""
    global _CALLBACK
    import llama_cpp

    if _CALLBACK is None:
        _CALLBACK = llama_cpp.llama_log_callback(
            lambda level, text, data: _LOG.append((text or b"").decode(errors="replace")))
    llama_cpp.llama_log_set(_CALLBACK, None)


@dataclass(frozen=True)
class TensorTypes:
    """Types given to tensors by name, overriding the file type's mix: ``tensors`` (GGUF
    tensor name -> tensor type, as llama.cpp will write it; ``asked``: before its fallback),
    the token embedding's and the output's."""

    tensors: dict[str, str]
    asked: dict[str, str]
    embedding: str
    output: str


def quantize_gguf(source: str | os.PathLike, out: str | os.PathLike, type_name: str,
                  threads: int, imatrix: dict[str, Any] | None = None,
                  given: TensorTypes | None = None) -> Path:
    """``source`` (an F32/F16/BF16 GGUF) quantized to ``type_name`` in ``out``, with an
    importance matrix (``imatrix.importance``'s) when given, and the tensor types ``given``
    (llama.cpp's ``tt_overrides``, each an exact tensor name)."""
    import llama_cpp

    from quantdask.gguf.imatrix import ImatrixArray

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype(type_name)
    params.nthread = max(1, threads)
    held = ImatrixArray(imatrix) if imatrix else None  # alive until the call returns
    if held is not None:
        params.imatrix = held.pointer
    if given is not None:
        overrides = _overrides(given.tensors)  # alive until the call returns
        params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(
            llama_cpp.llama_model_tensor_override))
        params.token_embedding_type = int(ggml_type(given.embedding))
        params.output_tensor_type = int(ggml_type(given.output))
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    with _LOG_LOCK:
        _LOG.clear()
        _capture_log()
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(),
                                                ctypes.byref(params))
        said = "".join(_LOG)
    if status != 0:
        partial.unlink(missing_ok=True)
        reason = [line for line in said.splitlines() if "failed to quantize" in line]
        raise RuntimeError(f"llama.cpp could not quantize to {canonical(type_name)}: "
                           + (reason[-1].strip() if reason else said.strip()[-500:]))
    partial.replace(out)
    return out


def _overrides(tensors: dict[str, str]):
    """``tensors`` as llama.cpp's NULL-terminated ``llama_model_tensor_override`` array, each
    pattern the tensor's whole name."""
    import llama_cpp

    array = (llama_cpp.llama_model_tensor_override * (len(tensors) + 1))()
    for entry, (name, kind) in zip(array, sorted(tensors.items()), strict=False):
        entry.pattern = f"^{re.escape(name)}$".encode()
        entry.type = int(ggml_type(kind))
    return array


def check_written(types: dict[str, str], given: TensorTypes) -> None:
    """Every tensor given a type was written in it (as llama.cpp's fallback makes it): a
    file whose types differ from the search's is not the allocation it verifies."""
    wrong = {n: (kind, types.get(n)) for n, kind in given.tensors.items() if types.get(n) != kind}
    if wrong:
        raise RuntimeError(f"llama.cpp wrote {len(wrong)} tensors in other types than given: "
                           + ", ".join(f"{n} {w} not {k}" for n, (k, w) in
                                       list(wrong.items())[:3]))


def tensor_types(path: str | os.PathLike) -> dict[str, str]:
    """Each tensor's type as written in the GGUF at ``path`` (``blk.0.attn_q.weight: Q4_K``)."""
    return {t.name: t.tensor_type.name for t in read_gguf(path).tensors}


def type_counts(types: dict[str, str]) -> str:
    """``13 Q4_K, 3 Q6_K, 5 F32``: the types written, most tensors first."""
    return ", ".join(f"{n} {t}" for t, n in Counter(types.values()).most_common())
