"""The ``gguf`` backend: a config names one of llama.cpp's types (``{type: Q4_K_M}``); its jobs
run in llama.cpp (``phases``), measured against the sweep's torch reference like every job.
Install with ``pip install 'quantdask[gguf]'`` then ``quantdask gguf-setup``."""

from __future__ import annotations

from dataclasses import dataclass

from quantdask.backends import Backend, register_backend
from quantdask.backends.base import missing_library
from quantdask.backends.capabilities import Lacks, OwnRuntime, Searchable
from quantdask.backends.options import BackendOptions, option
from quantdask.gguf.phases import GGUF_PHASES
from quantdask.gguf.source import missing_converter
from quantdask.gguf.types import ALIASES, FTYPES, NEEDS_IMATRIX, canonical

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

    def complete(self) -> GgufOptions:
        from dataclasses import replace

        from quantdask.errors import SpecError

        name = canonical(self.type)
        if name in NEEDS_IMATRIX:
            raise SpecError("type", f"{name} needs an importance matrix, which quantdask does "
                                    "not compute for GGUF yet (llama.cpp refuses it without "
                                    "one); choose a K-quant such as Q2_K or Q3_K_S")
        return replace(self, type=name)


def _check(options: GgufOptions, facts) -> str | None:
    return missing_library("llama_cpp", "llama-cpp-python", INSTALL) or missing_converter()


def _no_torch_model(source, options, device):
    raise RuntimeError("a GGUF job quantizes in llama.cpp (its OwnRuntime phases)")


gguf_backend = register_backend(Backend(
    name="gguf", quantize=_no_torch_model, options=GgufOptions,
    label=lambda o: o.type, check=_check,
    capabilities=(OwnRuntime("llama.cpp", GGUF_PHASES),
                  Lacks(Searchable, "llama.cpp quantizes whole files")),
    description="llama.cpp's GGUF types, quantized and measured in llama.cpp (optional: "
                f"pip install {INSTALL})"))
