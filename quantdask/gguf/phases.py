"""The phases of a GGUF job: the checkpoint converted once (``conversion``: one task per model
that its GGUF jobs depend on, the file cached on its machine), then quantized by llama.cpp's
quantizer, its tensors' types read back, and scored in llama.cpp's runtime into the same
quality meter every job fills, against the same torch reference.

The sweep's lm-eval tasks are answered in llama.cpp too (``gguf.tasks_lm``). Generation speed
is timed in llama.cpp at batch size 1 (``gguf.speed``); the artifact is the ``.gguf`` file
itself (``keep_gguf``). Larger batches are not measured in llama.cpp yet: a GGUF job says so
(``runtime_skipped``), never records them as done."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import cast

from quantdask.gguf.conversion import FULL_PRECISION, base_file, outtype_of
from quantdask.gguf.options import GgufOptions
from quantdask.gguf.source import LLAMA_CPP_COMMIT
from quantdask.gguf.types import canonical
from quantdask.job.phases import (
    JobContext,
    Made,
    Phase,
    calibration_of,
    covered_record,
    need,
    score,
    tasks_scored,
)
from quantdask.measure.calibration import Calibration
from quantdask.measure.coverage import Coverage
from quantdask.process.model_source import cached_model_source
from quantdask.records import (
    Artifact,
    Covered,
    InRuntime,
    Loaded,
    Quantized,
    Scored,
    Speed,
    TaskScores,
)

log = logging.getLogger("quantdask.job")


def load_gguf(run: JobContext, made: Made) -> tuple[Made, Loaded]:
    """The model's config and tokenizer (no weights: llama.cpp reads the GGUF)."""
    with run.watch("load"):
        source, cached = cached_model_source(run.job.model, weights=False)
    return replace(made, source=source, originals={}), Loaded(run.watch.seconds["load"], cached,
                                                               source.param_count)


def quantize_gguf_phase(run: JobContext, made: Made) -> tuple[Made, InRuntime]:
    """Convert (once per model), then quantize with llama.cpp's quantizer; the tensors'
    types as written make the coverage, and those that fell back to another type than the
    config's are counted (and warned of when most did)."""
    from quantdask.gguf.assembled import QUANTIZER, write_mix
    from quantdask.gguf.quantize import check_written, quantize_gguf, tensor_types, type_counts
    from quantdask.gguf.searched import given_types

    name = canonical(str(_options(run).type))
    outtype = outtype_of(_options(run))
    calibration = calibration_of(run) if _options(run).imatrix else None
    _device(run).check()  # before converting: a GPU this worker lacks is a reason
    with run.watch("quantize"):
        base = base_file(run.prepared, run.job.model, outtype, run.job.timeout_s)
        imatrix = _importance(run, base, calibration) if calibration is not None else None
        given = None
        by: str | None = QUANTIZER
        if name in FULL_PRECISION:
            path, by = base, None
        else:
            folder = run.holding.enter_context(_scratch())
            given = given_types(base, _options(run)) if _options(run).searched() else None
            out = Path(folder) / f"model-{name}.gguf"
            if given is not None and imatrix is None:
                path, by = write_mix(base, out, name, _threads(), given)
            else:
                path = quantize_gguf(base, out, name, threads=_threads(), imatrix=imatrix,
                                     given=given)
    types = tensor_types(path)
    if given is not None:
        check_written(types, given)
    covered = gguf_coverage(path, types)
    fell_back = fallback_share(path, types, name, given)
    if fell_back > 0.5:
        log.warning("%s: llama.cpp wrote %.0f%% of the quantized weights in another type than "
                    "%s (rows not a multiple of 256): %s", run.job.config_label,
                    100 * fell_back, name, type_counts(types))
    return replace(made, covered=covered, runtime_model=str(path)), InRuntime(
        Quantized(run.watch.seconds["quantize"],
                  calibration.figures() if calibration is not None else None),
        runtime=runtime_name(_device(run).gpu),
        tensor_types=type_counts(types), fallback_share=fell_back,
        runtime_skipped=_skipped(run), quantized_by=by)


FALLBACK_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"})
"""The legacy types llama.cpp puts a K-quant or 256-block IQ tensor in when its rows do not
split into 256-weight blocks (``llama_tensor_get_type_impl``'s fallback)."""


