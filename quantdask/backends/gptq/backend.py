"""GPTQ and AWQ, the formats most quantized models are served in, through gptqmodel: optional
backends fitted on the sweep's calibration windows.

Install with ``pip install 'quantdask[gptq]'``. Both quantize the linear layers of the decoder
blocks in gptqmodel's model definition of the family (the output head and embeddings stay in
full precision), save the model in the standard checkpoint format (``quantization_config`` in
config.json, packed ``qweight``/``qzeros``/``scales``) and load it back with plain
``from_pretrained``, as a user ships and serves it: what is measured is that model.

gptqmodel ends the whole process (``os._exit``) when one of its pool threads meets an input it
cannot take, so every shape and family it was not checked on is refused before it is called
(the families and the evidence: ``quantdask.backends.gptq.families``): in the plan
(``check``) and again on the worker (:class:`UnsupportedHere`, the job skipped with the
reason). What it changes in the process (its environment, the root logger, printing, log
files in the working directory) is put back after each job
(``quantdask.backends.gptq.process``): later jobs on the worker see what they would have seen
without it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from quantdask.backends.base import (
    Backend,
    HostWork,
    ModelFacts,
    SavedQuantized,
    Sizing,
    missing_library,
    named_in,
    require_library,
)
from quantdask.backends.capabilities import (
    Calibrated,
    Dequantizes,
    Lacks,
    ModuleAlone,
    Savable,
    Searchable,
    StreamedFit,
)
from quantdask.backends.gptq.families import GPTQ_STREAMED_FAMILIES, family_refusal
from quantdask.backends.gptq.mixed import (
    FUSED,
    MODULE_KEYS,
    PROXY,
    SHIPS_AS,
    UNEXPORTED,
    dequantize_gptq_layer,
    dynamic_config,
    expert_shapes,
    layer_formats,
    mixable,
    rtn_proxy,
)
from quantdask.backends.gptq.options import AwqOptions, GptqOptions, awq_label, gptq_label
from quantdask.backends.gptq.process import logs_in, process_state_kept
from quantdask.backends.gptq.saved import (
    cpu_kernel,
    eager_kernels,
    load_mixed,
    load_saved,
    refuse_missing,
    refuse_unquantized_experts,
    ships_its_export,
)
from quantdask.backends.options import LM_HEAD
from quantdask.backends.packed import dequantize_packed_layer
from quantdask.backends.per_module import fused_expert_params, unknown_modules
from quantdask.errors import UnsupportedHere
from quantdask.randomness import global_generators
from quantdask.util import heap_trimmed, scratch_root

GPTQMODEL = ("gptqmodel", "gptqmodel", "'quantdask[gptq]'")  # module, name, install

AWQ_NOT_STREAMED = ("gptqmodel's checkpoint-backed AWQ fit saves another model than its resident "
                    "fit (its scaled norms and weights differ), and a job's figures must not "
                    "depend on where it runs")

# AWQ searches a clipping range for every layer but these (by name), in batches of 64 outputs.
AWQ_UNCLIPPED = ("q_", "k_", "query", "key", "Wqkv")


def _is_linear(module_class: type) -> bool:
    import torch
    from transformers.pytorch_utils import Conv1D

    return module_class in (torch.nn.Linear, Conv1D)


def selects(name: str, module_class: type, options) -> bool:
    """The linear layers of the decoder blocks but the skipped ones (never the head)."""
    return (_is_linear(module_class) and not named_in(name, options.skip_modules)
            and not named_in(name, LM_HEAD))


def _shapes(facts: ModelFacts, options) -> dict[str, tuple[int, int]]:
    """name -> (in, out) of each layer the config quantizes."""
    shapes = {}
    for name, module_class, count in facts.weight_modules:
        width = facts.linear_in_features.get(name)
        if width and selects(name, module_class, options):
            shapes[name] = (width, count // width)
    return shapes


def unsupported(method: str, options, model_type: str,
                shapes: dict[str, tuple[int, int]]) -> str | None:
    """Why gptqmodel cannot take this config on this model (family, layer widths), or None:
    each would end the worker's process, or reload to a wrong model."""
    refused = family_refusal(method, model_type)  # (gptq_families: the evidence)
    if refused:
        return refused
    formats = layer_formats(options, shapes) if method == "gptq" else {}
    for name, (width, out) in shapes.items():
        bits, group = formats.get(name, (options.bits, options.group_size))
        if group > 0 and width % group:
            return (f"group_size={group} does not divide {name}'s {width} inputs; choose a "
                    "group size that divides every layer's")
        if method == "gptq" and bits == 4 and out % 16:
            return (f"{name} has {out} outputs: a 4-bit GPTQ layer reloads on the CPU only with "
                    "a multiple of 16")
        if method == "awq":
            clipped = not any(part in name.rsplit(".", 1)[-1] for part in AWQ_UNCLIPPED)
            if out % (64 if clipped else 8):
                return (f"{name} has {out} outputs: AWQ takes layers whose outputs are a "
                        f"multiple of {64 if clipped else 8}")
    return None


