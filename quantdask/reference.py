"""Work every job of a model shares, done once per model: the eval windows and the unquantized
model's next-token log-probabilities, which KL divergence and top-1 agreement compare against.

The scheduler submits :func:`compute_reference` once per model and passes its future to each of
that model's jobs, so Dask moves the result to each worker once and nothing is recomputed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dask.sizeof import sizeof

from quantdask.metrics import eval_windows, forward_log_probs
from quantdask.model_source import cached_model_source

if TYPE_CHECKING:
    import torch

    from quantdask.spec import EvalSettings, ModelSpec

REFERENCE_TOPIC = "quantdask-reference"
"""Dask event topic: one event each time a worker computes a reference (to count them)."""


@dataclass
class Reference:
    """Eval windows (samples x seq_len token ids) and the baseline's log-probs for each position
    but the last (samples x seq_len-1 x vocab, float32, on the CPU)."""

    key: str
    windows: torch.Tensor
    log_probs: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.windows, self.log_probs))


@sizeof.register(Reference)
def _reference_size(reference: Reference) -> int:
    # Dask weighs data to decide what to keep and spill; a reference can be gigabytes.
    return reference.nbytes


def reference_key(model: ModelSpec, settings: EvalSettings) -> str:
    """A Dask key naming the reference of ``model`` on ``settings``' windows."""
    identity = json.dumps({"model": model.identity(), "eval": settings.identity()},
                          sort_keys=True)
    return f"reference-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def compute_reference(model: ModelSpec, settings: EvalSettings, text: str) -> Reference:
    """Tokenize ``text`` into eval windows and run the unquantized model over them."""
    from quantdask.devices import this_workers_sampler
    from quantdask.worker import announce_start, quiet_libraries

    announce_start()  # its deadline starts now
    quiet_libraries()
    sampler = this_workers_sampler()
    if sampler is not None:  # the device's samples meanwhile belong to the reference
        sampler.current_job = reference_key(model, settings)
        sampler.sample_now()
    try:
        return _compute_reference(model, settings, text)
    finally:
        if sampler is not None:
            sampler.sample_now()
            sampler.current_job = None


def _compute_reference(model: ModelSpec, settings: EvalSettings, text: str) -> Reference:
    import torch

    from quantdask.worker import torch_device

    source, _ = cached_model_source(model)
    windows = eval_windows(source.tokenizer(text)["input_ids"], settings.seq_len,
                           settings.samples)
    device, _, _ = torch_device()
    fp_model = source.build(device)
    log_probs = torch.cat(list(forward_log_probs(fp_model, windows, settings.batch_size, device)))
    del fp_model
    _announce(reference_key(model, settings))
    return Reference(key=reference_key(model, settings), windows=windows, log_probs=log_probs)


def _announce(key: str) -> None:
    try:
        from distributed import get_worker

        get_worker().log_event(REFERENCE_TOPIC, {"key": key})
    except ValueError:  # computed outside a Dask worker
        pass
