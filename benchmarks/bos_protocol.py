"""quantdask's perplexity and KL under each ``eval.bos`` rule, against a plain transformers loop.

    .venv/bin/python -m benchmarks.bos_protocol --model PATH [--text FILE] [--seq-len 256]
        [--samples 16] [--quant-type nf4]

For a model on disk (a real checkpoint whose tokenizer adds a BOS, such as a Gemma or Llama
one, or the demo model with a BOS-adding tokenizer built here when ``--model`` is omitted):
quantdask's reference and one bitsandbytes 4-bit job under ``auto`` and ``never``, and beside
them the same figures from a loop of our own (transformers only: the text encoded without
special tokens, windows of ``seq_len - 1`` tokens each behind the BOS, or the plain encode cut
into windows of ``seq_len``; the 4-bit model through transformers' ``BitsAndBytesConfig``;
float64 sums). Prints each figure with its relative difference: the check that quantdask's
windows are the field's protocol on a model you bring. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path


def independent(model_dir: str, text: str, seq_len: int, samples: int, bos: bool,
                quant_type: str) -> dict[str, float]:
    """Baseline perplexity, the 4-bit model's perplexity and KL(fp || 4-bit), from plain
    transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if bos:
        ids, body = tokenizer(text, add_special_tokens=False)["input_ids"], seq_len - 1
        rows = [[tokenizer.bos_token_id] + ids[i * body:(i + 1) * body] for i in range(samples)]
    else:
        ids = tokenizer(text)["input_ids"]
        rows = [ids[i * seq_len:(i + 1) * seq_len] for i in range(samples)]
    windows = torch.tensor(rows)
    fp = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    quantized = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, device_map="cpu",
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=False,
            bnb_4bit_compute_dtype=torch.float32)).eval()
    with torch.inference_mode():
        log_p = torch.log_softmax(fp(input_ids=windows).logits[:, :-1].double(), dim=-1)
        log_q = torch.log_softmax(quantized(input_ids=windows).logits[:, :-1].double(), dim=-1)
    targets = windows[:, 1:].unsqueeze(-1)
    return {"baseline perplexity": math.exp(-log_p.gather(-1, targets).mean().item()),
            "4-bit perplexity": math.exp(-log_q.gather(-1, targets).mean().item()),
            "4-bit KL": (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()}


def measured(model_dir: str, text_path: str, seq_len: int, samples: int, rule: str,
             quant_type: str) -> tuple[dict[str, float], int | None]:
    """The same figures from quantdask (its reference and one job, in this process), and the
    BOS token its windows start with."""
    from quantdask.backends import get_backend
    from quantdask.job.job import run_job
    from quantdask.measure.reference import compute_reference
    from quantdask.sweepfile.model import ModelSpec
    from quantdask.sweepfile.settings import EvalSettings
    from quantdask.sweepfile.sweep import BackendBlock, Sweep, expand_grid

    sweep = Sweep(name="bos", models=[ModelSpec(path=model_dir)],
                  backends=[BackendBlock("bitsandbytes", configs=[
                      {"bits": 4, "quant_type": quant_type}])],
                  eval=EvalSettings(text=text_path, seq_len=seq_len, samples=samples,
                                    kl_top_k="all", bos=rule))
    baseline, job = expand_grid(sweep)
    reference = compute_reference(baseline.model, baseline.eval, baseline.eval.read_text())
    record = run_job(job, get_backend(job.backend), reference=reference).record
    assert reference.baseline is not None
    return ({"baseline perplexity": reference.baseline.perplexity,
             "4-bit perplexity": record["perplexity"], "4-bit KL": record["kl_divergence"]},
            baseline.eval.bos_token_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model directory (default: the demo model "
                                        "with a Llama-3-style BOS-adding tokenizer)")
    parser.add_argument("--text", help="a UTF-8 text file (default: the demo eval text)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--quant-type", default="nf4", choices=("nf4", "fp4"))
    args = parser.parse_args()

    from quantdask.demo_model import DEMO_EVAL_TEXT

    text_path = args.text or DEMO_EVAL_TEXT
    text = Path(text_path).read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model
        if model_dir is None:
            from tests.tiny_families import demo_model_with_bos

            model_dir = demo_model_with_bos(Path(scratch) / "demo-with-bos")
        for rule in ("auto", "never"):
            ours, token = measured(model_dir, text_path, args.seq_len, args.samples, rule,
                                   args.quant_type)
            plain = independent(model_dir, text, args.seq_len, args.samples, token is not None,
                                args.quant_type)
            print(f"eval.bos: {rule} (a BOS per window: "
                  f"{'token ' + str(token) if token is not None else 'no'})")
            for name, value in ours.items():
                print(f"  {name:20s} quantdask {value:.6g}  plain loop {plain[name]:.6g}  "
                      f"relative difference {value / plain[name] - 1:+.2e}")


if __name__ == "__main__":
    main()