def fallback_share(path, types: dict[str, str], name: str, given=None) -> float:
    """The share of the quantized weights in a fallback type, for a K-quant or IQ config
    (0 for a legacy one, whose type is its own); for one that gives tensors their own types
    (``given``, a ``quantize.TensorTypes``), the share written in another type than asked."""
    from quantdask.gguf.source import read_gguf

    if given is None and not (name.startswith("IQ") or "_K" in name):
        return 0.0
    sizes = {t.name: int(t.n_elements) for t in read_gguf(path).tensors}
    quantized = {n: k for n, k in types.items() if k not in FULL_PRECISION}
    total = sum(sizes[n] for n in quantized)
    if given is not None:  # asked: the override before llama.cpp's fallback
        fell = sum(sizes[n] for n, asked in given.asked.items()
                   if n in quantized and types[n] != asked)
    else:
        fell = sum(sizes[n] for n, k in quantized.items() if k in FALLBACK_TYPES)
    return fell / total if total else 0.0


def runtime_name(cuda: bool) -> str:
    """``llama.cpp 0c1e570 (llama-cpp-python 0.3.36), cpu``: what measured the job."""
    from quantdask.gguf.source import LLAMA_CPP_PYTHON

    return (f"llama.cpp {LLAMA_CPP_COMMIT[:7]} (llama-cpp-python {LLAMA_CPP_PYTHON}), "
            f"{'cuda' if cuda else 'cpu'}")


def _skipped(run: JobContext) -> str | None:
    """What the job's sweep asks that llama.cpp does not measure here (null: nothing)."""
    speed = run.job.speed
    if speed is not None and any(b > 1 for b in speed.batch_sizes):
        return ("generation speed at batch sizes above 1 (llama-cpp-python decodes one "
                "sequence): not measured in llama.cpp yet")
    return None


def gguf_coverage(path: str | os.PathLike, types: dict[str, str]) -> Coverage:
    """Weights in quantized tensors, and bytes of each part, from the file's own tensors."""
    from quantdask.gguf.source import read_gguf

    reader = read_gguf(path)
    quantized = quantized_bytes = 0
    full: dict[str, int] = {}
    by_type: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = types[tensor.name]
        if kind in FULL_PRECISION:
            role = re.sub(r"^blk\.\d+\.", "", tensor.name).removesuffix(".weight")
            full[role] = full.get(role, 0) + int(tensor.n_elements)
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

    covered = need(made.covered, "covered")
    quantizing = canonical(str(_options(run).type)) not in FULL_PRECISION
    if quantizing and not covered.quantized_params:
        raise UnsupportedHere("llama.cpp's quantizer left every tensor in full precision")
    return made, covered_record(covered, need(made.source, "source").param_count, quantizing)


def score_in_llama_cpp(run: JobContext, made: Made) -> tuple[Made, Scored]:
    """The eval windows through llama.cpp (``runtime.llama_cpp_meter``), then the core's
    score phase on that meter."""
    from quantdask.gguf.runtime import llama_cpp_meter

    with run.watch("eval"):
        meter = llama_cpp_meter(need(made.runtime_model, "runtime_model"), run.reference.windows,
                                run.reference.distribution, _device(run))
    return score(run, replace(made, meter=meter))


def keep_gguf(run: JobContext, made: Made) -> tuple[Made, Artifact | None]:
    """The job's last phase (``kept_gguf``); then the headers the job parsed go
    (``source.forget_readers``), so the next job on the slot does not hold them."""
    from quantdask.gguf.source import forget_readers

    try:
        return kept_gguf(run, made)
    finally:
        forget_readers()


def kept_gguf(run: JobContext, made: Made) -> tuple[Made, Artifact | None]:
    """The ``.gguf`` file as the job's artifact (``<to>/<job_id>/model-<TYPE>.gguf``), and with
    ``verify: true`` the file as kept loaded in llama.cpp again and scored on the first eval
    windows: ``reload_kl_delta`` against the score phase's KL on them. A failure is the
    ``artifact_error`` column, raised only when the sweep requires artifacts."""
    import shutil
    import tempfile

    from quantdask.gguf.runtime import llama_cpp_meter
    from quantdask.job.artifacts import (
        VERIFY_WINDOWS,
        directory_digest,
        publish,
        scored_kl,
        windows_kl,
    )

    settings, job = run.job.artifacts, run.job
    if settings is None or not settings.enabled:
        return made, None
    try:
        source = Path(need(made.runtime_model, "runtime_model"))
        with tempfile.TemporaryDirectory(prefix="quantdask-artifact-") as scratch:
            local = Path(scratch) / job.id
            local.mkdir()
            shutil.copy2(source, local / f"model-{canonical(str(_options(run).type))}.gguf")
            digest, size = directory_digest(str(local))
            saved = Path(publish(str(local), settings, job.id) or local)
            delta = None
            if settings.verify:
                reference = run.reference
                first = {k: t[:VERIFY_WINDOWS] for k, t in reference.distribution.items()}
                after = llama_cpp_meter(next(saved.glob("*.gguf")),
                                        reference.windows[:VERIFY_WINDOWS], first, _device(run))
                before = scored_kl(made.records)
                delta = None if before is None else windows_kl(after.window_rows()) - before
        log.info("artifact saved to %s: %d bytes, sha256 %s", settings.location(job.id), size,
                 digest)
        return made, Artifact(artifact_uri=settings.location(job.id), artifact_bytes=size,
                              artifact_sha256=digest, artifact_kept=True,
                              reload_kl_delta=delta)
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
        log.error("artifact not kept: %s", message)
        if settings.required:
            raise
        return made, Artifact(artifact_error=message)


