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
from quantdask.sweepfile.sweep import Job

log = logging.getLogger("quantdask.model_facts")

DTYPE_BITS = {"float32": 32, "float64": 64, "bfloat16": 16, "float16": 16}
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                   "max_sequence_length", "n_ctx")
"""Where a config says how many positions its model takes, by family (GPT-2's and GPT-J's
``n_positions``, MPT's ``max_seq_len``, ...), in the order they are looked for."""


def text_config(config: dict) -> dict:
    """The language model's part of a parsed config.json (multimodal configs nest it)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def read_config(directory: str | Path) -> dict:
    """``directory``'s config.json, its language model's part (empty when unreadable)."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return text_config(config) if isinstance(config, dict) else {}


def position_limit(config: dict) -> tuple[int | None, str]:
    """(the most positions the model of ``config`` takes, the field that says so), or (None,
    why there is none: ALiBi and state-space families set no hard limit). transformers does
    not enforce the limit of a rotary family: a longer input runs and means nothing."""
    for name in POSITION_FIELDS:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"{name} in its config.json"
    family = config.get("model_type") or "its family"
    return None, f"no hard limit: its config ({family}) names no {' / '.join(POSITION_FIELDS)}"


def _first_int(config: dict, *names: str) -> int:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def kv_shape(config: dict) -> tuple[int, int, int]:
    """(layers, key/value heads, head width) of the KV cache generation keeps, from the
    family's own field names (0: unknown; a state-space model keeps none)."""
    layers = _first_int(config, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    heads = _first_int(config, "num_attention_heads", "n_head", "n_heads", "num_heads")
    hidden = _first_int(config, "hidden_size", "n_embd", "d_model")
    if config.get("multi_query") and not config.get("new_decoder_architecture"):
        kv_heads = 1  # Falcon's multi-query attention: one key/value head
    else:
        kv_heads = _first_int(config, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _first_int(config, "head_dim") or (hidden // heads if heads else 0)
    return (layers, kv_heads, head_dim) if kv_heads and head_dim else (layers, 0, 0)


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
        # fused experts (one 3-D parameter per projection): members a search or a GGUF
        # config's ``modules`` may name, as the parameter's full name
        "fused_weights": tuple(name for name, p in model.named_parameters() if p.dim() == 3),
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
    config = read_config(directory)
    layer_facts: dict = {}
    if layers:
        try:
            layer_facts = _layer_facts(directory, job.model.trust_remote_code)
        except Exception as error:  # noqa: BLE001 - not a causal LM, remote code, ...: the
            log.warning("no layer shapes for %s (%s); shape checks are left to the workers",
                        job.model.label, error)  # plan goes on, and the workers still check
    stored = DTYPE_BITS.get(str(config.get("dtype") or config.get("torch_dtype")), 16)
    decoder_layers, kv_heads, head_dim = kv_shape(config)
    return ModelFacts(linear_in_features=layer_facts.get("linear_in_features", {}),
                      weight_modules=layer_facts.get("weight_modules", ()),
                      fused_weights=layer_facts.get("fused_weights", ()),
                      param_count=layer_facts.get("param_count", 0),
                      weight_bytes=weight_bytes, cuda=cuda,
                      checkpoint_bits=stored,
                      loaded_bits=DTYPE_BITS.get(job.model.dtype, stored),  # "auto": as stored
                      vocab_size=int(config.get("vocab_size") or 0),
                      max_positions=position_limit(config)[0], layers=decoder_layers,
                      kv_heads=kv_heads, head_dim=head_dim,
                      model_type=str(config.get("model_type") or ""),
                      hidden_size=_first_int(config, "hidden_size", "n_embd", "d_model"),
                      # unsaid: untied, the larger figure
                      tied_head=bool(text_config(config).get(
                          "tie_word_embeddings", config.get("tie_word_embeddings", False))))
