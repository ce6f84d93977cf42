"""What a backend is given of a model and knows of it: the worker's model source (a protocol,
declared here where it is used; ``process.model_source.ModelSource`` is the worker's), the
driver's facts read from the model's files, and a quantized model a backend saved."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class ModelSource(Protocol):
    """What a backend's hooks may call on the unquantized model they are given: its spec
    (``location``, ``trust_remote_code``), config, transformers class, tokenizer and dtype;
    ``build(device, quantization_config=None)`` a new model from the weights the job holds;
    ``empty_model()`` the model on the meta device."""

    spec: Any  # the sweep file's ModelSpec (a layer above this one)
    config: Any
    model_class: Any
    tokenizer: Any
    dtype: torch.dtype
    param_count: int

    def build(self, device: str, quantization_config: Any = None) -> torch.nn.Module: ...

    def empty_model(self) -> Any: ...


@dataclass(frozen=True)
class ModelFacts:
    """What the driver knows of a model without loading it (for ``Backend.check``)."""

    linear_in_features: dict[str, int]  # 2-D weight name (without .weight) -> input width
    weight_bytes: int  # the checkpoint's size on disk
    cuda: bool  # whether this machine has a CUDA GPU (where the plan assumes jobs run)
    checkpoint_bits: int = 16  # bits per weight as stored (float32: 32)
    loaded_bits: int = 16  # bits per weight once loaded (the model spec's dtype, else stored)
    vocab_size: int = 0  # the eval's logits are (batch, seq_len, vocab_size)
    # Every module holding a ``weight`` parameter: (name, class, weights in it), from the model
    # built on the meta device; and all the model's weights (tied ones once). Empty: unknown.
    weight_modules: tuple[tuple[str, type, int], ...] = ()
    param_count: int = 0
    # From config.json: the most positions it takes (None: its family sets no hard limit, or
    # unknown), and the shape of its KV cache (0: unknown), for the generation's memory.
    max_positions: int | None = None
    layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    model_type: str = ""  # config.json's (the family: "llama"); empty: unknown
    hidden_size: int = 0  # the width of the hidden states between decoder layers (0: unknown)


@dataclass(frozen=True)
class SavedQuantized:
    """A quantized model a backend saved (a :class:`StreamedFit`): its folder, the
    transformers quantization config to load it with (None: the one saved in it), and what
    to do to each loaded module after loading (``prepare(module)``; None: nothing)."""

    directory: str
    loading: Any = None
    prepare: Callable[[torch.nn.Module], None] | None = None
