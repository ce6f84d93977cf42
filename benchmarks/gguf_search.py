"""A GGUF search against llama.cpp's own mixes at their file sizes, measured in llama.cpp, and
its wall time at 1 and 2 slots against the naive alternative.

    .venv/bin/python -m benchmarks.gguf_search [--hidden 512] [--ffn 1536] [--layers 6]
        [--windows 32] [--seq-len 256]

The model (held out: nothing in the search was tuned on it): a Llama-2-style checkpoint built
here (``tests.gguf_models``; random weights, widths multiples of 256) whose layers differ in
sensitivity as trained models' do: every other layer's norms carry 8 outlier channels (x20),
and the last layer's down_proj weights are 3x larger.

For each of llama.cpp's Q4_K_M and Q3_K_M: the stock file's tensor bytes are the search's
budget (``budget: {bytes: N}``, the other as a frontier budget in bits per weight); the search
gives each linear, the token embedding and the output one of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
Q8_0, and its pick is written by llama.cpp's quantizer and measured in llama.cpp on the same
eval windows as the stock file, with error bars.

Time: the sweep (stock types, probes, allocation, verifying jobs) on a LocalCluster of 1 and of
2 one-thread slots, start-up apart; the naive alternative is what a user does without a
search: quantize and measure every stock type (Q2_K ... Q8_0, the K-quant mixes) and pick by
hand, as one quantdask sweep on 2 slots (its per-type figures are what they would read).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

FORMATS = {"q2": "Q2_K", "q3": "Q3_K", "q4": "Q4_K", "q5": "Q5_K", "q6": "Q6_K", "q8": "Q8_0"}
STOCK = ("Q4_K_M", "Q3_K_M")
NAIVE = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
         "Q8_0")


def held_out_model(folder: Path, hidden: int, ffn: int, layers: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from quantdask.demo_model import generate_text
    from tests.gguf_models import llama2_style_model

    llama2_style_model(folder, hidden=hidden, ffn=ffn, layers=layers, seed=7)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            if index % 2:
                layer.input_layernorm.weight[:8] *= 20
                layer.post_attention_layernorm.weight[:8] *= 20
        model.model.layers[-1].mlp.down_proj.weight *= 3
    model.save_pretrained(folder)
    (folder / "calibration.txt").write_text(generate_text(2000, seed=21))
    (folder / "eval.txt").write_text(generate_text(2000, seed=11))
    return folder


def stock_bytes(folder: Path, scratch: Path) -> dict[str, int]:
    """Each stock type's tensor bytes, as llama.cpp's quantizer writes the file."""
    from quantdask.gguf.convert import convert
    from quantdask.gguf.quantize import quantize_gguf
    from quantdask.gguf.source import gguf_module

    f32 = convert(folder, scratch / "f32.gguf")
    sizes = {}
    for name in STOCK:
        path = quantize_gguf(f32, scratch / f"{name}.gguf", name, threads=2)
        sizes[name] = sum(int(t.n_bytes) for t in gguf_module().GGUFReader(str(path)).tensors)
    return sizes


def sweep(folder: Path, args, types, search: dict | None) -> dict:
    data = {
        "name": "gguf-search-bench", "models": [{"name": "held-out", "path": str(folder)}],
        "backends": [{"backend": "gguf", "grid": {"type": list(types)}}],
        "eval": {"text": str(folder / "eval.txt"), "seq_len": args.seq_len,
                 "samples": args.windows, "batch_size": 4, "kl_top_k": "all"},
        "calibration": {"text": str(folder / "calibration.txt"), "samples": args.windows,
                        "seq_len": args.seq_len},
        "seed": 0, "retries": 0}
    if search is not None:
        data["searches"] = [search]
    return data


def timed(data: dict, run_dir: Path, slots: int):
    import quantdask as qd
    from quantdask.cluster.local import start_cluster
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    began = time.perf_counter()
    with start_cluster(workers=slots, torch_threads=1) as cluster:
        up = time.perf_counter() - began
        began = time.perf_counter()
        results = qd.run_sweep(sweep_from_dict(data), run_dir, cluster.client)
        return up, time.perf_counter() - began, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    from quantdask.report.search import agreement_table

    with tempfile.TemporaryDirectory(prefix="quantdask-gguf-search-") as name:
        scratch = Path(name)
        os.environ["XDG_CACHE_HOME"] = str(scratch / "cache")
        folder = held_out_model(scratch / "model", args.hidden, args.ffn, args.layers)
        sizes = stock_bytes(folder, scratch)
        search = {"name": "mix", "model": "held-out", "backend": "gguf",
                  "base": {"type": "Q4_K_M"},
                  "formats": {label: {"tensor_type": kind} for label, kind in FORMATS.items()},
                  "budget": {"bytes": sizes["Q4_K_M"]}, "windows": args.windows,
                  "cells_per_task": 24}
        data = sweep(folder, args, STOCK, search)
        params = None
        times = {}
        for slots in (1, 2):
            up, took, results = timed(data, scratch / f"run-{slots}", slots)
            times[slots] = (up, took)
            params = results["param_count"].drop_nulls()[0]
        assert params is not None
        # the Q3_K_M budget as a second search run on the 2-slot run's probes (they are kept)
        q3_bits = 8 * sizes["Q3_K_M"] / params
        data["searches"][0]["frontier"] = [q3_bits]
        _, _, results = timed(data, scratch / "run-2", 2)
        naive_up, naive_s, naive = timed(sweep(folder, args, NAIVE, None),
                                         scratch / "run-naive", 2)
        rows = {r["config_label"]: r for r in results.iter_rows(named=True)}
        print(f"model hidden {args.hidden}, ffn {args.ffn}, {args.layers} layers, "
              f"{params:,} weights; {args.windows} eval windows of {args.seq_len}")
        for slots, (up, took) in times.items():
            print(f"search sweep on {slots} slot(s): {took:.1f} s (+ {up:.1f} s start-up)")
        print(f"naive (every stock type, {len(NAIVE)} jobs) on 2 slots: {naive_s:.1f} s "
              f"(+ {naive_up:.1f} s)")
        print("stock | its bytes | stock KL +- se | mix label, bytes | mix KL +- se | ratio")
        mixed = [r for r in rows.values() if r["search_role"] == "mixed"]
        for stock in STOCK:
            target = bits_of(sizes[stock], params)
            mix = min(mixed, key=lambda r: abs(r["search_budget_bits_per_weight"] - target))
            plain = rows[stock]
            print(f"{stock} | {plain['size_bytes']:,} | {plain['kl_divergence']:.5f} +- "
                  f"{plain['kl_se']:.5f} | {mix['config_label']}, {mix['size_bytes']:,} | "
                  f"{mix['kl_divergence']:.5f} +- {mix['kl_se']:.5f} | "
                  f"{mix['kl_divergence'] / plain['kl_divergence']:.2f}")
        print(agreement_table(results))
        for label, row in sorted(rows.items()):
            if row["search"] is not None:
                print(f"  {label}: predicted {row['predicted_kl']:.5f}, measured "
                      f"{row['kl_divergence']:.5f} +- {row['kl_se']:.5f}, "
                      f"{row['bits_per_weight']:.3f} bpw, {row['tensor_types']}")
        for row in naive.sort("bits_per_weight").iter_rows(named=True):
            print(f"  naive {row['config_label']}: {row['kl_divergence']:.5f} +- "
                  f"{row['kl_se']:.5f} at {row['bits_per_weight']:.3f} bpw")


def bits_of(size: int, params: int) -> float:
    return 8 * size / params


if __name__ == "__main__":
    main()
