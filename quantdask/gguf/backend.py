"""The ``gguf`` backend: a config names one of llama.cpp's types (``{type: Q4_K_M}``); its jobs
run in llama.cpp (``phases``), measured against the sweep's torch reference like every job.
Install with ``pip install 'quantdask[gguf]'`` then ``quantdask gguf-setup``."""

from __future__ import annotations

from quantdask.backends import Backend, register_backend
from quantdask.backends.base import HostWork, Sizing, missing_library
from quantdask.backends.capabilities import (
    Calibrated,
    Dequantizes,
    ModuleAlone,
    OwnRuntime,
    Searchable,
)
from quantdask.backends.per_module import mixed_label
from quantdask.gguf.conversion import conversion
from quantdask.gguf.linear import KEPT, dequantize_module
from quantdask.gguf.options import INSTALL, MODULE_KEYS, GgufOptions
from quantdask.gguf.phases import GGUF_PHASES
from quantdask.gguf.searched import (
    export_file,
    least_bits,
    quantize_module,
    rest_bytes,
    score_in_runtime,
)
from quantdask.gguf.source import missing_converter
from quantdask.gguf.tasks_lm import task_refusal


def _check(options: GgufOptions, facts) -> str | None:
    return missing_library("llama_cpp", "llama-cpp-python", INSTALL) or missing_converter()


def _label(options: GgufOptions) -> str:
    """``Q4_K_M``, ``Q4_K_M imatrix cuda``, ``Q4_K_M linears Q6_K``, ``Q4_K_M mixed(8 modules)``."""
    linears = f" linears {options.tensor_type}" if options.tensor_type else ""
    return (f"{options.type}{' imatrix' if options.imatrix else ''}{linears}"
            f"{mixed_label(options)}{' cuda' if options.device == 'cuda' else ''}")


def _no_torch_model(source, options, device):
    raise RuntimeError("a GGUF job quantizes in llama.cpp (its OwnRuntime phases)")


gguf_backend = register_backend(Backend(
    name="gguf", quantize=_no_torch_model, options=GgufOptions,
    label=_label, check=_check,
    # llama-cpp-python and gguf-py's imports, and a header's parsed vocabulary, which a
    # job keeps until it ends (about 1.5 KiB a token: 220 MiB at 151,936 tokens)
    sizing=Sizing(host_work=lambda options: HostWork(imports=32 * 2**20,
                                                      bytes_per_token=1536)),
    capabilities=(OwnRuntime("llama.cpp", GGUF_PHASES, prepare=conversion,
                             task_refusal=task_refusal),
                  Calibrated(when=lambda o: bool(o.imatrix)),
                  ModuleAlone(quantize_module, KEPT),
                  Dequantizes(dequantize_module),
                  Searchable(MODULE_KEYS, rest_bytes=rest_bytes, export=export_file,
                             embeddings=True, experts=True, score_mix=score_in_runtime,
                             scores_in="llama.cpp", least_bits=least_bits, rest_bits=32)),
    description="llama.cpp's GGUF types, quantized and measured in llama.cpp (optional: "
                f"pip install {INSTALL})"))
