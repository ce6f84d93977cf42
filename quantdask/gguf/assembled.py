"""A searched mix's GGUF (a verifying job's, a refinement's offspring's) assembled from its
tensors, each (tensor, type) quantized once per converted file and kept
(``backends.quantized_store``), instead of llama.cpp's quantizer quantizing every tensor of
every mix again: the mixes of one search share most of their (tensor, type) pairs.

The bytes are the quantizer's own: each tensor quantized by libggml's ``ggml_quantize_chunk``
(``gguf.tensors.quantize_rows``, what ``llama_model_quantize`` calls) from the converted
file's own float32 rows, in the type llama.cpp writes for it (its fallback applied), and the
metadata copied with the two keys llama.cpp's quantizer sets (``general.file_type``,
``general.quantization_version``). A mix it cannot assemble so (a tensor the given types
leave to the file type's own rules, an importance matrix, a base that is not float32) is
written by llama.cpp's quantizer, as before (:func:`write_mix` says which in its result).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantdask.gguf.linear import KEPT, gguf_linear
from quantdask.gguf.source import LLAMA_CPP_COMMIT, gguf_module, read_gguf
from quantdask.gguf.tensors import ggml_type, quantize_rows, quantized_here, written_type
from quantdask.gguf.types import ftype

if TYPE_CHECKING:
    from quantdask.backends.quantized_store import QuantizedStore
    from quantdask.gguf.quantize import TensorTypes

QUANTIZATION_VERSION = 2
"""``general.quantization_version`` as llama.cpp's quantizer writes it (GGML_QNT_VERSION)."""


QUANTIZER = "llama.cpp's quantizer"
"""Who wrote a file that was not assembled (``InRuntime.quantized_by``)."""


def write_mix(base: str | os.PathLike, out: str | os.PathLike, type_name: str, threads: int,
              given: TensorTypes) -> tuple[Path, str]:
    """The mix ``given`` of float32 GGUF ``base`` written to ``out`` (file type
    ``type_name``): assembled from kept tensors where it can be, else by llama.cpp's quantizer
    on ``threads`` threads. (The file, who wrote it: :data:`QUANTIZER` or ``assembled: N of M
    tensors quantized here``.)"""
    from quantdask.gguf.quantize import quantize_gguf

    gguf = gguf_module()
    reader = read_gguf(base)
    targets = _targets(reader, given)
    if targets is None:
        return quantize_gguf(base, out, type_name, threads=threads, given=given), QUANTIZER
    store, made = _store(Path(base)), [0]
    data = [_tensor(tensor, targets[tensor.name], store, made) for tensor in reader.tensors]
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), arch=_architecture(reader))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in _SET_HERE:
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_uint32("general.quantization_version", QUANTIZATION_VERSION)
    writer.add_uint32("general.file_type", int(ftype(type_name)))
    for tensor, (array, kind) in zip(reader.tensors, data, strict=True):
        writer.add_tensor_info(tensor.name, array.shape, array.dtype, array.nbytes,
                               raw_dtype=ggml_type(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for array, _ in data:
        writer.write_tensor_data(array)
    writer.close()
    partial.replace(out)
    quantized = sum(kind is not None for kind in targets.values())
    return out, f"assembled: {made[0]} of {quantized} tensors quantized here"


_SET_HERE = {"general.architecture", "general.file_type", "general.quantization_version"}


def _targets(reader, given: TensorTypes) -> dict[str, str | None] | None:
    """Each tensor's type in the mix (None: copied as it is), or None where the mix cannot be
    assembled: a base tensor not in float32, a quantizable one the given types leave to the
    file type's own rules, an alignment of its own."""
    gguf = gguf_module()
    if "general.alignment" in reader.fields:
        return None
    targets: dict[str, str | None] = {}
    for tensor in reader.tensors:
        name, shape = tensor.name, [int(n) for n in tensor.shape]
        own = given.tensors.get(name)
        if own is None and name == "token_embd.weight":
            own = given.embedding
        elif own is None and name == "output.weight":
            own = given.output
        if len(shape) == 1 or not quantized_here(name):
            if own not in (None, "F32"):
                return None
            targets[name] = None
            continue
        if own is None or len(shape) != 2 or tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            return None  # left to the file type's rules, experts (3-D), or not float32
        kind = written_type(own, shape[0])  # (gguf-py's shape: the row's length first)
        targets[name] = None if kind == "F32" else kind
    return targets


def _tensor(tensor, kind: str | None, store: QuantizedStore, made: list[int]
            ) -> tuple[Any, str]:
    """A tensor's data as written (its bytes, its type): copied, or quantized once (counted
    in ``made``)."""
    import numpy as np
    import torch

    if kind is None:
        return np.asarray(tensor.data), tensor.tensor_type.name
    rows = np.asarray(tensor.data)

    def quantize():
        made[0] += 1
        return gguf_linear(quantize_rows(torch.from_numpy(np.array(rows)), kind), kind, None)

    module: Any = store.quantized([tensor.name, kind], quantize)
    return module.weight_bytes.numpy(), kind


def _store(base: Path) -> QuantizedStore:
    """The kept tensors of converted file ``base`` (by its path, size and time: a file
    converted again is another's)."""
    from quantdask.backends.quantized_store import opened_store

    found = base.stat()
    return opened_store(["gguf file", str(base.resolve()), found.st_size, found.st_mtime_ns,
                         LLAMA_CPP_COMMIT], KEPT)


def _architecture(reader) -> str:
    return bytes(reader.fields["general.architecture"].parts[-1]).decode()