def _check(method: str):
    def check(options, facts: ModelFacts) -> str | None:
        missing = missing_library(*GPTQMODEL)
        if missing or not facts.model_type:
            return missing  # a model whose config is not here: the worker checks
        # (without the layer shapes, the family alone; the worker checks the widths)
        shapes = _shapes(facts, options)
        return (shapes and unknown_modules(options, mixable(set(shapes), options), method)
                or unsupported(method, options, facts.model_type, shapes))
    return check


def _quantize_config(quantize_config, method: str, options):
    """gptqmodel's ``QuantizeConfig`` for the options."""
    common = dict(bits=options.bits, group_size=options.group_size, sym=options.sym,
                  offload_to_disk=False)  # it never quantizes the head
    if method == "awq":
        return quantize_config(method="awq", format="gemm", **common)
    return quantize_config(desc_act=options.desc_act, damp_percent=options.damp_percent,
                           dynamic=dynamic_config(options),
                           # its activation-ordered groups need groups: off for one per row
                           act_group_aware=options.group_size > 0 and not options.desc_act,
                           **common)


def _fittable_model(method: str, source, options, device: str):
    """The model built for this job, refused if gptqmodel cannot take it, as a copy it may
    write into (AWQ rescales norms and weights in place; the built model's tensors are the
    job's held originals), in half precision for AWQ."""
    import torch

    model = source.build(device)
    shapes = {name: (m.in_features, m.out_features) for name, m in model.named_modules()
              if selects(name, type(m), options) and isinstance(m, torch.nn.Linear)}
    shapes |= expert_shapes(model)  # (fitted one linear per expert: checked as one)
    reason = (unknown_modules(options, mixable(set(shapes), options, model), method)
              or unsupported(method, options, model.config.model_type, shapes))
    if reason:
        raise UnsupportedHere(reason)
    if method == "awq" and model.dtype == torch.float32:
        # AWQ's kernels take half precision only (bfloat16 on the CPU), as AWQ models ship;
        # the cast makes new tensors, a copy already.
        return model.to(torch.bfloat16 if device == "cpu" else torch.float16)
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    return model


@contextlib.contextmanager
def _gptqmodel(method: str, options, device: str) -> Iterator[tuple[Any, dict]]:
    """gptqmodel imported, with what it changes in the process kept (``gptq_process``):
    its ``QuantizeConfig`` for ``options`` on ``device``, and the extra ``quantize``
    arguments (AWQ's torch kernel on the CPU)."""
    with process_state_kept():
        logging.getLogger("tokenicer").setLevel(logging.WARNING)  # its INFO notes, to stderr
        require_library(*GPTQMODEL)
        from gptqmodel import BACKEND, QuantizeConfig
        from gptqmodel.models._const import normalize_device

        logging.getLogger("logbar").setLevel(logging.ERROR)  # its logger (to stdout)
        config = _quantize_config(QuantizeConfig, method, options)
        config.device = normalize_device(device)
        config.calculate_bits_per_weight()
        yield config, ({"backend": BACKEND.AWQ_TORCH} if method == "awq" and device == "cpu"
                       else {})


