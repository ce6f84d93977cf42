"""A trained model of our own whose every width is a multiple of 256 (hidden 256, FFN 768, 4
layers; a Llama-2-style tokenizer llama.cpp's converter takes), so that each K-quant is written
as itself, with no legacy fallback: the model section 24.1 searches beside SmolLM2, whose
576-wide rows take the fallbacks.

    .venv/bin/python -m benchmarks.wide_model OUT [--steps 600]

Writes OUT/model (trained on the demo's generated language, seed 0), OUT/eval.txt and
OUT/calibration.txt (other seeds of the same language: text it was not trained on).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()

    import torch

    from quantdask.demo_model import generate_text, train_and_save_llama
    from tests.gguf_models import llama2_tokenizer

    out = Path(args.out)
    torch.manual_seed(0)
    train_text = generate_text(40_000, seed=0)
    tokenizer = llama2_tokenizer(out / "model", vocab=512)
    train_and_save_llama(tokenizer, train_text, out / "model", steps=args.steps, seq_len=64,
                         seed=0, hidden_size=256, intermediate_size=768, num_hidden_layers=4)
    (out / "eval.txt").write_text(generate_text(3000, seed=101))
    (out / "calibration.txt").write_text(generate_text(3000, seed=202))
    print(f"model in {out / 'model'}; eval.txt, calibration.txt beside it")


if __name__ == "__main__":
    main()
