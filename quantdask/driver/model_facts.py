"""What the driver knows of a model from its local files, without loading its weights.

>>> model_facts(job).weight_bytes  # doctest: +SKIP
3482128
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from quantdask.backends.base import ModelFacts
from quantdask.cluster.operations import cuda_device_count
from quantdask.spec.sweep import Job

log = logging.getLogger("quantdask.model_facts")

DTYPE_BITS = {"float32": 32, "float64": 64, "bfloat16": 16, "float16": 16}


def _weight_modules(model) -> tuple[tuple[str, type, int], ...]:
    """(name, class, weights) of every module holding a ``weight`` parameter; a tied weight
    (an output head sharing the embedding's) belongs to the first module that holds it."""
    import torch

    seen: set[int] = set()
    modules = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and id(weight) not in seen:
            seen.add(id(weight))
            modules.append((name, type(module), weight.numel()))
    return tuple(modules)


def _layer_facts(directory: Path, trust_remote_code: bool) -> dict:
    """The model's layers from its config alone (it is built on PyTorch's meta device, which
    allocates nothing): every ``nn.Linear`` and its input width, every module holding a
    ``weight`` with its class and size, and the model's weight count (tied ones once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return {
        "linear_in_features": {name: module.in_features for name, module
                               in model.named_modules() if isinstance(module, torch.nn.Linear)},
        "weight_modules": _weight_modules(model),
        "param_count": sum(p.numel() for p in model.parameters()),
    }


def model_facts(job: Job, layers: bool = True) -> ModelFacts:
    """What the driver can learn of ``job``'s model from its local files (nothing for a hub
    id: nothing is downloaded). ``layers=False`` leaves out the layer shapes, which need
    transformers to build the model on the meta device."""
    directory = Path(job.model.location)
    cuda = cuda_device_count() > 0
    if job.model.hub or not directory.is_dir():
        return ModelFacts(linear_in_features={}, weight_bytes=0, cuda=cuda)
    weight_bytes = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin")
                       for f in directory.glob(pattern))
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    text_config = config.get("text_config") or config  # multimodal configs nest the LM's
    layer_facts: dict = {}
    if layers:
        try:
            layer_facts = _layer_facts(directory, job.model.trust_remote_code)
        except Exception as error:  # noqa: BLE001 - not a causal LM, remote code, ...: the
            log.warning("no layer shapes for %s (%s); shape checks are left to the workers",
                        job.model.label, error)  # plan goes on, and the workers still check
    stored = DTYPE_BITS.get(str(text_config.get("dtype") or text_config.get("torch_dtype")), 16)
    return ModelFacts(linear_in_features=layer_facts.get("linear_in_features", {}),
                      weight_modules=layer_facts.get("weight_modules", ()),
                      param_count=layer_facts.get("param_count", 0),
                      weight_bytes=weight_bytes, cuda=cuda,
                      checkpoint_bits=stored,
                      loaded_bits=DTYPE_BITS.get(job.model.dtype, stored),  # "auto": as stored
                      vocab_size=int(text_config.get("vocab_size") or 0))
