"""The gguf backend's options: one of llama.cpp's types, checked at spec time (with the extra
and its converter present: else the sweep is refused before anything runs)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from quantdask.backends.options import BackendOptions, option
from quantdask.backends.per_module import check_modules, modules_option
from quantdask.errors import SpecError
from quantdask.gguf.source import missing_converter
from quantdask.gguf.tensors import TENSOR_TYPES
from quantdask.gguf.types import ALIASES, DEFAULT_TYPE, FTYPES, NEEDS_IMATRIX, canonical

FULL_PRECISION_TYPES = ("F32", "F16", "BF16")
DEVICES = ("cpu", "cuda")

INSTALL = "'quantdask[gguf]' (then: quantdask gguf-setup)"

MODULE_KEYS = ("tensor_type",)
"""What a module's own format sets (``modules``, a search's formats): its tensor type."""


def _tensor_type(help: str):
    return option(str, choices=TENSOR_TYPES, help=help)


def _known(name) -> bool:
    try:
        canonical(name)
    except Exception:  # noqa: BLE001 - a SpecError: not a type
        return False
    return True


@dataclass(frozen=True)
class GgufOptions(BackendOptions):
    type: str | None = option(str, default="Q4_K_M", check=_known,
                              check_hint=f"must be one of llama.cpp's types: "
                                         f"{', '.join(FTYPES)} (or {', '.join(ALIASES)})",
                              help="llama.cpp's quantization type (Q4_K_M, Q8_0, ...)")
    imatrix: bool | None = option(bool, default=False,
                                  help="quantize with an importance matrix computed on the "
                                       "sweep's calibration windows (needs a calibration "
                                       "block)")
    device: str | None = option(str, default="cpu", choices=DEVICES,
                                help="where llama.cpp runs the model: cpu (its cores; "
                                     "activations quantized to 8 bits) or cuda (every layer "
                                     "on the worker's GPU; needs llama-cpp-python built with "
                                     "CUDA): its figures differ, so it is part of the job")
    tensor_type: str | None = _tensor_type(
        "the tensor type of every linear of the decoder layers (Q4_K, Q6_K, Q8_0, ..., or F32 "
        "to keep them), a per-tensor override of type's mix (a search's format)")
    modules: dict | None = modules_option(MODULE_KEYS)
    embedding_type: str | None = _tensor_type(
        "the token embedding's tensor type (default: what llama.cpp's mix for type gives it)")
    output_type: str | None = _tensor_type(
        "the output tensor's type (default: what llama.cpp's mix for type gives it)")

    def complete(self) -> GgufOptions:
        name = canonical(str(self.type))
        missing = _missing()
        if missing:
            raise SpecError("backend", f"gguf: {missing}")
        if name in NEEDS_IMATRIX and not self.imatrix:
            raise SpecError("imatrix", f"{name} needs an importance matrix (llama.cpp refuses "
                                       "it without one): set imatrix: true, with a "
                                       "calibration block")
        if self.imatrix and name in FULL_PRECISION_TYPES:
            raise SpecError("imatrix", f"{name} is not quantized: an importance matrix does "
                                       "nothing to it")
        if (self.tensor_type or self.modules) and name not in DEFAULT_TYPE:
            raise SpecError("type", f"{name} is no file type whose tensors llama.cpp overrides "
                                    "one by one without an importance matrix; name one of "
                                    f"{', '.join(DEFAULT_TYPE)} (the file's mix outside the "
                                    "tensors given their own type)")
        check_modules(self, MODULE_KEYS)
        return replace(self, type=name)

    def searched(self) -> bool:
        """Whether its linears have types of their own (``tensor_type`` or ``modules``)."""
        return bool(self.tensor_type or self.modules)


def _missing() -> str | None:
    """Why a GGUF sweep cannot run from here (the extra or its converter missing), or None:
    refused at spec time, before anything runs."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed; pip install {INSTALL}"
    return missing_converter()