def time_in_llama_cpp(run: JobContext, made: Made) -> tuple[Made, Speed | None]:
    """The sweep's speed block in llama.cpp, at batch size 1 (``gguf.speed``); other batch
    sizes are left out and said so (``runtime_skipped``)."""
    settings = run.job.speed
    if settings is None or 1 not in settings.batch_sizes:
        return made, None
    from quantdask.gguf.speed import llama_cpp_speed
    from quantdask.process import cpu_share
    from quantdask.process.runtime import held_resources

    whole = held_resources().get("GPU", 1.0) >= 1.0
    gpu = _device(run).gpu  # on a GPU worker, a cpu config runs on its cores
    with run.watch("speed"):
        rows = llama_cpp_speed(need(made.runtime_model, "runtime_model"),
                               run.reference.windows, settings, _device(run),
                               run.device_label if gpu else "cpu", whole,
                               None if gpu else cpu_share.others_busy,
                               run.job.eval.bos_token_id)
    return made, Speed(run.watch.seconds["speed"], speed=rows)


def score_tasks_in_llama_cpp(run: JobContext, made: Made) -> tuple[Made, TaskScores | None]:
    """The sweep's lm-eval tasks answered by the GGUF in llama.cpp (``gguf.tasks_lm``), with
    the torch baseline's scores beside each, as every job's are (``job.phases.tasks_scored``)."""
    tasks = run.job.tasks
    if tasks is None:
        return made, None
    from quantdask.gguf.tasks_lm import llama_cpp_lm
    from quantdask.measure.tasks import evaluate_lm

    source = need(made.source, "source")

    def evaluate():
        lm = llama_cpp_lm(need(made.runtime_model, "runtime_model"), source.tokenizer,
                          source.config, _device(run), tasks.max_length)
        try:
            return evaluate_lm(lm, tasks)
        finally:
            lm.close()

    return made, tasks_scored(run, evaluate)


def _importance(run: JobContext, base: Path, calibration: Calibration) -> dict:
    """The importance matrix of the job's model on the calibration windows (its float model
    built for it, then let go), named as the converted GGUF's tensors."""
    from quantdask.gguf.imatrix import importance
    from quantdask.gguf.source import read_gguf

    reader = read_gguf(base)
    architecture = reader.fields["general.architecture"].contents()
    source, _ = cached_model_source(run.job.model)
    with calibration.measure(), source.weights():
        model = source.build(run.device).eval()
        try:
            return importance(model, calibration.windows, architecture,
                              run.job.eval.batch_size)
        finally:
            del model


def _options(run: JobContext) -> GgufOptions:
    return cast(GgufOptions, run.job.options)


def _threads() -> int:
    import torch

    return max(1, torch.get_num_threads())


def _device(run: JobContext):
    """Where llama.cpp runs this job (``gguf.runtime.RuntimeDevice``): the config's device,
    on the slot's threads."""
    from quantdask.gguf.runtime import RuntimeDevice

    return RuntimeDevice(_threads(), _options(run).device == "cuda")


@contextlib.contextmanager
def _scratch():
    import tempfile

    from quantdask.util import scratch_root

    with tempfile.TemporaryDirectory(prefix="quantdask-gguf-", dir=scratch_root()) as folder:
        yield folder


GGUF_PHASES: tuple[Phase, ...] = (load_gguf, quantize_gguf_phase, gguf_covered,
                                  score_in_llama_cpp, score_tasks_in_llama_cpp, time_in_llama_cpp,
                                  keep_gguf)
"""What a GGUF job does, in order."""
