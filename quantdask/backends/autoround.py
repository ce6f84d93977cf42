"""AutoRound (Intel's sign-gradient rounding): calibration-based grouped integer weights, an
optional backend.

Install with ``pip install 'quantdask[autoround]'``. AutoRound tunes each decoder block's
rounding and clipping on the sweep's calibration windows (``calibration:``) for ``iters`` steps
(0: plain round-to-nearest with the same format, the fair baseline for what calibration buys),
then quantdask exports the model in AutoRound's own format and loads it back with
``from_pretrained``, as a user ships and runs it: what is measured is the packed model
(GPTQ-style ``qweight``/``qzeros``/``scales`` layers), not the fake-quantized float one tuning
leaves. The linear layers of the decoder blocks are quantized (``nn.Linear`` and GPT-2's
``Conv1D``); the output head and embeddings stay in full precision.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass

from quantdask.backends.base import (
    Backend,
    HostWork,
    Sizing,
    missing_library,
    named_in,
    require_library,
    skip_label,
)
from quantdask.backends.capabilities import Calibrated, Dequantizes, Lacks, Savable, Searchable
from quantdask.backends.options import LM_HEAD, BackendOptions, option, skip_modules_option
from quantdask.backends.packed import dequantize_packed_layer
from quantdask.errors import SpecError
from quantdask.randomness import global_generators
from quantdask.util import restore_environment, scratch_root

BITS = (2, 3, 4, 8)
DEFAULT_ITERS = 200  # AutoRound's own default


@dataclass(frozen=True)
class AutoRoundOptions(BackendOptions):
    """AutoRound's options."""

    bits: int | None = option(int, choices=BITS, help="bits per weight")
    group_size: int | None = option(int, choices=(32, 64, 128), default=128,
                                    help="weights sharing one scale and zero (default 128)")
    sym: bool | None = option(bool, default=True, help="symmetric integers (default true)")
    iters: int | None = option(
        int, default=DEFAULT_ITERS, check=lambda v: v >= 0, check_hint="must be 0 or more",
        help=f"tuning steps per block (default {DEFAULT_ITERS}; 0: round-to-nearest)")
    skip_modules: tuple[str, ...] | None = skip_modules_option()

    def complete(self) -> AutoRoundOptions:
        return complete_options(self)


AUTOROUND = ("auto_round", "auto-round", "'quantdask[autoround]'")  # module, name, install


def complete_options(options: AutoRoundOptions) -> AutoRoundOptions:
    if options.bits is None:
        raise SpecError("bits", f"is required for autoround: one of {', '.join(map(str, BITS))}")
    return options


def config_label(options: AutoRoundOptions) -> str:
    label = f"autoround {options.bits}b g{options.group_size}"
    label += " rtn" if options.iters == 0 else f" i{options.iters}"
    if not options.sym:
        label += " asym"
    return label + skip_label(options.skip_modules, LM_HEAD)


