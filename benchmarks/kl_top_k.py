"""How close the top-k KL (eval.kl_top_k) comes to the exact KL, by k, model and config.

    .venv/bin/python -m benchmarks.kl_top_k [--ks 8,16,32,64,128] [--work DIR]

For each model, the unquantized model's full next-token distribution and each quantized
model's are computed once (quantdask's own sliced path, in this process); the exact KL over the
whole vocabulary and the top-k + rest-bucket KL that quantdask's compact reference gives are
then computed from the same log-probs. Models:

- ``demo``: the built-in demo model (a 320-token vocabulary, trained);
- ``wide-32k``: a small Llama trained here on the demo text with a 32,768-token output layer
  (the tokenizer's 320 tokens occur; the rest are a real model's rare tokens);
- ``qwen2-151k-random``: Qwen2's 151,936-token vocabulary on an untrained tiny body, the worst
  case (near-uniform distributions: the top k hold little of the mass).

Prints a Markdown table of the relative error (exact - top-k) / exact, in percent.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

CONFIGS = [("nf4", {"bits": 4, "quant_type": "nf4"}),
           ("fp4", {"bits": 4, "quant_type": "fp4"}),
           ("int8", {"bits": 8})]


def models(work: Path) -> dict[str, str]:
    import sys

    from quantdask.demo_model import DEMO_MODEL_DIR, train_small_llama

    wide = work / "wide-32k"
    if not (wide / "config.json").exists():
        train_small_llama(str(wide), steps=400, vocab_size=32_768, hidden_size=128, layers=2)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.tiny_families import build_tiny

    qwen = work / "qwen2-151k-random"
    if not (qwen / "config.json").exists():
        build_tiny("qwen2_151k", qwen)
    return {"demo": DEMO_MODEL_DIR, "wide-32k": str(wide), "qwen2-151k-random": str(qwen)}


def full_log_probs(model, windows):
    import torch

    from quantdask.worker.logits import sliced_log_probs

    out = torch.empty(windows.size(0), windows.size(1) - 1, model.config.vocab_size)
    for piece in sliced_log_probs(model, windows, 8, "cpu"):
        out[piece.rows, piece.positions] = piece.log_probs
    return out


def kl(reference, log_q, windows) -> float:
    from quantdask.worker.metrics import QualityMeter

    meter = QualityMeter(windows, reference)
    meter.add(slice(0, windows.size(0)), slice(0, windows.size(1) - 1), log_q)
    return meter.scores()["kl_divergence"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="8,16,32,64,128,256")
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "quantdask-kl"))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    import torch

    from quantdask.backends import get_backend
    from quantdask.demo_model import DEMO_EVAL_TEXT
    from quantdask.spec.model import ModelSpec
    from quantdask.worker.metrics import eval_windows, reference_slice
    from quantdask.worker.model_source import load_model_source

    torch.manual_seed(0)
    text = Path(DEMO_EVAL_TEXT).read_text(encoding="utf-8")
    print("| model | vocab | config | exact KL | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|---:|---|---:|" + "---:|" * len(ks))
    for name, path in models(Path(args.work)).items():
        source = load_model_source(ModelSpec(name=name, path=path))
        windows = eval_windows(source.tokenizer(text)["input_ids"], args.seq_len, args.samples)
        log_p = full_log_probs(source.build("cpu"), windows)
        for label, options in CONFIGS:
            backend = get_backend("bitsandbytes")
            model = backend.quantize(source, backend.normalize(options, "options"), "cpu")
            log_q = full_log_probs(model, windows)
            exact = kl({"log_probs": log_p}, log_q, windows)
            errors = []
            for k in ks:
                approx = kl(reference_slice(log_p, k), log_q, windows)
                errors.append(f"{100 * (exact - approx) / exact:.2f}%")
            print(f"| {name} | {log_p.size(-1):,} | {label} | {exact:.4g} | "
                  + " | ".join(errors) + " |", flush=True)


if __name__ == "__main__":
    main()
