"""Generation speed of a GGUF in llama.cpp: the sweep's speed block at batch size 1 (llama-cpp-
python decodes one sequence), greedy, exactly ``new_tokens`` tokens (end-of-text suppressed),
the same prompts as every job's (``measure.speed.prompt_ids``); time to first token is the
prompt's decode, each decode step one new token's. Rows as every job's speed frame holds them."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from quantdask.gguf.runtime import RuntimeDevice
from quantdask.records import SpeedRow

if TYPE_CHECKING:
    import torch

    from quantdask.sweepfile.speed import SpeedSettings


def llama_cpp_speed(path: str | os.PathLike, windows: torch.Tensor, settings: SpeedSettings,
                    device: RuntimeDevice, device_label: str, whole_device: bool,
                    others_busy: Callable[[], bool] | None,
                    bos_token_id: int | None) -> list[SpeedRow]:
    """One speed row at batch size 1 (other batch sizes are the caller's to report)."""
    import numpy as np

    from quantdask.measure.speed import prompt_ids

    prompt = prompt_ids(windows, 1, settings.prompt_length, bos_token_id)[0].tolist()
    length = settings.prompt_length + settings.new_tokens
    llm = device.open(path, n_ctx=length, n_batch=settings.prompt_length,
                      n_ubatch=settings.prompt_length)
    eos, vocab = llm.token_eos(), llm.n_vocab()

    def run() -> tuple[float, list[float]]:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        marks = [time.perf_counter()]
        for _ in range(settings.new_tokens - 1):
            # the last token's logits, straight from llama.cpp (the bindings copy them into
            # ``scores`` only with logits_all, which would time the head on every position)
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).copy()
            logits[eos] = -np.inf  # exactly new_tokens tokens, as every job's speed
            llm.eval([int(logits.argmax())])
            marks.append(time.perf_counter())
        return marks[0] - start, [b - a for a, b in zip(marks, marks[1:])]

    try:
        for _ in range(settings.warmup):
            run()
        busy_before = others_busy() if others_busy else None
        first, steps = [], []
        for _ in range(settings.repeats):
            to_first, decode = run()
            first.append(to_first)
            steps += decode
    finally:
        llm.close()
    ttft = statistics.median(first)
    step = statistics.median(steps) if steps else None
    return [SpeedRow(
        batch_size=1, prompt_tokens=settings.prompt_length, new_tokens=settings.new_tokens,
        repeats=settings.repeats, device=device_label, exclusive=whole_device,
        other_slots_busy=None if others_busy is None else busy_before or others_busy(),
        ttft_s=ttft, decode_s_p50=step,
        decode_s_p90=float(np.quantile(steps, 0.9)) if steps else None,
        prefill_tokens_per_s=settings.prompt_length / ttft,
        decode_tokens_per_s=1.0 / step if step else None,
        peak_device_mem_bytes=0)]
