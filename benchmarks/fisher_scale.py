"""The Fisher search at the scale of the models people ship: a GGUF search of a model shaped
like Qwen2.5-1.5B (28 layers, hidden 1536, ffn 8960, 12 heads / 2 KV heads, vocabulary
151,936, tied embeddings; random weights: cost only) scored with ``sensitivity: fisher`` on a
2-slot LocalCluster, and kl's cost beside it, from a few kl cells timed in this process.

    .venv/bin/python -m benchmarks.fisher_scale [--layers 28] [--windows 16] [--seq-len 128]
        [--fisher-tokens 512] [--kl-cells 3] [--slots 2] [--batch 2]

What is timed: ``search.probing.probe`` end to end (the units, the calibration reference, the
passes, every cell and each format on every unit at once), the cluster started apart; no
verifying job runs (the cells are the search's cost). The kl estimate: the seconds of
``--kl-cells`` cells probed as ``sensitivity: kl`` would (``search.probes.Prober``, one thread,
units spread over the depth), times the search's cell count.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks.gguf_search import FORMATS


def qwen_shaped(folder: Path, layers: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from quantdask.demo_model import generate_text
    from tests.tiny_families import copy_demo_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=4096, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    copy_demo_tokenizer(folder)
    (folder / "calibration.txt").write_text(generate_text(3000, seed=21))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--fisher-tokens", type=int, default=512)
    parser.add_argument("--kl-cells", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2,
                        help="windows per forward and backward pass (a pass of 4 windows of "
                             "128 holds ~4 GB of activations beside the model's 6.2 GB)")
    args = parser.parse_args()

    import logging

    import polars as pl

    logging.basicConfig(format="%(asctime)s %(message)s")
    logging.getLogger("quantdask.driver").setLevel(logging.INFO)

    from quantdask.backends import get_backend
    from quantdask.cluster.local import start_cluster
    from quantdask.measure.reference import compute_reference
    from quantdask.process.model_source import load_model_source
    from quantdask.search.identity import probe_settings
    from quantdask.search.probes import Prober, linear_units
    from quantdask.search.probing import probe
    from quantdask.store.run_store import RunStore, read_frame
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    with tempfile.TemporaryDirectory(prefix="quantdask-fisher-scale-") as name:
        scratch = Path(name)
        began = time.perf_counter()
        folder = qwen_shaped(scratch / "model", args.layers)
        print(f"model built and saved in {time.perf_counter() - began:.0f} s")
        text = str(folder / "calibration.txt")
        data = {"name": "scale", "models": [{"name": "qwen-shaped", "path": str(folder)}],
                "eval": {"text": text, "seq_len": args.seq_len, "samples": 4,
                         "batch_size": args.batch},
                "calibration": {"text": text, "samples": args.windows, "seq_len": args.seq_len},
                "searches": [{"name": "mix", "model": "qwen-shaped", "backend": "gguf",
                              "base": {"type": "Q4_K_M"},
                              "formats": {k: {"tensor_type": v} for k, v in FORMATS.items()},
                              "budget": {"bits_per_weight": 5.0}, "windows": args.windows,
                              "cells_per_task": 32, "sensitivity": "fisher",
                              "fisher_tokens": args.fisher_tokens}]}
        sweep = sweep_from_dict(data)
        search = sweep.searches[0]
        run_dir = scratch / "run"
        # a cache of its own: every tensor quantized in this run (none found from a last one)
        os.environ["XDG_CACHE_HOME"] = str(scratch / "cache")
        store = RunStore(run_dir)
        with start_cluster(workers=args.slots, torch_threads=1) as cluster:
            began = time.perf_counter()
            probed = probe(sweep, search, store, cluster.client)
            took = time.perf_counter() - began
        assert probed is not None
        tasks = read_frame(run_dir, "worker_tasks")
        seconds = (pl.col("finished_at") - pl.col("started_at")).dt.total_microseconds() / 1e6
        by_kind = dict(tasks.group_by("kind").agg(seconds.sum()).iter_rows())
        cells = read_frame(run_dir, "sensitivity").filter(pl.col("method") == "fisher").height
        print(f"fisher probing on {args.slots} slots: {took:.0f} s wall, {cells} cells; worker "
              f"seconds by kind: { {k: round(v) for k, v in by_kind.items()} }")
        print(f"method: {probed.method.why if probed.method else '?'}")
        if not args.kl_cells:
            return
        # kl's estimate: a few cells timed as kl probes them
        settings = probe_settings(sweep, search)
        model = sweep.models[0]
        reference = compute_reference(model, settings, settings.read_text())
        built = load_model_source(model).build("cpu")
        units = linear_units(built, "linear", embeddings=True)
        names = list(units)
        prober = Prober(built, reference.windows, reference.distribution, 4, "cpu")
        gguf, formats = get_backend("gguf"), search.format_options()
        timed = []
        for i in range(args.kl_cells):
            unit = names[1 + i * (len(names) - 2) // max(1, args.kl_cells - 1)]
            began = time.perf_counter()
            prober.probe(unit, units[unit], "q4", gguf, formats["q4"])
            timed.append(time.perf_counter() - began)
        per = sum(timed) / len(timed)
        print(f"kl: {per:.1f} s per cell on one thread here ({[round(t, 1) for t in timed]}); "
              f"its {cells} cells would take about {per * cells / 60:.0f} min of worker time, "
              f"{per * cells / 60 / args.slots:.0f} min on {args.slots} slots")


if __name__ == "__main__":
    main()