def _fit_and_save(wrapped, calibration, extra: dict, scratch: str, export: str) -> None:
    """Fit gptqmodel's ``wrapped`` model on ``calibration``'s windows, save it to ``export``."""
    windows = calibration.windows
    wrapped.model.seqlen = windows.size(1)
    # (alone among the worker's jobs: global_generators holds the others' tuning)
    try:
        with global_generators(draws=True), calibration.measure(), \
                logs_in(os.path.join(scratch, "logs")):
            # Every window counts (it drops those of 10 tokens or fewer by default).
            wrapped.quantize(list(windows), calibration_data_min_length=0, **extra)
    finally:
        _forget_stop_forward()
        _flush_pool_workers()
    wrapped.save(export)  # as quantized: the checkpoint's own layout


GPTQMODEL_WORK = HostWork(imports=338 * 2**20)
"""GPTQ's job on a CPU slot: gptqmodel's import, and the default working memory."""
AWQ_WORK = dataclasses.replace(GPTQMODEL_WORK, model_copies=1.5)
"""AWQ's: GPTQ's, and one and a half copies of the model while it searches its scales
(on the bf16 large-vocabulary checkpoint, 234 MiB above GPTQ's figure: RESULTS.md 18.1)."""


def _forget_stop_forward() -> None:
    """gptqmodel ends each capture pass by raising one module-level ``StopForward``, whose
    traceback then keeps the frames of its last raise, and through their callers this job's
    model and its float weights, alive after the job: 600 MiB of a 172 MB checkpoint with a
    151,936-token vocabulary stayed in the worker (benchmarks/RESULTS.md section 18.1)."""
    from gptqmodel.nn_modules import hooked_linear

    stop = getattr(hooked_linear, "STOP_FORWARD_EXCEPTION", None)
    if isinstance(stop, BaseException):
        stop.__traceback__ = stop.__context__ = stop.__cause__ = None


def _flush_pool_workers(timeout_s: float = 60.0) -> None:
    """gptqmodel's pool threads keep their last task (its function, arguments and result) in
    their loop's locals while they wait for the next one, and through the task's closure
    its processor and this job's model: 354 MiB of an AWQ fit stayed in the worker on a
    172 MB checkpoint (benchmarks/RESULTS.md section 18.1). A no-op on each thread lets go
    of them. (Its private pool API: a release without it keeps what it keeps.)"""
    import gptqmodel

    pool = getattr(gptqmodel, "_DEVICE_THREAD_POOL", None)
    groups = getattr(pool, "_worker_groups", None)
    scheduled = getattr(pool, "_mark_scheduled", None)
    if not isinstance(groups, dict) or scheduled is None:
        return
    flushed = []
    for key, workers in list(groups.items()):
        for worker in list(workers):
            scheduled(key)  # the thread marks it finished: the pool's in-flight count stays
            flushed.append(worker.submit(_nothing))
    concurrent.futures.wait(flushed, timeout=timeout_s)


def _nothing() -> None:
    return None


