"""quantdask against the plain in-process loop a competent user writes in a notebook.

    .venv/bin/python -m benchmarks.vs_loop [--reps 3] [--slots 2] [--layers 8] [--layer-stats both]

The same model (a Llama of ~58M parameters: vocabulary 32,000, hidden 512, 8 layers; random
weights, built here once), the same 12 bitsandbytes configs as ``benchmarks.sweeps``
(nf4/fp4 x double quant x compute dtype; int8 at 4 thresholds), the same eval (the demo text,
32 windows of 128 tokens) and the same cores, two ways, interleaved (loop, quantdask, loop, ...):

Each run is a fresh process of its own, its imports done before its clock starts.

(a) the loop: one Python process with ``--slots`` torch threads, already warm (its imports
    are not timed); the unquantized model's log-probs computed once; then per config
    ``from_pretrained(path, quantization_config=BitsAndBytesConfig(...))`` and perplexity, KL
    (full vocabulary) and top-1 agreement. Nothing else: no per-layer stats, no records.
(b) quantdask: ``import quantdask`` (and torch, transformers), then the clock: ``--slots``
    CPU slots (one torch thread each, lending their cores to each other when idle) started,
    the 13 jobs (the baseline too) run with everything quantdask records (peaks, logs,
    parquet; per-layer weight and output errors on, off, or each in turn), the cluster
    closed: all of it timed, as the user waits for it.

Prints a Markdown table of the runs, medians and the throughput ratio (configs per second).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quantdask.backends.bitsandbytes import BitsAndBytesOptions

REPO = Path(__file__).resolve().parent.parent


def build_model(out: Path, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantdask.demo_model import DEMO_MODEL_DIR

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    # Every width a multiple of 64: bitsandbytes' CPU 4-bit kernel needs it on processors with
    # AVX512-BF16 (1,376, the width of before, is refused there; see the bitsandbytes backend).
    config = LlamaConfig(vocab_size=32_000, hidden_size=512, intermediate_size=1408,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((Path(DEMO_MODEL_DIR) / name).read_bytes())
    return out


def configs() -> list[BitsAndBytesOptions]:
    from benchmarks.sweeps import twelve_configs
    from quantdask import expand_grid, sweep_from_dict

    return [job.options for job in expand_grid(sweep_from_dict(twelve_configs()))
            if job.backend == "bitsandbytes"]


def in_fresh_process(*args: str) -> float:
    """One way's seconds, measured in a fresh process of its own: neither way inherits what
    the other left in a process. (When quantdask ran in the benchmark's own process, which
    then kept a closed client's threads and the fork server, each loop run after it took
    118-121 s instead of 92-94.)"""
    out = subprocess.run([sys.executable, "-m", "benchmarks.vs_loop", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return float(out.stdout.strip().splitlines()[-1])


def run_loop(model_path: Path, threads: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from benchmarks.sweeps import EVAL

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer(Path(EVAL["text"]).read_text(encoding="utf-8"))["input_ids"]
    seq, n, batch = EVAL["seq_len"], EVAL["samples"], EVAL["batch_size"]
    windows = torch.tensor(ids[:seq * n]).view(n, seq)
    AutoModelForCausalLM.from_pretrained(model_path)  # warm: file cache, lazy imports

    def log_probs(model):
        with torch.inference_mode():
            return torch.cat([torch.log_softmax(model(input_ids=b).logits[:, :-1].float(), -1)
                              for b in windows.split(batch)])

    started = time.perf_counter()
    log_p = log_probs(AutoModelForCausalLM.from_pretrained(model_path).eval())
    for options in configs():
        if options.bits == 4:
            config = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type=options.quant_type,
                bnb_4bit_use_double_quant=options.double_quant,
                bnb_4bit_compute_dtype=getattr(torch, options.compute_dtype))
        else:
            config = BitsAndBytesConfig(load_in_8bit=True,
                                        llm_int8_threshold=options.int8_threshold)
        model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=config,
                                                     device_map="cpu").eval()
        log_q = log_probs(model)
        targets = windows[:, 1:].unsqueeze(-1)
        perplexity = math.exp(-log_q.gather(-1, targets).mean().item())
        kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
        top1 = (log_p.argmax(-1) == log_q.argmax(-1)).float().mean().item()
        print(options, f"ppl {perplexity:.3f} KL {kl:.4g} top-1 {top1:.3f}", file=sys.stderr)
    return time.perf_counter() - started


def quantdask_run(model_path: Path, slots: int, layer_stats: bool) -> float:
    import quantdask as qd
    from benchmarks.sweeps import twelve_configs

    data = twelve_configs("vs-loop")
    data["models"] = [{"name": "llama58m", "path": str(model_path)}]
    data["layer_stats"] = layer_stats
    sweep = qd.sweep_from_dict(data)
    with tempfile.TemporaryDirectory() as run_dir:
        started = time.perf_counter()
        with qd.start_cluster(workers=slots, dashboard_address=None) as cluster:
            results = qd.run_sweep(sweep, run_dir, cluster.client)
        took = time.perf_counter() - started
    assert (results["status"] == "done").all(), results.select("status", "error_message")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--layer-stats", choices=("on", "off", "both"), default="both",
                        help="quantdask's per-layer weight and output errors (the loop has none)")
    parser.add_argument("--loop-only", metavar="MODEL", help=argparse.SUPPRESS)
    parser.add_argument("--quantdask-only", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop_only:
        print(run_loop(Path(args.loop_only), args.slots))
        return
    if args.quantdask_only:
        # Imported before the clock, as the loop's are (a notebook has them already).
        import torch  # noqa: F401
        import transformers.modeling_utils  # noqa: F401

        import quantdask  # noqa: F401

        print(quantdask_run(Path(args.quantdask_only), args.slots, args.layer_stats == "on"))
        return
    model_path = build_model(Path(tempfile.gettempdir()) / f"quantdask-llama58m-1408-{args.layers}",
                             args.layers)
    slots = ("--slots", str(args.slots))
    ways = {"loop": lambda: in_fresh_process("--loop-only", str(model_path), *slots)}
    for stats in {"on": ["on"], "off": ["off"], "both": ["on", "off"]}[args.layer_stats]:
        ways[f"quantdask, per-layer stats {stats}"] = (
            lambda stats=stats: in_fresh_process("--quantdask-only", str(model_path), *slots,
                                                 "--layer-stats", stats))
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.reps):
        for way, run in ways.items():
            times[way].append(run())
        print(", ".join(f"{way} {runs[-1]:.1f}s" for way, runs in times.items()),
              file=sys.stderr, flush=True)
    base = statistics.median(times["loop"])
    print("| way | runs (s) | median s | throughput vs the loop |")
    print("|---|---|---|---|")
    for way, runs in times.items():
        median = statistics.median(runs)
        print(f"| {way} | {', '.join(f'{t:.1f}' for t in runs)} | {median:.1f} | "
              f"{base / median:.2f}x |")


if __name__ == "__main__":
    main()
