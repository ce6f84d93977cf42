"""How close quantdask's KL comes to the exact KL, by k (eval.kl_top_k), tail samples
(eval.kl_tail_samples; 0: the one-bucket lower bound), model and config.

    .venv/bin/python -m benchmarks.kl_top_k [--ks 8,64] [--tails 0,16,64] [--work DIR]

For each model, the unquantized model's full next-token distribution and each quantized
model's are computed once (quantdask's own sliced path, in this process); the exact KL over the
whole vocabulary and the KL that quantdask's compact reference gives (the top k exact, the
tail estimated from its samples, or as one bucket) are then computed from the same log-probs.
Models:

- ``demo``: the built-in demo model (a 320-token vocabulary, trained);
- ``wide-32k``: a small Llama trained here on the demo text with a 32,768-token output layer
  (the tokenizer's 320 tokens occur; the rest are a real model's rare tokens);
- ``qwen2-151k-random``: Qwen2's 151,936-token vocabulary on an untrained tiny body, the worst
  case (near-uniform distributions: the top k hold little of the mass);
- ``llama-32k-random``: a randomly initialised Llama with a 32,000-token vocabulary (flat);
- ``realistic``: tests/data/realistic-model, a small Llama trained on text with a natural
  word-frequency spread (perplexity above 20, long tails: the regime of real language models).

Prints a Markdown table of the relative error (quantdask - exact) / exact, in percent, with
quantdask's own standard error beside it (also relative to the exact KL).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from quantdask.demo_model import DEMO_EVAL_TEXT

CONFIGS = [("nf4", {"bits": 4, "quant_type": "nf4"}),
           ("fp4", {"bits": 4, "quant_type": "fp4"}),
           ("int8", {"bits": 8})]


def models(work: Path, chosen: list[str]) -> dict[str, str]:
    """The models named in ``chosen``, built under ``work`` the first time."""
    import sys

    from quantdask.demo_model import DEMO_MODEL_DIR, train_small_llama

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.tiny_families import build_tiny

    builders = {
        "wide-32k": lambda out: train_small_llama(str(out), steps=400, vocab_size=32_768,
                                                  hidden_size=128, layers=2),
        "qwen2-151k-random": lambda out: build_tiny("qwen2_151k", out),
        "llama-32k-random": lambda out: _random_llama(out, vocab_size=32_000),
    }
    paths = {"demo": DEMO_MODEL_DIR,
             "realistic": str(Path(__file__).resolve().parent.parent / "tests" / "data"
                              / "realistic-model")}
    for name in chosen:
        if name in builders:
            out = work / name
            if not (out / "config.json").exists():
                builders[name](out)
            paths[name] = str(out)
    return {name: paths[name] for name in chosen}


def _random_llama(out: Path, vocab_size: int) -> None:
    """An untrained Llama with the demo model's tokenizer and a wider output layer."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantdask.demo_model import DEMO_MODEL_DIR

    config = AutoConfig.from_pretrained(DEMO_MODEL_DIR)
    config.vocab_size = vocab_size
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEMO_MODEL_DIR) / name, out / name)


def full_log_probs(model, windows):
    import torch

    from quantdask.measure.logits import sliced_log_probs

    out = torch.empty(windows.size(0), windows.size(1) - 1, model.config.vocab_size)
    for piece in sliced_log_probs(model, windows, 8, "cpu"):
        out[piece.rows, piece.positions] = piece.log_probs
    return out


def exact_kl(log_p, log_q) -> float:
    """The exact KL over the whole vocabulary in float64, each distribution renormalized in
    float64 first: float32 log-softmax leaves a normalization error of about 1e-7, as large as
    the whole KL of an 8-bit config on a flat model."""
    import torch

    p = log_p.double() - torch.logsumexp(log_p.double(), dim=-1, keepdim=True)
    q = log_q.double() - torch.logsumexp(log_q.double(), dim=-1, keepdim=True)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def kl(reference, log_q, windows) -> tuple[float, float]:
    """quantdask's KL of ``log_q`` against ``reference`` on ``windows``, and its standard
    error."""
    from quantdask.measure.metrics import QualityMeter

    meter = QualityMeter(windows, reference)
    meter.add(slice(0, windows.size(0)), slice(0, windows.size(1) - 1), log_q)
    scores = meter.scores()
    return scores.kl_divergence, scores.kl_se


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="8,64")
    parser.add_argument("--tails", default="0,16,64")
    parser.add_argument("--models", default="demo,wide-32k,qwen2-151k-random,llama-32k-random,"
                                            "realistic")
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "quantdask-kl"))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    settings = [(int(k), int(m)) for k in args.ks.split(",") for m in args.tails.split(",")]
    import torch

    torch.manual_seed(0)
    print("| model | vocab | top-64 mass | config | exact KL | "
          + " | ".join(f"k={k} m={m}" for k, m in settings) + " |")
    print("|---|---:|---:|---|---:|" + "---:|" * len(settings))
    for name, path in models(Path(args.work), args.models.split(",")).items():
        for row in _rows(name, path, settings, args.seq_len, args.samples):
            print(row, flush=True)


def _rows(name: str, path: str, settings: list[tuple[int, int]], seq_len: int,
          samples: int):
    from quantdask.backends import get_backend
    from quantdask.measure.metrics import eval_windows, reference_slice, tail_offsets
    from quantdask.process.model_source import load_model_source
    from quantdask.sweepfile.model import ModelSpec

    source = load_model_source(ModelSpec(name=name, path=path))
    text_file = Path(path).parent / "realistic-eval.txt" if name == "realistic" else None
    text = (text_file or Path(DEMO_EVAL_TEXT)).read_text(encoding="utf-8")
    windows = eval_windows(source.tokenizer(text)["input_ids"], seq_len, samples)
    log_p = full_log_probs(source.build("cpu"), windows)
    mass = log_p.topk(64, dim=-1).values.exp().sum(-1).mean().item()
    offsets = tail_offsets(range(windows.size(0)), windows.size(1) - 1)
    for label, options in CONFIGS:
        backend = get_backend("bitsandbytes")
        model = backend.quantize(source, backend.normalize(options, "options"), "cpu")
        log_q = full_log_probs(model, windows)
        exact = exact_kl(log_p, log_q)
        cells = []
        for k, m in settings:
            approx, se = kl(reference_slice(log_p, k, m, offsets), log_q, windows)
            cells.append(f"{100 * (approx - exact) / exact:+.2f}% (se {100 * se / exact:.1f}%)")
        yield (f"| {name} | {log_p.size(-1):,} | {mass:.1%} | {label} | {exact:.4g} | "
               + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