def _quantize(method: str, source, options, device: str, calibration):
    """Fit on ``calibration``'s windows, save in the standard format, load that with plain
    ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    model = _fittable_model(method, source, options, device)
    classes = {name: type(m) for name, m in model.named_modules() if _is_linear(type(m))}
    with _gptqmodel(method, options, device) as (config, extra):
        import defuser
        from gptqmodel.models.auto import MODEL_MAP
        from gptqmodel.models.base import BaseQModel

        # Mixtral's experts, one linear each: so saved, they reload with GPTQModel.load only
        per_expert = bool(fused_expert_params(model))
        defuser.convert_model(model, cleanup_original=False)
        wrapped = MODEL_MAP.get(model.config.model_type, BaseQModel)(
            model, quantized=False, quantize_config=config, tokenizer=source.tokenizer,
            model_local_path=source.spec.location)
        scratch = tempfile.mkdtemp(prefix=f"quantdask-{method}-", dir=scratch_root())
        export = os.path.join(scratch, "model")
        try:
            _fit_and_save(wrapped, calibration, extra, scratch, export)
            del wrapped, model
            if getattr(options, "modules", None) or per_expert:  # as its users load it
                shipped, loading = load_mixed(export, device), {}
            else:
                loaded: Any = AutoModelForCausalLM.from_pretrained(  # (model, loading info)
                    export, device_map=device, output_loading_info=True,
                    quantization_config=cpu_kernel(method, options) if device == "cpu"
                    else None)
                shipped, loading = loaded
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    ships_its_export(shipped, scratch, export)
    refuse_missing(method, loading)
    if per_expert:
        refuse_unquantized_experts(method, shipped)
    eager_kernels(shipped)
    for name, module in shipped.named_modules():
        if name in classes and hasattr(module, "qweight"):
            module.source_cls = classes[name]  # per-layer stats: how the checkpoint holds it
    return shipped.eval()


def quantize_gptq_streamed(source, options: GptqOptions, device: str, calibration,
                           directory: str) -> SavedQuantized:
    """GPTQ fitted block by block from the checkpoint, as gptqmodel fits a model larger than
    memory (its ``offload_to_disk``: the model built empty, each decoder layer read from the
    checkpoint for its turn, quantized, written to disk and dropped), then saved under
    ``directory``: the same checkpoint, to the bit, as the resident fit saves
    (``tests/test_streaming.py``)."""
    import torch

    if options.modules:
        raise UnsupportedHere("a GPTQ mix (per-module bits) is fitted resident only: its "
                              "streamed fit is not checked yet")
    shapes = {name: (m.in_features, m.out_features)
              for name, m in source.empty_model().named_modules()
              if selects(name, type(m), options) and isinstance(m, torch.nn.Linear)}
    reason = unsupported("gptq", options, source.config.model_type, shapes)
    if reason:
        raise UnsupportedHere(reason)
    with _gptqmodel("gptq", options, device) as (config, extra):
        from gptqmodel import GPTQModel

        config.offload_to_disk = True
        config.offload_to_disk_path = os.path.join(directory, "offload")
        wrapped = GPTQModel.load(source.spec.location, config, dtype=source.dtype,
                                 trust_remote_code=source.spec.trust_remote_code)
        export = os.path.join(directory, "model")
        with heap_trimmed:  # (gptqmodel's pool threads keep what they free)
            _fit_and_save(wrapped, calibration, extra, directory, export)
    shutil.rmtree(config.offload_to_disk_path, ignore_errors=True)
    return SavedQuantized(export, cpu_kernel("gptq", options) if device == "cpu" else None,
                          prepare=eager_kernels)


def quantize_gptq(source, options: GptqOptions, device: str, calibration):
    """GPTQ: each layer's weights rounded one column at a time, the error so far spread over
    the columns left, from the calibration activations' Hessian."""
    return _quantize("gptq", source, options, device, calibration)


def quantize_awq(source, options: AwqOptions, device: str, calibration):
    """AWQ: the input channels that carry large activations scaled up before rounding (and the
    op before scaled down), clipping searched per layer."""
    return _quantize("awq", source, options, device, calibration)


CALIBRATED_ALONE = ("each layer is quantized against the activations of the layers quantized "
                    "before it, so a module quantized alone is not what the method makes of "
                    "it: one-module probes cannot predict its mixes")

gptq_backend = Backend(
    name="gptq",
    quantize=quantize_gptq,
    options=GptqOptions,
    label=gptq_label,
    check=_check("gptq"),
    sizing=Sizing(selects=selects, host_work=lambda options: GPTQMODEL_WORK),
    capabilities=(
        Calibrated(), Dequantizes(dequantize_gptq_layer), Savable(load=load_saved),
        StreamedFit(quantize_gptq_streamed, families=GPTQ_STREAMED_FAMILIES),
        Searchable(MODULE_KEYS, proxy=ModuleAlone(rtn_proxy), proxy_is=PROXY, experts=True,
                   ships_as=SHIPS_AS, unexported_why=UNEXPORTED, ties=FUSED),
    ),
    description="GPTQ 2-8 bit grouped integer weights fitted on calibration data, saved in the "
                "GPTQ format (optional: pip install 'quantdask[gptq]')",
)

awq_backend = Backend(
    name="awq",
    quantize=quantize_awq,
    options=AwqOptions,
    label=awq_label,
    check=_check("awq"),
    sizing=Sizing(selects=selects, host_work=lambda options: AWQ_WORK),
    capabilities=(
        Calibrated(), Dequantizes(dequantize_packed_layer), Savable(load=load_saved),
        Lacks(Searchable, CALIBRATED_ALONE), Lacks(StreamedFit, AWQ_NOT_STREAMED),
    ),
    description="AWQ 4-bit activation-aware grouped weights fitted on calibration data, saved "
                "in the AWQ format, run in half precision (optional: pip install "
                "'quantdask[gptq]')",
)
