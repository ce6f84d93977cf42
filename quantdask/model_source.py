"""The unquantized model a worker keeps in host memory, so each job only pays for quantizing."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from quantdask.spec import ModelSpec

DTYPES = ("auto", "float32", "bfloat16", "float16")

MODEL_CACHE_SIZE = 2
"""Full-precision models a worker process keeps between jobs (least recently used dropped)."""
_cache: OrderedDict[str, ModelSource] = OrderedDict()


@dataclass
class ModelSource:
    """A model's config, tokenizer and full-precision weights, loaded once per worker."""

    spec: ModelSpec
    config: Any
    model_class: type
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any
    dtype: torch.dtype
    param_count: int

    def build(self, device: str, quantization_config: Any = None) -> torch.nn.Module:
        """A new model on ``device`` from the cached weights, quantized by ``quantization_config``.

        The cached tensors are only read: a quantizer makes new ones, so jobs never see each
        other's weights.
        """
        model = self.model_class.from_pretrained(
            None,
            config=self.config,
            state_dict=self.state_dict,
            dtype=self.dtype,
            quantization_config=quantization_config,
            device_map=device,
        )
        model.eval()
        return model


def load_model_source(spec: ModelSpec) -> ModelSource:
    """Load ``spec``'s model on the host with transformers (local directory or hub id)."""
    import socket

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.path is not None and not os.path.isfile(os.path.join(spec.location, "config.json")):
        # The driver checked it on its machine; a worker on another node may not have it (and
        # transformers would go on to read the path as a hub id).
        raise FileNotFoundError(
            f"model directory {spec.location} is not on {socket.gethostname()} (where this "
            "worker runs): put the model at the same path on every node, or use `hub:` with "
            "each node's Hugging Face cache")

    dtype: Any = "auto" if spec.dtype == "auto" else getattr(torch, spec.dtype)
    common = {"trust_remote_code": spec.trust_remote_code, "revision": spec.revision}
    tokenizer = AutoTokenizer.from_pretrained(spec.location, **common)
    model = AutoModelForCausalLM.from_pretrained(spec.location, dtype=dtype, **common)
    state_dict = {k: v.detach() for k, v in model.state_dict().items()}
    return ModelSource(
        spec=spec,
        config=model.config,
        model_class=type(model),
        state_dict=state_dict,
        tokenizer=tokenizer,
        dtype=model.dtype,
        param_count=count_parameters(model),
    )


def count_parameters(model: torch.nn.Module) -> int:
    """Number of weights, each shared (tied) tensor counted once."""
    return sum(p.numel() for p in model.parameters())


def cached_model_source(spec: ModelSpec) -> tuple[ModelSource, bool]:
    """``spec``'s model from this process's cache, loading it on a miss; (source, was cached)."""
    key = json.dumps(spec.identity(), sort_keys=True)
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key], True
    _cache[key] = load_model_source(spec)
    while len(_cache) > MODEL_CACHE_SIZE:
        _cache.popitem(last=False)
    return _cache[key], False
