"""The methods side by side at 4 bits, group 128, the same calibration: round-to-nearest,
GPTQ, AWQ, AutoRound and HQQ (and bitsandbytes nf4, blocks of 64, and llama.cpp's GGUF Q4_0,
Q4_K_M and Q4_K_M with an importance matrix, measured in llama.cpp, for reference).

    .venv/bin/python -m benchmarks.methods [--iters 200] [--model DIR]

Round-to-nearest is ``autoround`` with ``iters: 0`` (the same integer format, AutoRound's
data-driven RTN off). Calibration: 32 windows of 128 tokens of text generated like the demo's
(other sentences than the eval's, seed 7); eval: the demo eval text, 32 windows of 128 tokens,
KL over the top 64 (the default). Model: the demo model, or ``--model`` (a checkpoint
directory; llama.cpp's converter refuses the demo's tokenizer, so GGUF rows need one it takes,
e.g. ``tests.gguf_models.llama2_style_model``). Each job runs in this process
(``run_job``, one CPU slot's work). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def sweep_data(calibration: str, iters: int, model: str | None = None) -> dict:
    from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR

    group = 128
    return {"name": "methods", "models": [{"name": "model", "path": model or DEMO_MODEL_DIR}],
            "backends": [
                {"backend": "autoround", "configs": [
                    {"bits": 4, "group_size": group, "iters": 0},
                    {"bits": 4, "group_size": group, "iters": iters}]},
                {"backend": "gptq", "configs": [{"bits": 4, "group_size": group}]},
                {"backend": "awq", "configs": [{"bits": 4, "group_size": group}]},
                {"backend": "hqq", "configs": [{"bits": 4, "group_size": group}]},
                {"backend": "bitsandbytes", "configs": [{"bits": 4}]},
                {"backend": "gguf", "configs": [{"type": "Q4_0"}, {"type": "Q4_K_M"},
                                                {"type": "Q4_K_M", "imatrix": True}]}],
            "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 128, "samples": 32, "batch_size": 8},
            "calibration": {"text": calibration, "samples": 32, "seq_len": 128}}


def cast_kl(model_dir: str, windows, dtype: str) -> tuple[float, float]:
    """KL(float32 || the model cast to ``dtype``) per predicted token on ``windows``, exact over
    the whole vocabulary, with its standard error."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        p = torch.log_softmax(model(input_ids=windows).logits[:, :-1].double(), -1)
        model = model.to(getattr(torch, dtype))
        q = torch.log_softmax(model(input_ids=windows).logits[:, :-1].double(), -1)
    per_token = (p.exp() * (p - q)).sum(-1).flatten()
    return per_token.mean().item(), (per_token.std() / per_token.numel() ** 0.5).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--model", help="a checkpoint directory (default: the demo model)")
    args = parser.parse_args(argv)

    from quantdask.backends import get_backend
    from quantdask.demo_model import generate_text
    from quantdask.job.job import run_job
    from quantdask.measure.reference import compute_reference
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    work = Path(tempfile.mkdtemp(prefix="methods-"))
    calibration = work / "calibration.txt"
    calibration.write_text(generate_text(2000, seed=7))
    jobs = expand_grid(sweep_from_dict(sweep_data(str(calibration), args.iters, args.model)))
    reference = compute_reference(jobs[0].model, jobs[0].eval, jobs[0].eval.read_text(),
                                  calibration=jobs[0].calibration)
    print(f"unquantized perplexity {reference.baseline.perplexity:.4f}")
    for dtype in ("bfloat16", "float16"):  # what running in half precision alone costs
        kl, se = cast_kl(jobs[0].model.location, reference.windows, dtype)
        print(f"the model cast to {dtype}, unquantized: KL {kl:.5f} ± {se:.5f}")
    print()
    print("| method | config | KL ± SE | perplexity | bits per quantized weight | "
          "quantize_s (calibrate_s) |")
    print("|---|---|---:|---:|---:|---:|")
    for job in jobs:
        if job.is_baseline:
            continue
        r = run_job(job, get_backend(job.backend), reference=reference).record
        if r["status"] != "done":
            print(f"| {job.backend} | {job.config_label} | {r['status']}: "
                  f"{r['error_message']} | | | |")
            continue
        calibrate = r.get("calibrate_s")
        print(f"| {job.backend} | {job.config_label} | {r['kl_divergence']:.5f} ± "
              f"{r['kl_se']:.5f} | {r['perplexity']:.4f} | "
              f"{r['bits_per_quantized_weight']:.3f} | {r['quantize_s']:.1f}"
              + (f" ({calibrate:.1f})" if calibrate is not None else "") + " |", flush=True)


if __name__ == "__main__":
    main()