def _is_linear(module_class: type) -> bool:
    """The classes AutoRound quantizes: exactly ``nn.Linear`` and ``Conv1D`` (a subclass such
    as Falcon's ``FalconLinear`` is left alone, and the job is skipped with that reason)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return module_class in (torch.nn.Linear, Conv1D)


def selects(name: str, module_class: type, options: AutoRoundOptions) -> bool:
    """Every linear layer but the skipped ones (the head by default, which AutoRound leaves)."""
    return _is_linear(module_class) and not named_in(name, options.skip_modules)


def check_autoround(options: AutoRoundOptions, facts) -> str | None:
    return missing_library(*AUTOROUND)


def quantize_autoround(source, options: AutoRoundOptions, device: str, calibration):
    """Tune on ``calibration``'s windows, export in AutoRound's format, load the export."""
    import torch
    from transformers import AutoModelForCausalLM

    auto_round = require_library(*AUTOROUND)
    # Its notices (recommended call styles, a faster kernel package) are not the job's news.
    logging.getLogger("autoround").setLevel(logging.ERROR)
    model = source.build(device)
    # AutoRound rounds the weights in place; the built model's tensors are the job's held
    # originals (per-layer stats and coverage compare against them): tune a copy.
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    classes = {name: type(m) for name, m in model.named_modules() if _is_linear(type(m))}
    # AutoRound looks at the model's directory (for a multimodal processor); built from held
    # weights, the model names none, and AutoRound would try the hub for it.
    model.name_or_path = model.config._name_or_path = source.spec.location
    windows = calibration.windows
    skipped = {name: {"bits": 16} for name, module in model.named_modules()
               if _is_linear(type(module)) and named_in(name, options.skip_modules)}
    samples = [{"input_ids": w[None], "attention_mask": torch.ones_like(w)[None]}
               for w in windows]
    # AutoRound seeds the process-global generators (its seed, 42) and shuffles its batches
    # with Python's random, taking no generator: it tunes alone among the jobs packed on this
    # worker, so that its draws depend on its seed only (quantdask.randomness).
    scratch = tempfile.mkdtemp(prefix="quantdask-autoround-", dir=scratch_root())
    try:
        with global_generators(draws=True), _environment_kept(os.path.join(scratch, "work")):
            # iters 0 is plain round-to-nearest (AutoRound's optimized RTN would search
            # scales on the data's activations: calibration by another name).
            tuner = auto_round.AutoRound(
                model, source.tokenizer, bits=options.bits, group_size=options.group_size,
                sym=options.sym, iters=options.iters, disable_opt_rtn=options.iters == 0,
                dataset=samples, nsamples=len(samples), seqlen=windows.size(1),
                batch_size=min(8, len(samples)), layer_config=skipped, device_map=device)
            with calibration.measure():
                tuner.quantize()
        export = os.path.join(scratch, "model")
        tuner.save_quantized(export, format="auto_round", inplace=True)
        del tuner, model
        _release_contexts()  # before the shipped model loads: the job's peak
        # Loaded as a user would load the shipped model (on CPU, AutoRound's torch kernels run
        # it in float16); its weights are read into memory, so the export can go at once.
        shipped = AutoModelForCausalLM.from_pretrained(export, device_map=device)
    finally:
        _release_contexts()  # (a failed tuning's keep its model too)
        shutil.rmtree(scratch, ignore_errors=True)
    for name, module in shipped.named_modules():
        if name in classes and hasattr(module, "qweight"):
            module.source_cls = classes[name]  # per-layer stats: how the checkpoint holds it
    return shipped


@contextlib.contextmanager
def _environment_kept(work_space: str):
    """The tuning's process-wide environment, put back after: AutoRound's work space
    (``AR_WORK_SPACE``, its offload and caches), which it would make in the working
    directory (a user's project folder), in ``work_space`` instead, and what it sets itself
    (``CUBLAS_WORKSPACE_CONFIG``). The tuning runs alone among the worker's jobs
    (``global_generators``)."""
    saved = dict(os.environ)
    os.environ["AR_WORK_SPACE"] = work_space
    try:
        yield
    finally:
        restore_environment(saved)


def _release_contexts() -> None:
    """Let go of AutoRound's process-wide contexts: its ``ModelContext`` singleton keeps the
    tuned model (and the tokenizer) until the next AutoRound is made, which on a worker is
    hundreds of MiB the slot would hold between jobs (516 MiB for a 172 MB bf16 checkpoint:
    RESULTS.md section 18.1)."""
    import importlib

    for module, name in (("auto_round.context.model", "ModelContext"),
                         ("auto_round.context.compress", "CompressContext")):
        try:
            context = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # a release without them keeps nothing there
            continue
        context.reset_context()


AUTOROUND_WORK = HostWork(model_copies=4.0, imports=266 * 2**20)
"""AutoRound's job on a CPU slot: the model built, the copy it tunes, that copy in float32
while it tunes (on a bf16 checkpoint: 2 copies), and its library's import. Measured on
the bf16 large-vocabulary checkpoint (benchmarks/RESULTS.md section 18.1); on a float32
checkpoint the float32 copy is the tuned one, and this over-counts by two copies."""


def weight_bits(options: AutoRoundOptions, loaded_bits: int) -> float:
    """Tuning holds the whole model as loaded (plus a block's activations)."""
    return float(loaded_bits)


autoround_backend = Backend(
    name="autoround",
    quantize=quantize_autoround,
    options=AutoRoundOptions,
    label=config_label,
    check=check_autoround,
    sizing=Sizing(selects=selects, weight_bits=weight_bits,
                  host_work=lambda options: AUTOROUND_WORK),
    capabilities=(
        Calibrated(), Dequantizes(dequantize_packed_layer), Savable(),
        Lacks(Searchable, "AutoRound tunes each decoder block's rounding on the activations "
                          "of the blocks before it, so a module quantized alone is not what "
                          "AutoRound makes of it: one-module probes cannot predict its mixes "
                          "(its layer_config mixes widths within one run, which a sweep's "
                          "config can give)"),
    ),
    description="AutoRound 2-8 bit grouped integer weights, tuned on calibration data "
                "(optional: pip install 'quantdask[autoround]')",
)
