"""What a worker keeps of an unquantized model between jobs: its config, tokenizer and class.

Its weights stay in the checkpoint. A job maps them from there for as long as it runs (see
:meth:`ModelSource.weights`), and safetensors files are memory-mapped: the workers of one
machine share the OS page cache's one copy instead of each holding a private full-precision
model between jobs.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from quantdask.sweepfile.model import ModelSpec


MODEL_CACHE_SIZE = 4
"""Models whose config and tokenizer a worker process keeps (least recently used dropped)."""
_cache: OrderedDict[str, ModelSource] = OrderedDict()
_cache_lock = threading.Lock()


@dataclass
class ModelSource:
    """A model's config, tokenizer and class, loaded once per worker; its weights are mapped
    from the checkpoint only while a job holds :meth:`weights` (see the module's docstring)."""

    spec: ModelSpec
    config: Any
    model_class: Any  # a transformers auto class (AutoModelForCausalLM, ...)
    tokenizer: Any
    dtype: torch.dtype
    param_count: int
    _weights: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    _holders: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextlib.contextmanager
    def weights(self) -> Iterator[dict[str, torch.Tensor]]:
        """The unquantized weights on the host, by parameter name, while the block runs: what
        :meth:`build` makes models from and what a quantized model is compared against.

        Read from the checkpoint when the first job on this worker enters, shared by the jobs
        packed here meanwhile, released when the last one leaves. Memory-mapped, so the
        workers of a machine share one copy in the page cache, unless ``dtype`` converts them
        (then a private copy, for the jobs' duration only)."""
        with self._lock:
            weights = self._weights
            if weights is None:  # the first holder (the last one leaving drops them)
                fp_model = self._from_checkpoint("cpu")
                weights = {name: t.detach() for name, t in fp_model.state_dict().items()}
                self._weights = weights
            self._holders += 1
        try:
            yield weights
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    self._weights = None

    def build(self, device: str, quantization_config: Any = None) -> torch.nn.Module:
        """A new model on ``device``, quantized by ``quantization_config`` as it loads: from
        the weights a job holds (see :meth:`weights`), else straight from the checkpoint.

        Each call makes its own model, but an unquantized tensor is the held one, not a copy
        (a quantizer makes new tensors): a backend replaces weights and never writes into
        them, or packed jobs and the per-layer comparison would see its changes."""
        weights = self._weights
        if weights is None:
            return self._from_checkpoint(device, quantization_config)
        # Quantizing from the mapped weights, not the file again: a second mapping of the
        # checkpoint would count its pages twice in the job's peak resident set.
        model = self.model_class.from_pretrained(
            None, config=self.config, state_dict=weights, dtype=self.dtype,
            quantization_config=quantization_config, device_map=device)
        model.eval()
        return model

    def empty_model(self) -> Any:  # a transformers PreTrainedModel
        """The model on the meta device (nothing allocated but its buffers): its modules and
        shapes, no weights."""
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            # A copy: _from_config writes the dtype into the config the worker caches.
            model = self.model_class._from_config(copy.deepcopy(self.config), dtype=self.dtype)
        model.tie_weights()  # (as _empty_model's)
        _kept_in_float32(model, self.dtype)
        return model

    def _from_checkpoint(self, device: str, quantization_config: Any = None) -> torch.nn.Module:
        model = self.model_class.from_pretrained(
            self.spec.location,
            config=self.config,  # transformers copies it: a quantizer's changes stay there
            dtype=self.dtype,
            quantization_config=quantization_config,
            device_map=device,
            **_load_options(self.spec),
        )
        model.eval()
        return model


def _load_options(spec: ModelSpec) -> dict[str, Any]:
    return {"trust_remote_code": spec.trust_remote_code, "revision": spec.revision}


def load_model_source(spec: ModelSpec, weights: bool = True,
                      tokenizer: Any = None) -> ModelSource:
    """Load ``spec``'s config, tokenizer (unless given) and class with transformers (local
    directory or hub id); the weights are read once here, to check that they load and to count
    them, unless ``weights`` is False (a model streamed layer by layer: counted on the meta
    device)."""
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

    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(spec.location, **_load_options(spec))
    # In the checkpoint's own dtype: memory-mapped, not converted (only counted, dropped).
    model: Any = (AutoModelForCausalLM.from_pretrained(spec.location, dtype="auto",
                                                       **_load_options(spec))
                  if weights else _empty_model(spec))
    return ModelSource(
        spec=spec,
        config=model.config,
        model_class=type(model),
        tokenizer=tokenizer,
        dtype=model.dtype if spec.dtype == "auto" else getattr(torch, spec.dtype),
        param_count=count_parameters(model),
    )


def _empty_model(spec: ModelSpec) -> torch.nn.Module:
    """``spec``'s model on the meta device, in its checkpoint's dtype: its class and counts,
    no weights."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(spec.location, **_load_options(spec))
    stored = getattr(config, "dtype", None) or torch.float32
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, stored) if isinstance(stored, str) else stored,
            trust_remote_code=spec.trust_remote_code)
    # Built empty, a head tied to the embedding is a tensor of its own until tied (counted
    # twice: 205,120 weights for a tiny Gemma of 139,584), as a loaded model's is not.
    model.tie_weights()
    return model


def _kept_in_float32(model: Any, dtype: Any) -> None:
    """The parameters ``from_pretrained`` keeps in float32 whatever ``dtype`` (the family's
    ``_keep_in_fp32_modules``: DeepSeek-V3's router, say), made float32 in ``model`` as it
    loads them: its dtype plan, matched by transformers' own patterns."""
    import torch
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)
    if not plan:
        return
    pattern, groups, _ = build_glob_alternation(list(plan))
    for name, parameter in list(model.named_parameters()):
        found = pattern.search(name)
        if found is not None and found.lastgroup is not None:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            module._parameters[leaf] = torch.nn.Parameter(
                parameter.to(plan[groups[found.lastgroup]]), requires_grad=False)


def count_parameters(model: torch.nn.Module) -> int:
    """Number of weights, each shared (tied) tensor counted once."""
    return sum(p.numel() for p in model.parameters())


def cached_model_source(spec: ModelSpec, weights: bool = True) -> tuple[ModelSource, bool]:
    """``spec``'s model source from this process's cache, loading it on a miss;
    (source, was cached). Jobs packed on one worker run in threads: they get one source (and
    so share the weights it holds). ``weights=False``: see ``load_model_source``."""
    key = json.dumps(spec.identity(), sort_keys=True)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key], True
        _cache[key] = source = load_model_source(spec, weights, _sibling_tokenizer(spec))
        # The least recently used go first, never one a running job holds weights of.
        idle = [k for k, held in _cache.items() if k != key and held._holders == 0]
        for old in idle[:max(0, len(_cache) - MODEL_CACHE_SIZE)]:
            del _cache[old]
        return source, False


def _sibling_tokenizer(spec: ModelSpec) -> Any:
    """The tokenizer of a cached source of the same checkpoint in another dtype (a 16-bit
    model's float32 reference, say), else None: one copy, which a large vocabulary's makes
    worth keeping (48 MiB at 151,936 tokens, ``plan.phase_memory.tokenizer_bytes``)."""
    checkpoint = (spec.location, spec.revision, spec.trust_remote_code)
    for held in _cache.values():
        if (held.spec.location, held.spec.revision, held.spec.trust_remote_code) == checkpoint:
            return held.tokenizer
    return None
