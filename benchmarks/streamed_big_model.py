"""Layer-streamed models (issue 42), run by hand; results in RESULTS.md section 15.

1. ``big``: a random-init llama of 522M parameters (2.09 GB in float32, 40 layers) measured on
   two CPU slots whose memory limit (Dask's, which its nanny enforces) is below 1 GB: the
   baseline and two quantized configs, each streamed because placement finds it does not fit
   resident. Every job must be done, streamed, with its peak resident memory below the limit.
   With ``--gptq``: the baseline and GPTQ 4-bit, fitted block by block from the checkpoint.
2. ``cost``: the price of streaming on a model that fits: one pass over the same windows,
   resident (built from the checkpoint, then run) against streamed (each layer read, run over
   every window, dropped), in one process, so the ratio is measured under the same load.

    .venv/bin/python benchmarks/streamed_big_model.py big --limit 950MB
    .venv/bin/python benchmarks/streamed_big_model.py big --limit 950MB --gptq
    .venv/bin/python benchmarks/streamed_big_model.py cost
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BIG = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=40,
           num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
           tie_word_embeddings=True)
MID = dict(BIG, hidden_size=512, intermediate_size=1408, num_hidden_layers=16,
           num_attention_heads=8, num_key_value_heads=8)


def random_llama(directory: Path, shape: dict) -> Path:
    """A random-init llama of ``shape`` saved in float32 with the demo tokenizer (made once)."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's tests/
    from tests.tiny_families import copy_demo_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(directory, max_shard_size="500MB")
    copy_demo_tokenizer(directory)
    return directory


def big(directory: Path, limit: str, gptq: bool = False) -> None:
    import polars as pl

    import quantdask as qd
    from quantdask.demo_model import DEMO_EVAL_TEXT
    from quantdask.sweepfile.settings import CalibrationSettings
    from quantdask.util import format_bytes

    model = random_llama(directory / "big", BIG)
    backends = [qd.BackendBlock("bitsandbytes", configs=[{"bits": 4}, {"bits": 8}])]
    if gptq:  # GPTQ fitted block by block from the checkpoint (gptqmodel's offloading fit)
        backends = [qd.BackendBlock("gptq", configs=[{"bits": 4, "group_size": 128}])]
    sweep = qd.Sweep(name="big", models=[qd.ModelSpec(path=str(model), name="big")],
                     backends=backends,
                     eval=qd.EvalSettings(text=DEMO_EVAL_TEXT, seq_len=128, samples=8,
                                          batch_size=4), retries=0,
                     calibration=CalibrationSettings(text=DEMO_EVAL_TEXT, samples=16,
                                                     seq_len=128) if gptq else None)
    began = time.perf_counter()
    with qd.start_cluster(workers=2, memory_limit=limit) as cluster:
        results = qd.run_sweep(sweep, directory / ("run-gptq" if gptq else "run"),
                               cluster.client)
    wall = time.perf_counter() - began
    shown = results.select("config_label", "status", "streamed", "perplexity", "kl_divergence",
                           "size_bytes", "peak_host_rss_bytes", "stream_bytes_read",
                           "stream_layer_s", "calibrate_s", "quantize_s", "eval_s", "wall_s",
                           "error_message")
    with pl.Config(tbl_cols=-1, tbl_width_chars=200, fmt_str_lengths=60):
        print(shown)
    limit_bytes = cluster_limit(limit)
    print(f"sweep wall {wall:.0f} s; memory limit {format_bytes(limit_bytes)}; checkpoint "
          f"{format_bytes(sum(f.stat().st_size for f in model.glob('*.safetensors')))}")
    assert (results["status"] == "done").all(), "every job done"
    assert results["streamed"].all(), "every job streamed"
    assert (results["peak_host_rss_bytes"] < limit_bytes).all(), "peaks below the limit"


def cluster_limit(limit: str) -> int:
    from dask.utils import parse_bytes

    return int(parse_bytes(limit))


def cost(directory: Path, repeats: int = 3) -> None:
    import torch

    from quantdask.measure.logits import sliced_log_probs
    from quantdask.process.model_source import load_model_source
    from quantdask.stream.streaming import StreamedModel
    from quantdask.sweepfile.model import ModelSpec

    model = random_llama(directory / "mid", MID)
    source = load_model_source(ModelSpec(path=str(model)))
    for windows_count in (8, 32):
        windows = torch.randint(0, BIG["vocab_size"], (windows_count, 256),
                                generator=torch.Generator().manual_seed(0))
        timings: dict[str, list[float]] = {"resident": [], "streamed": []}
        for _ in range(repeats):
            began = time.perf_counter()
            resident = source.build("cpu")  # as a job does: from the checkpoint, then run
            for _piece in sliced_log_probs(resident, windows, 4, "cpu"):
                pass
            del resident
            timings["resident"].append(time.perf_counter() - began)
            began = time.perf_counter()
            for _piece in StreamedModel(source, "cpu").log_probs(windows, 4):
                pass
            timings["streamed"].append(time.perf_counter() - began)
        best = {name: min(values) for name, values in timings.items()}
        print(f"{windows_count} windows x 256 tokens, {MID['num_hidden_layers']} layers: "
              f"resident {best['resident']:.2f} s ({best['resident'] / windows_count:.3f} "
              f"s/window), streamed {best['streamed']:.2f} s "
              f"({best['streamed'] / windows_count:.3f} s/window): streamed / resident "
              f"{best['streamed'] / best['resident']:.2f} (best of {repeats})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("big", "cost"))
    parser.add_argument("--dir", default="/tmp/quantdask-streaming", type=Path)
    parser.add_argument("--limit", default="950MB", help="each CPU slot's memory limit")
    parser.add_argument("--gptq", action="store_true",
                        help="big: GPTQ 4-bit (fitted from the checkpoint) instead of nf4, int8")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.what == "big":
        big(args.dir, args.limit, args.gptq)
    else:
        cost(args.dir)


if __name__ == "__main__":
    main()
