"""The ``gguf`` backend: a config names one of llama.cpp's types (``{type: Q4_K_M}``); its jobs
run in llama.cpp (``phases``), measured against the sweep's torch reference like every job.
Install with ``pip install 'quantdask[gguf]'`` then ``quantdask gguf-setup``."""

from __future__ import annotations

from quantdask.backends import Backend, register_backend
from quantdask.backends.base import missing_library
from quantdask.backends.capabilities import Calibrated, Lacks, OwnRuntime, Searchable
from quantdask.gguf.conversion import conversion
from quantdask.gguf.options import INSTALL, GgufOptions
from quantdask.gguf.phases import GGUF_PHASES
from quantdask.gguf.source import missing_converter


def _check(options: GgufOptions, facts) -> str | None:
    return missing_library("llama_cpp", "llama-cpp-python", INSTALL) or missing_converter()


def _no_torch_model(source, options, device):
    raise RuntimeError("a GGUF job quantizes in llama.cpp (its OwnRuntime phases)")


gguf_backend = register_backend(Backend(
    name="gguf", quantize=_no_torch_model, options=GgufOptions,
    label=lambda o: f"{o.type}{' imatrix' if o.imatrix else ''}"
                    f"{' cuda' if o.device == 'cuda' else ''}", check=_check,
    capabilities=(OwnRuntime("llama.cpp", GGUF_PHASES, prepare=conversion),
                  Calibrated(when=lambda o: bool(o.imatrix)),
                  Lacks(Searchable, "llama.cpp quantizes whole files")),
    description="llama.cpp's GGUF types, quantized and measured in llama.cpp (optional: "
                f"pip install {INSTALL})"))
