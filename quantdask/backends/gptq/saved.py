"""A fitted GPTQ or AWQ model saved and loaded back as its users load it: the checkpoint
gptqmodel saved is what ships (``save_pretrained`` copies it), plain ``from_pretrained`` with
gptqmodel's torch kernel on the CPU, and a mix (``gptq_mixed``) or a mixture of experts with
``GPTQModel.load``."""

from __future__ import annotations

import json
import os
import shutil
import weakref
from pathlib import Path
from typing import Any

from quantdask.errors import UnsupportedHere


def eager_kernels(model) -> None:
    """Its torch kernel compiles its dequantization at the first call, once per layer shape:
    seconds of a C++ compiler per job, past torch's recompile limit (warned on stderr); the
    eager function is what runs here."""
    for module in model.modules():
        module.__dict__.pop("dequantize_weight", None)


def refuse_missing(method: str, loading: dict) -> None:
    """A reload that left weights out, which transformers fills at random and says nothing
    of (Falcon's layers, or one left unquantized), is no model to measure."""
    missing = loading.get("missing_keys") or []
    if missing:
        raise UnsupportedHere(f"the saved {method} model reloads without {len(missing)} of "
                              f"its weights ({sorted(missing)[0]}, ...)")


def refuse_unquantized_experts(method: str, model) -> None:
    """A mixture of experts reloaded (``GPTQModel.load``) with an expert's linear not
    quantized is not the model fitted: refused, naming it."""
    import re

    plain = [name for name, module in model.named_modules()
             if re.search(r"\.experts\.\d+\.\w+_proj$", name) and not hasattr(module, "qweight")]
    if plain:
        raise UnsupportedHere(f"the saved {method} model reloads {len(plain)} experts' linears "
                              f"unquantized ({plain[0]}, ...)")


def ships_its_export(model, scratch: str, export: str) -> None:
    """Make ``model.save_pretrained(directory)`` (the sweep's artifacts) write the checkpoint
    gptqmodel saved, kept until the model goes. The loaded model holds its zero points in the
    kernel's layout, and saving it writes them so (transformers reloads that as garbage: KL 5
    on the demo model)."""
    def save_pretrained(directory, **_):
        shutil.copytree(export, directory, dirs_exist_ok=True)

    model.save_pretrained = save_pretrained
    weakref.finalize(model, shutil.rmtree, scratch, ignore_errors=True)


def cpu_kernel(method: str, options):
    """The loading settings that pick gptqmodel's plain torch kernel on the CPU. The one it
    picks by default repacks the weights at the first forward pass, and a model saved after
    that (the sweep's artifacts) no longer loads."""
    from transformers import AwqConfig, GPTQConfig
    from transformers.utils.quantization_config import AwqBackend

    if method == "gptq":
        return GPTQConfig(bits=options.bits, backend="torch")
    return AwqConfig(bits=options.bits, backend=AwqBackend.TORCH_AWQ)


def loads_with_gptqmodel(directory: str) -> bool:
    """Whether the checkpoint in ``directory`` loads only with ``GPTQModel.load``: a GPTQ mix
    (a ``dynamic`` config), or a mixture-of-experts model gptqmodel saved with one linear per
    expert, as its tensors' names say (defuser: transformers builds Mixtral's experts fused,
    and plain ``from_pretrained`` leaves them random)."""
    import re

    from safetensors import safe_open

    with open(os.path.join(directory, "config.json")) as config:
        quantization = json.load(config).get("quantization_config") or {}
    if quantization.get("dynamic"):
        return True
    names: list[str] = []
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names += list(f.keys())
    return any(re.search(r"\.experts\.\d+\.", name) for name in names)


def load_mixed(directory: str, device: str) -> Any:
    """A GPTQ checkpoint only gptqmodel loads (a mix, a mixture of experts:
    :func:`loads_with_gptqmodel`) loaded as its users load it, ``GPTQModel.load``
    (gptqmodel's plain torch kernel on the CPU), in the checkpoint's own dtype: the
    transformers model inside."""
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear

    with open(os.path.join(directory, "config.json")) as config:
        dtype = getattr(torch, json.load(config).get("dtype") or "float16")
    backend = BACKEND.TORCH if device == "cpu" else BACKEND.AUTO
    supported = TorchLinear.SUPPORTS_DTYPES
    if dtype == torch.float32 and device == "cpu":
        # gptqmodel's loader takes half precision only for its torch kernel, which runs in
        # float32 (transformers' loader runs it so for every uniform GPTQ job); in half
        # precision the layers it leaves unquantized would be another model than the one saved
        TorchLinear.SUPPORTS_DTYPES = [*supported, torch.float32]
    try:
        model = GPTQModel.load(directory, device=device, backend=backend, dtype=dtype).model
    finally:
        TorchLinear.SUPPORTS_DTYPES = supported
    for module in model.modules():  # its scales as stored (it casts them to ``dtype``)
        if hasattr(module, "qweight") and module.scales.dtype != torch.float16:
            module.scales = module.scales.half()
    return model


def load_saved(directory: str, device: str) -> Any:
    """A saved GPTQ or AWQ checkpoint reloaded as its users load it: with ``GPTQModel.load``
    where only that loads it (:func:`loads_with_gptqmodel`), else with plain
    ``from_pretrained`` (``Savable.load``)."""
    if loads_with_gptqmodel(directory):
        from quantdask.backends.gptq.process import process_state_kept

        with process_state_kept():
            return load_mixed(directory, device)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, device_map=device)
