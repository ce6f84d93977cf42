"""What the driver knows of a model from its local files, without loading its weights.

>>> model_facts(job).weight_bytes  # doctest: +SKIP
3482128
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from quantdask.backends.base import ModelFacts
from quantdask.cluster import cuda_device_count
from quantdask.spec import Job

log = logging.getLogger("quantdask.model_facts")

DTYPE_BITS = {"float32": 32, "float64": 64, "bfloat16": 16, "float16": 16}


def _linear_widths(directory: Path, trust_remote_code: bool) -> dict[str, int]:
    """Every ``nn.Linear`` of the model and its input width, from its config alone: the model
    is built on PyTorch's meta device, which allocates nothing."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return {name: module.in_features for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)}




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
    widths: dict[str, int] = {}
    if layers:
        try:
            widths = _linear_widths(directory, job.model.trust_remote_code)
        except Exception as error:  # noqa: BLE001 - not a causal LM, remote code, ...: the
            log.warning("no layer shapes for %s (%s); shape checks are left to the workers",
                        job.model.label, error)  # plan goes on, and the workers still check
    stored = DTYPE_BITS.get(str(text_config.get("dtype") or text_config.get("torch_dtype")), 16)
    return ModelFacts(linear_in_features=widths, weight_bytes=weight_bytes, cuda=cuda,
                      checkpoint_bits=stored,
                      loaded_bits=DTYPE_BITS.get(job.model.dtype, stored),  # "auto": as stored
                      vocab_size=int(text_config.get("vocab_size") or 0))
