"""The gguf backend's options: one of llama.cpp's types, checked at spec time (with the extra
and its converter present: else the sweep is refused before anything runs)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from quantdask.backends.options import BackendOptions, option
from quantdask.errors import SpecError
from quantdask.gguf.source import missing_converter
from quantdask.gguf.types import ALIASES, FTYPES, NEEDS_IMATRIX, canonical

FULL_PRECISION_TYPES = ("F32", "F16", "BF16")
DEVICES = ("cpu", "cuda")

INSTALL = "'quantdask[gguf]' (then: quantdask gguf-setup)"


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
        return replace(self, type=name)


def _missing() -> str | None:
    """Why a GGUF sweep cannot run from here (the extra or its converter missing), or None:
    refused at spec time, before anything runs."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed; pip install {INSTALL}"
    return missing_converter()


