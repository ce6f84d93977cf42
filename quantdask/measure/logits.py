"""Next-token log-probabilities over eval windows, a slice of positions at a time.

A causal LM's logits are batch x seq_len x vocab: at 2,048 tokens and a 128k vocabulary that is
about 1 GB per window in float32, and log-softmax doubles it. Here the model's body runs once per
batch of windows; its output head and the log-softmax then run over slices of positions, so at
most ``batch x slice x vocab`` floats exist at a time, and the caller folds each slice into its
metrics before the next. The same path serves the reference, the baseline and every job.

The head runs through the model's own ``forward`` (``logits_to_keep`` = the slice's positions)
with its decoder's output served from the one run of the body: whatever the architecture does
after the head (Gemma's soft-capping, Cohere's logit scale, Granite's scaling) is applied as in
a plain forward. A model where that gives other logits than a plain forward on a short probe
(or that has no ``logits_to_keep``) is evaluated with whole-batch logits instead, and says so.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger("quantdask.logits")
_WORKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(device, dtype): ok}

SLICE_BUDGET_BYTES = 256 * 2**20
"""Float32 logits held at once per slice (x 3 with log-softmax and a temporary)."""
PROBE_TOKENS = 16
"""Positions of the first window on which the sliced head is checked against a plain forward."""


@dataclass(frozen=True)
class LogProbSlice:
    """Log-probs (float32, on the model's device) for ``rows`` of the windows at ``positions``:
    ``log_probs[i, j]`` predicts token ``positions[j] + 1`` of window ``rows.start + i``."""

    rows: slice
    positions: slice
    log_probs: torch.Tensor


StreamedLogProbs = Callable[..., Iterator[LogProbSlice]]
"""``streamed(source, windows, batch_size, device)``: the unquantized model's log-probs with
its decoder layers read and run one at a time (never resident), as ``sliced_log_probs``
yields them."""

_STREAMED: list[StreamedLogProbs] = []  # registered by quantdask.stream


def register_streamed_log_probs(streamed: StreamedLogProbs) -> None:
    """How a model too large to hold gives its log-probs: the stream capability registers
    its own here as it is imported (the core never imports it)."""
    _STREAMED[:] = [streamed]


def streamed_log_probs(source, windows: torch.Tensor, batch_size: int,
                       device: str) -> Iterator[LogProbSlice]:
    """The registered streamed forward's log-probs (``register_streamed_log_probs``)."""
    if not _STREAMED:
        raise RuntimeError("a streamed reference, and no streamed forward registered: "
                           "import quantdask.stream first (import quantdask does)")
    return _STREAMED[0](source, windows, batch_size, device)


def positions_per_slice(batch: int, vocab: int, budget_bytes: int = SLICE_BUDGET_BYTES) -> int:
    """How many positions of ``batch`` windows fit ``budget_bytes`` of float32 logits."""
    return max(1, budget_bytes // max(1, batch * vocab * 4))


def sliced_log_probs(model: torch.nn.Module, windows: torch.Tensor, batch_size: int,
                     device: str, budget_bytes: int = SLICE_BUDGET_BYTES,
                     on_batch: Callable[[slice], None] | None = None
                     ) -> Iterator[LogProbSlice]:
    """Yield the float32 log-probs of the next token at every position but the last of each
    window, as :class:`LogProbSlice` pieces, batch by batch and slice by slice.
    ``on_batch(rows)`` is called before each batch's forward pass (and not before the probe
    that checks the sliced head): forward hooks then know which windows they see."""
    import torch

    from quantdask.process.cpu_share import rebalance

    sliced = _SlicedHead(model) if _sliced_works(model, windows, device) else None
    predicted = windows.size(1) - 1
    with torch.inference_mode():
        for start in range(0, windows.size(0), batch_size):
            rebalance()  # a CPU slot takes the cores idle slots leave, or gives them back
            batch = windows[start:start + batch_size].to(device)
            rows = slice(start, start + batch.size(0))
            step = positions_per_slice(batch.size(0), _vocab_size(model), budget_bytes)
            if on_batch is not None:
                on_batch(rows)
            if sliced is None:  # whole-batch logits, then a sliced log-softmax
                logits = model(input_ids=batch).logits[:, :-1]
                for p in range(0, predicted, step):
                    yield LogProbSlice(rows, slice(p, min(p + step, predicted)),
                                       torch.log_softmax(logits[:, p:p + step].float(), dim=-1))
                del logits
                continue
            with sliced.body(batch):
                for p in range(0, predicted, step):
                    end = min(p + step, predicted)
                    yield LogProbSlice(rows, slice(p, end), torch.log_softmax(
                        sliced.logits(batch, p, end).float(), dim=-1))


def _sliced_works(model: torch.nn.Module, windows: torch.Tensor, device: str) -> bool:
    """``_SlicedHead.works_on``, checked once per model object and device: its answer is the
    architecture's, and the check runs the model twice, which a search's whole-format measure
    (every layer's weights swapped in as it is reached) would pay for in quantizing."""
    import torch

    key = (device, _dtype(model))
    found = _WORKS.setdefault(model, {})
    if key not in found:
        found[key] = _SlicedHead.works_on(model, windows, device)
    del torch
    return found[key]


class _SlicedHead:
    """A model's head over chosen positions, its body run once per batch (see the module)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.decoder = cast("PreTrainedModel", model).get_decoder()
        self._cached = None

    @classmethod
    def works_on(cls, model: torch.nn.Module, windows: torch.Tensor, device: str) -> bool:
        """Whether the sliced head gives a plain forward's logits on a short probe."""
        import torch

        name = type(model).__name__
        try:
            head = cls(model)
            if head.decoder is model:
                raise TypeError("it has no separate decoder (get_decoder() is the model)")
            probe = windows[:1, :PROBE_TOKENS].to(device)
            with torch.inference_mode():
                plain = model(input_ids=probe).logits.float()
                with head.body(probe):
                    ends = probe.size(1)
                    sliced = torch.cat([head.logits(probe, 0, ends // 2),
                                        head.logits(probe, ends // 2, ends)], dim=1).float()
        except Exception as error:  # noqa: BLE001 - any architecture: fall back, say why
            log.warning("%s: whole-batch logits (the sliced head failed: %s: %s)", name,
                        type(error).__name__, error)
            return False
        scale = 1.0 + plain.abs().max().item()
        difference = ((sliced - plain).abs().max().item() if sliced.shape == plain.shape
                      else float("inf"))
        # Float32 agrees to rounding; half precision to its own (the matmuls are blocked
        # differently over a slice than over the whole).
        tolerance = (1e-4 if _dtype(model) == torch.float32 else 2e-2) * scale
        if difference > tolerance:
            log.warning("%s: whole-batch logits (the sliced head differs from a plain forward "
                        "by %.3g on the probe)", name, difference)
            return False
        return True

    def body(self, batch: torch.Tensor):
        """Context: run the decoder on ``batch`` once; the model's forward inside reuses it."""
        return _CachedBody(self, batch)

    def logits(self, batch: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The model's logits for positions ``start:end`` of ``batch`` (body cached)."""
        import torch

        keep = torch.arange(start, end, device=batch.device)
        return self.model(input_ids=batch, logits_to_keep=keep, use_cache=False).logits


class _CachedBody:
    def __init__(self, head: _SlicedHead, batch: torch.Tensor):
        self.head, self.batch = head, batch

    def __enter__(self):
        decoder = self.head.decoder
        output = decoder(input_ids=self.batch, use_cache=False)

        def cached_forward(*args, **kwargs):
            return output

        # An instance attribute wins over the class's forward: nn.Module.__call__ (and its
        # hooks) then return the body's output without running it again. (accelerate's hooks
        # set one too: it is put back after.)
        self.previous = decoder.__dict__.get("forward")
        decoder.forward = cached_forward
        return self

    def __exit__(self, *exc):
        if self.previous is None:
            del self.head.decoder.forward
        else:
            self.head.decoder.forward = self.previous


def _dtype(model: torch.nn.Module):
    import torch

    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def _vocab_size(model: torch.nn.Module) -> int:
    hf_model = cast("PreTrainedModel", model)
    head = hf_model.get_output_embeddings()
    return getattr(head, "out_features", None) or hf_model.config.get_text_config().vocab_size
