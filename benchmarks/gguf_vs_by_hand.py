"""Six GGUF types swept by quantdask against the same done by hand with llama.cpp's own tools,
and quantdask's figures on the positions ``llama-perplexity --kl-divergence`` scores beside the
tool's own.

    .venv/bin/python -m benchmarks.gguf_vs_by_hand [--tools DIR] [--hidden 1024] [--ffn 2816]
        [--layers 4] [--ctx 512] [--chunks 16]

The model: a Llama-2-style checkpoint built here (``tests.gguf_models``; random weights, widths
multiples of 256), and 40k tokens of the demo's language.

By hand (what a user does without quantdask, one step after another, 2 threads each): the
converter to F32 once, ``llama-perplexity --kl-divergence-base`` on the F32 GGUF once (the base
log-probs), then per type ``llama-quantize`` and ``llama-perplexity --kl-divergence``. It gives
the tool's summary per type (KL against the F32 GGUF in llama.cpp, over the second half of each
chunk), nothing per window, no sizes or tensor types beyond the logs.

quantdask: ``run_sweep`` of the same six types on a LocalCluster of two 1-thread slots (its
start-up timed apart): the torch reference, one conversion, six quantizations and six scorings
in llama.cpp, and the baseline job; per job every position's figures with error bars, the
tensors' types, bits per weight, phases, and the windows frame.

Agreement: the tool's chunks (the text tokenized by llama.cpp with its BOS, cut into ``--ctx``
tokens, each chunk's first token the BOS, as ``tools/perplexity`` does) scored by quantdask's
llama.cpp meter against a float32 torch reference, restricted to the positions the tool scores
(logits at ``ctx/2`` .. ``ctx-2``), beside the tool's Mean KLD, PPL(Q) and Same top p (its base
log-probs are stored as 16-bit integers: a small error of its own).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")


def tool_figures(output: str) -> dict[str, float]:
    """The summary ``llama-perplexity --kl-divergence`` prints: KL, perplexity, top-1."""
    def number(pattern: str) -> float:
        found = re.search(pattern, output)
        if found is None:
            raise RuntimeError(f"no {pattern!r} in llama-perplexity's output:\n{output[-2000:]}")
        return float(found.group(1))

    return {"kl_divergence": number(r"Mean\s+KLD:\s*([-\d.]+)"),
            "perplexity": number(r"Mean PPL\(Q\)\s*:\s*([\d.]+)"),
            "top1_agreement": number(r"Same top p:\s*([\d.]+)") / 100}


def by_hand(tools: Path, folder: Path, text: Path, scratch: Path, ctx: int,
            chunks: int) -> tuple[float, dict[str, dict[str, float]]]:
    """The by-hand pipeline, timed whole; the tool's figures per type."""
    from quantdask.gguf.source import converter_dir

    started = time.perf_counter()
    f32 = scratch / "hand-f32.gguf"
    subprocess.run([sys.executable, str(converter_dir() / "convert_hf_to_gguf.py"), str(folder),
                    "--outtype", "f32", "--outfile", str(f32)], check=True, capture_output=True)
    base = scratch / "base.kld"
    common = ["-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks), "-t", "2"]
    subprocess.run([str(tools / "llama-perplexity"), "-m", str(f32), "-f", str(text), *common,
                    "--kl-divergence-base", str(base)], check=True, capture_output=True)
    figures = {}
    for name in TYPES:
        out = scratch / f"hand-{name}.gguf"
        subprocess.run([str(tools / "llama-quantize"), str(f32), str(out), name, "2"],
                       check=True, capture_output=True)
        run = subprocess.run([str(tools / "llama-perplexity"), "-m", str(out), *common,
                              "--kl-divergence-base", str(base), "--kl-divergence"],
                             check=True, capture_output=True, text=True)
        figures[name] = tool_figures(run.stdout + run.stderr)
    return time.perf_counter() - started, figures


def with_quantdask(folder: Path, text: Path, scratch: Path, ctx: int, chunks: int):
    """The same six types as a quantdask sweep: (start-up s, sweep s, results)."""
    import quantdask as qd
    from quantdask.cluster.local import start_cluster
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    sweep = sweep_from_dict({
        "name": "gguf-by-hand", "models": [{"name": "bench", "path": str(folder)}],
        "backends": [{"backend": "gguf", "grid": {"type": list(TYPES)}}],
        "eval": {"text": str(text), "seq_len": ctx, "samples": chunks, "batch_size": 4,
                 "kl_top_k": "all"}, "seed": 0, "retries": 0})
    began = time.perf_counter()
    with start_cluster(workers=2) as cluster:
        up = time.perf_counter() - began
        began = time.perf_counter()
        results = qd.run_sweep(sweep, scratch / "run", cluster.client)
        return up, time.perf_counter() - began, results


def restricted(folder: Path, text: Path, scratch: Path, ctx: int, chunks: int
               ) -> dict[str, dict[str, float]]:
    """quantdask's meter on the tool's chunks, over the positions the tool scores."""
    import llama_cpp
    import torch
    from transformers import AutoModelForCausalLM

    from quantdask.gguf.convert import convert
    from quantdask.gguf.quantize import quantize_gguf
    from quantdask.gguf.runtime import RuntimeDevice, llama_cpp_meter

    f32 = convert(folder, scratch / "ours-f32.gguf")
    vocab = llama_cpp.Llama(model_path=str(f32), vocab_only=True, verbose=False)
    tokens = vocab.tokenize(text.read_bytes(), add_bos=True, special=False)
    bos = vocab.token_bos()
    windows = torch.tensor(tokens[:ctx * chunks]).reshape(chunks, ctx)
    windows[:, 0] = bos
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs = torch.cat([torch.log_softmax(model(windows[i:i + 4]).logits.float(), -1)
                               for i in range(0, chunks, 4)])[:, :-1]
    reference = {"log_probs": log_probs,
                 "target_log_probs": log_probs.gather(-1, windows[:, 1:, None]).squeeze(-1)}
    first = ctx // 2
    figures = {}
    for name in TYPES:
        path = quantize_gguf(f32, scratch / f"ours-{name}.gguf", name, threads=2)
        meter = llama_cpp_meter(path, windows, reference, RuntimeDevice(2))
        figures[name] = {
            "kl_divergence": float(meter.kl[:, first:].mean()),
            "perplexity": math.exp(float(meter.nll[:, first:].mean())),
            "top1_agreement": float(meter.agree[:, first:].double().mean())}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default="build/llama.cpp-tools")
    parser.add_argument("--sdist")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=16)
    args = parser.parse_args()
    from benchmarks.gguf_vs_llama_quantize import build_tools
    from quantdask.demo_model import generate_text
    from tests.gguf_models import llama2_style_model

    tools = build_tools(Path(args.tools), args.sdist,
                        ("llama-quantize", "llama-perplexity")).parent
    with tempfile.TemporaryDirectory(prefix="quantdask-gguf-by-hand-") as name:
        scratch = Path(name)
        # quantdask's conversion cache starts empty, as the by-hand side converts afresh
        os.environ["XDG_CACHE_HOME"] = str(scratch / "cache")
        folder = llama2_style_model(scratch / "model", hidden=args.hidden, ffn=args.ffn,
                                    layers=args.layers)
        text = scratch / "text.txt"
        text.write_text(generate_text(3000, seed=5))
        print(f"model hidden {args.hidden}, ffn {args.ffn}, {args.layers} layers; "
              f"{args.chunks} chunks of {args.ctx} tokens")
        hand_s, tool = by_hand(tools, folder, text, scratch, args.ctx, args.chunks)
        up_s, sweep_s, results = with_quantdask(folder, text, scratch, args.ctx, args.chunks)
        ours = restricted(folder, text, scratch, args.ctx, args.chunks)
        rows = {r["config_label"]: r for r in results.iter_rows(named=True)}
        print(f"by hand {hand_s:.1f} s; quantdask sweep {sweep_s:.1f} s (+ {up_s:.1f} s "
              f"cluster start-up): quantdask / by hand = {sweep_s / hand_s:.2f} "
              f"({(sweep_s + up_s) / hand_s:.2f} with start-up)")
        print("type     | tool KL   ours KL (2nd halves) | tool PPL  ours PPL | tool top1 ours"
              " | sweep KL (all positions) +- se, bpw, status")
        for t in TYPES:
            a, b, r = tool[t], ours[t], rows[t]
            print(f"{t:8s} | {a['kl_divergence']:.6f} {b['kl_divergence']:.6f} "
                  f"({b['kl_divergence'] / a['kl_divergence'] - 1:+.1%}) | "
                  f"{a['perplexity']:.3f} {b['perplexity']:.3f} "
                  f"({b['perplexity'] / a['perplexity'] - 1:+.2%}) | "
                  f"{a['top1_agreement']:.4f} {b['top1_agreement']:.4f} | "
                  f"{r['kl_divergence']:.6f} +- {r['kl_se']:.6f}, "
                  f"{r['bits_per_weight']:.2f}, {r['status']}")


if __name__ == "__main__":
    main()
