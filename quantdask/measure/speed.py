"""Generation speed: greedy ``generate`` on the model in memory, timed token by token.

For each batch size of the sweep's :class:`~quantdask.sweepfile.speed.SpeedSettings`, prompts of
``prompt_length`` tokens of the eval text (the model's reference windows, so every config of a
model gets the same ones) go through ``model.generate`` with a fixed budget: greedy, exactly
``new_tokens`` new tokens (end-of-text suppressed until then, so no config stops early).
``TokenClock``, a stopping criterion that never stops, marks the moment each token is out: the
first mark is the time to first token (the prefill, from the call), the gaps between marks are
the decode steps. On CUDA the marks are events on the device's stream, read after one
synchronize; on a CPU slot, ``time.perf_counter``: the same code either way. Warm-up runs are
not counted.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from quantdask.measure.usage import PeakMemory
from quantdask.records import SpeedRow

if TYPE_CHECKING:
    import torch

    from quantdask.sweepfile.speed import SpeedSettings


def _token_clock(cuda: bool):
    """A ``StoppingCriteria`` that marks when each new token is out and never stops."""
    import torch
    from transformers import StoppingCriteria

    class TokenClock(StoppingCriteria):
        def __init__(self):
            self.marks: list[Any] = []

        def mark(self) -> None:
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.marks.append(event)
            else:
                self.marks.append(time.perf_counter())

        def __call__(self, input_ids, scores, **kwargs):
            self.mark()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        def seconds(self) -> list[float]:
            """Each mark's time after the first (the call's start), in seconds."""
            if cuda:
                torch.cuda.synchronize()
                return [self.marks[0].elapsed_time(m) / 1000 for m in self.marks[1:]]
            return [m - self.marks[0] for m in self.marks[1:]]

    return TokenClock


def prompt_ids(windows: torch.Tensor, batch_size: int, length: int,
               bos_token_id: int | None = None) -> torch.Tensor:
    """``batch_size`` prompts of ``length`` tokens, consecutive stretches of the eval text
    (read again from the start when it holds fewer tokens). Where the eval's windows each
    start with ``bos_token_id``, so does each prompt, then ``length`` - 1 tokens of the text
    (the windows' BOS columns left out: the text, not the flattened windows)."""
    import torch

    from quantdask.measure.metrics import with_bos

    body = length - (bos_token_id is not None)
    tokens = (windows if bos_token_id is None else windows[:, 1:]).reshape(-1)
    need = batch_size * body
    if tokens.numel() < need:
        tokens = tokens.repeat(-(-need // tokens.numel()))
    return with_bos(tokens[:need].reshape(batch_size, body).to(torch.long), bos_token_id)


def generate_timed(model, prompts: torch.Tensor, new_tokens: int, cuda: bool,
                   pad_token_id: int | None) -> tuple[int, float, list[float]]:
    """One greedy ``generate`` of exactly ``new_tokens`` tokens after ``prompts``: the tokens
    it generated per row, the time to the first one, and each decode step's time."""
    import torch
    from transformers import GenerationConfig, StoppingCriteriaList

    eos = getattr(model.generation_config, "eos_token_id", None)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, eos_token_id=eos,
                              pad_token_id=pad_token_id if pad_token_id is not None else eos)
    clock = _token_clock(cuda)()
    prompts = prompts.to(model.device)
    with torch.inference_mode():
        clock.mark()  # the call's start
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                             generation_config=config,
                             stopping_criteria=StoppingCriteriaList([clock]))
    marks = clock.seconds()
    steps = [b - a for a, b in zip(marks, marks[1:])]
    return out.shape[1] - prompts.shape[1], marks[0], steps


def measure_speed(model, windows: torch.Tensor, settings: SpeedSettings, cuda: bool,
                  pad_token_id: int | None, device_label: str, whole_device: bool,
                  others_busy: Callable[[], bool] | None = None,
                  bos_token_id: int | None = None) -> list[SpeedRow]:
    """The speed frame's rows of ``model``: one per batch size (see the module). A row is
    ``exclusive`` when the job holds its ``whole_device`` and no other job was measured on
    this worker meanwhile; on a CPU slot, ``others_busy()`` (sampled before and after the timed
    runs) says whether another slot's job computed on the machine's cores."""
    rows = []
    for batch in settings.batch_sizes:
        prompts = prompt_ids(windows, batch, settings.prompt_length, bos_token_id)
        for _ in range(settings.warmup):
            generate_timed(model, prompts, settings.new_tokens, cuda, pad_token_id)
        first, steps = [], []
        busy_before = others_busy() if others_busy else None
        with PeakMemory(cuda) as peak:
            for _ in range(settings.repeats):
                made, to_first, decode = generate_timed(model, prompts, settings.new_tokens,
                                                        cuda, pad_token_id)
                if made != settings.new_tokens:
                    raise RuntimeError(f"generate made {made} tokens, not the "
                                       f"{settings.new_tokens} asked for")
                first.append(to_first)
                steps += decode
        ttft, step = statistics.median(first), _quantile(steps, 0.5)
        rows.append(SpeedRow(
            batch_size=batch, prompt_tokens=settings.prompt_length,
            new_tokens=settings.new_tokens, repeats=settings.repeats,
            device=device_label, exclusive=whole_device and not peak.shared,
            other_slots_busy=None if others_busy is None else busy_before or others_busy(),
            ttft_s=ttft, decode_s_p50=step, decode_s_p90=_quantile(steps, 0.9),
            prefill_tokens_per_s=batch * settings.prompt_length / ttft,
            # The median step: a stray slow step (a page fault, another process) does not
            # move it, as it would a mean.
            decode_tokens_per_s=batch / step if step else None,
            peak_device_mem_bytes=peak.peak_device_bytes,
        ))
    return rows


def _quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (linear between order statistics), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
