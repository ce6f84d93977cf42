"""The phases of a GGUF job: the checkpoint converted once (a full-precision GGUF cached on
the worker's machine, one conversion per model and converter however many configs ask), then
quantized by llama.cpp's quantizer, its tensors' types read back, and scored in llama.cpp's
runtime into the same quality meter every job fills, against the same torch reference.

Task accuracy, generation speed and artifacts run in llama.cpp too (not yet: a GGUF job says
so, ``gguf_skipped``)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from dataclasses import replace
from pathlib import Path

from quantdask.gguf.source import LLAMA_CPP_COMMIT
from quantdask.job.phases import JobContext, Made, Phase, need, score
from quantdask.measure.coverage import Coverage
from quantdask.process.model_source import cached_model_source
from quantdask.records import Covered, Loaded, Quantized, TaskScores

log = logging.getLogger("quantdask.job")

FULL_PRECISION = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
"""The types a GGUF job takes as converted (the runtime's cost before any weight is
quantized): the converter's outtype for each."""
NOT_YET = "task accuracy, generation speed and artifacts of a GGUF run in llama.cpp (not yet)"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quantdask" / "gguf"


def converted(model, outtype: str) -> Path:
    """The model's GGUF in ``outtype``, converted here once (a lock per model: a second job
    waits for the first's file, then reads it)."""
    from quantdask.gguf.convert import convert

    key = hashlib.sha256(json.dumps([model.location, os.path.getmtime(
        os.path.join(model.location, "config.json")), outtype, LLAMA_CPP_COMMIT]).encode()
    ).hexdigest()[:16]
    folder = cache_dir() / key
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"model-{outtype}.gguf"
    with open(folder / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not out.is_file():
                convert(model.location, out, outtype)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def load_gguf(run: JobContext, made: Made) -> tuple[Made, Loaded]:
    """The model's config and tokenizer (no weights: llama.cpp reads the GGUF)."""
    with run.watch("load"):
        source, cached = cached_model_source(run.job.model, weights=False)
    return replace(made, source=source, originals={}), Loaded(run.watch.seconds["load"], cached,
                                                               source.param_count)


def quantize_gguf_phase(run: JobContext, made: Made) -> tuple[Made, Quantized]:
    """Convert (once per model), then quantize with llama.cpp's quantizer; the tensors'
    types as written make the coverage."""
    from quantdask.gguf.quantize import quantize_gguf, tensor_types
    from quantdask.gguf.types import canonical

    name = canonical(run.job.options.type)
    outtype = FULL_PRECISION.get(name, "f32")
    with run.watch("quantize"):
        base = converted(run.job.model, outtype)
        if name in FULL_PRECISION:
            path = base
        else:
            folder = run.holding.enter_context(_scratch())
            path = quantize_gguf(base, Path(folder) / f"model-{name}.gguf", name,
                                 threads=_threads())
    covered = gguf_coverage(path, tensor_types(path))
    return replace(made, covered=covered, runtime_model=str(path)), Quantized(
        run.watch.seconds["quantize"])


def gguf_coverage(path: str | os.PathLike, types: dict[str, str]) -> Coverage:
    """Weights in quantized tensors, and bytes of each part, from the file's own tensors."""
    from quantdask.gguf.source import gguf_module

    reader = gguf_module().GGUFReader(str(path))
    quantized = quantized_bytes = 0
    full: dict[str, int] = {}
    by_type: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = types[tensor.name]
        if kind in FULL_PRECISION:
            full[tensor.name.split(".")[-2] if "." in tensor.name else tensor.name] = \
                full.get(tensor.name, 0) + int(tensor.n_elements)
            by_type[kind.lower()] = by_type.get(kind.lower(), 0) + int(tensor.n_bytes)
        else:
            quantized += int(tensor.n_elements)
            quantized_bytes += int(tensor.n_bytes)
    return Coverage(quantized, full, quantized_bytes, by_type)


def gguf_covered(run: JobContext, made: Made) -> tuple[Made, Covered]:
    """The coverage record from the file's tensors: a quantized type that left every weight
    in full precision is skipped as unsupported; F32/F16/BF16 (the runtime's own cost) quantize
    nothing on purpose."""
    from quantdask.errors import UnsupportedHere
    from quantdask.gguf.types import canonical

    covered = need(made.covered, "covered")
    quantizing = canonical(run.job.options.type) not in FULL_PRECISION
    if quantizing and not covered.quantized_params:
        raise UnsupportedHere("llama.cpp's quantizer left every tensor in full precision")
    params = need(made.source, "source").param_count
    return made, Covered(
        size_bytes=covered.size_bytes, bits_per_weight=8.0 * covered.size_bytes / params,
        quantized_bytes=covered.quantized_bytes,
        bits_per_quantized_weight=covered.bits_per_quantized_weight,
        unquantized_bytes=covered.unquantized_bytes,
        unquantized_dtypes=covered.unquantized_dtypes(),
        quantized_params=covered.quantized_params, quantized_share=covered.quantized_share,
        full_precision=covered.summary() if quantizing else None)


def score_in_llama_cpp(run: JobContext, made: Made) -> tuple[Made, object]:
    """The eval windows through llama.cpp (``runtime.llama_cpp_meter``), then the core's
    score phase on that meter."""
    from quantdask.gguf.runtime import llama_cpp_meter

    with run.watch("eval"):
        meter = llama_cpp_meter(need(made.runtime_model, "runtime_model"), run.reference.windows,
                                run.reference.distribution, _threads())
    return score(run, replace(made, meter=meter))


def gguf_skipped(run: JobContext, made: Made) -> tuple[Made, TaskScores | None]:
    if run.job.tasks is None:
        return made, None
    return made, TaskScores(0.0, 0, 0, 0, tasks_error=f"not scored: {NOT_YET}")


def _threads() -> int:
    import torch

    return max(1, torch.get_num_threads())


@contextlib.contextmanager
def _scratch():
    import tempfile

    from quantdask.util import scratch_root

    with tempfile.TemporaryDirectory(prefix="quantdask-gguf-", dir=scratch_root()) as folder:
        yield folder


GGUF_PHASES: tuple[Phase, ...] = (load_gguf, quantize_gguf_phase, gguf_covered,
                                  score_in_llama_cpp, gguf_skipped)
"""What a GGUF job does, in order."""
