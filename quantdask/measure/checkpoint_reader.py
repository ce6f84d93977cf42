"""A checkpoint's tensors read one at a time (``stream.streaming``): by the model's own
parameter names, from its safetensors files, with plain file reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from quantdask.errors import UnsupportedHere

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


class CheckpointReader:
    """A checkpoint's tensors by the model's parameter names (transformers' renamings of the
    checkpoint's keys applied), each read on its own from its safetensors file into memory of
    its own: never the whole checkpoint in host memory, and no file mapping whose pages would
    stay in the process's resident set (what a worker's memory limit counts)."""

    def __init__(self, directory: str | Path, model: torch.nn.Module):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(directory.glob("*.safetensors"))]
        if not files:
            raise UnsupportedHere(f"{directory} has no safetensors checkpoint: streaming reads "
                                  "one layer at a time from safetensors files only")
        self._where: dict[str, tuple[Path, dict[str, Any], int]] = {}
        for file in files:
            header, start = _header(directory / file)
            for key, entry in header.items():
                if key != "__metadata__":
                    self._where[_model_name(model, key)] = (directory / file, entry, start)
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def read(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s tensor, as stored (counted in ``bytes_read``)."""
        import torch

        path, entry, start = self._where[name]
        begin, end = entry["data_offsets"]
        data = bytearray(end - begin)
        with open(path, "rb") as file:
            file.seek(start + begin)
            file.readinto(data)
        self.bytes_read += len(data)
        dtype = getattr(torch, _DTYPES[entry["dtype"]])
        return torch.frombuffer(data, dtype=dtype).reshape(entry["shape"]) if data else \
            torch.empty(entry["shape"], dtype=dtype)


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
"""safetensors' dtype names, as torch's."""


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (name -> dtype, shape, data offsets) and where its data
    begins: an 8-byte little-endian length, then that much JSON."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        return json.loads(file.read(length)), 8 + length


def _model_name(model: torch.nn.Module, key: str) -> str:
    """The model's name for checkpoint key ``key``, as ``from_pretrained`` renames it (an old
    family's names, the base model's prefix); a key that must be converted, not renamed
    (experts merged into one tensor), cannot be read one layer at a time."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    if not hasattr(model, "_quantdask_transforms"):
        transforms = get_model_conversion_mapping(cast("PreTrainedModel", model))
        model.__dict__["_quantdask_transforms"] = (
            [t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if not isinstance(t, WeightRenaming)],
            model.state_dict())
    renamings, converters, meta = model.__dict__["_quantdask_transforms"]
    name, converted = rename_source_key(key, renamings, converters,
                                        getattr(model, "base_model_prefix", None), meta)
    if converted is not None:
        raise UnsupportedHere(f"{type(model).__name__}'s checkpoint tensor {key} is converted "
                              f"as it loads ({converted}), not only renamed: its layers "
                              "cannot be read one at a time")
    return name


def unstreamable(spec) -> str | None:
    """Why ``spec``'s checkpoint cannot be read one layer at a time (no safetensors files, a
    tensor converted as it loads), or None; the plan's look, from the model built on the meta
    device and the files' headers (nothing read)."""
    from quantdask.process.model_source import _empty_model

    try:
        CheckpointReader(spec.location, _empty_model(spec))
    except UnsupportedHere as error:
        return str(error)
    return None
