"""quantdask's timed greedy generation against a greedy loop a user writes by hand.

    .venv/bin/python -m benchmarks.speed_vs_hand_loop [--runs 5] [--new-tokens 24]

The same prompt (32 tokens) on the demo model, in this process, one torch thread, the two
interleaved run by run: ``measure.speed.generate_timed`` (transformers' ``generate`` with a
stopping criterion that stamps each step) and a plain loop with the KV cache that masks
end-of-text as ``min_new_tokens`` does (``hand_timed_greedy``). Prints each side's fastest tenth
of its decode steps (a step the OS preempted is only ever slower) and their ratio: what
``generate``'s own bookkeeping adds to a step. A timing ratio is a benchmark, not a test: the
test suite checks the token counts alone (tests/test_speed.py).
"""

from __future__ import annotations

import argparse
import statistics
import time


def hand_timed_greedy(model, prompt, new_tokens: int, eos: int) -> tuple[int, list[float]]:
    """A plain greedy loop with the KV cache, end-of-text masked as ``min_new_tokens`` masks it:
    the tokens it made and each step after the first, timed with ``time.perf_counter``."""
    import torch

    steps: list[float] = []
    made = 0
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        for _ in range(new_tokens):
            logits[:, eos] = -float("inf")
            token = logits.argmax(-1, keepdim=True)
            made += 1
            if made == new_tokens:
                break
            started = time.perf_counter()
            out = model(input_ids=token, cache=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
            steps.append(time.perf_counter() - started)
    return made, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from quantdask.demo_model import DEMO_MODEL_DIR
    from quantdask.measure.speed import generate_timed, prompt_ids

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    prompt = prompt_ids(torch.arange(4, 300).reshape(2, -1), 1, 32)
    eos = model.generation_config.eos_token_id
    ours: list[float] = []
    hand: list[float] = []
    for _ in range(args.runs):
        _, _, steps = generate_timed(model, prompt, args.new_tokens, cuda=False, pad_token_id=3)
        ours += steps
        hand += hand_timed_greedy(model, prompt, args.new_tokens, eos)[1]
    fast = [statistics.quantiles(steps, n=10)[0] for steps in (ours, hand)]
    print(f"decode step, fastest tenth: generate_timed {1e3 * fast[0]:.3f} ms, hand loop "
          f"{1e3 * fast[1]:.3f} ms, ratio {fast[0] / fast[1]:.2f} "
          f"({len(ours)} and {len(hand)} steps)")


if __name__ == "__main__":
    main()
