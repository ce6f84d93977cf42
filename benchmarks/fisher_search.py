"""A GGUF search of a real pretrained model scored by Fisher and refined over the cluster,
against llama.cpp's own Q4_K_M and Q3_K_M at their tensor bytes, measured in llama.cpp; and a
sample of its cells probed by KL beside their Fisher scores.

    .venv/bin/python -m benchmarks.fisher_search --model DIR --eval TEXT --calibration TEXT
        [--windows 16] [--seq-len 128] [--eval-windows 32] [--generations 4] [--offspring 8]
        [--refine-windows 16] [--kl-sample 36] [--slots 2]

The model and texts come from ``shared/real-models/RECIPE.sh`` (SmolLM2-135M-Instruct, English
Wikipedia for eval, the Lee news corpus for calibration); nothing of the search is tuned on
them. The search gives each linear, the tied token embedding (its output too) one of Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, Q8_0 (576-wide rows: llama.cpp writes most K-quants as their legacy
fallbacks, and the probes count what it writes), its budget the tensor bytes of the stock
Q4_K_M file; a second search alike (``mix3``) takes Q3_K_M's. Every job runs in llama.cpp on
the same eval windows against the float32 torch reference.

Worker time by kind comes from the run's worker_tasks and attempts frames. The KL sample runs
after the sweep, in this process: ``--kl-sample`` cells spread over the units and formats,
each probed as ``sensitivity: kl`` would (``search.probes``) on the same calibration windows,
timed, beside the Fisher score the search recorded for it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.gguf_search import FORMATS, STOCK, stock_bytes


def sweep(args, search: dict) -> dict:
    return {
        "name": "fisher-search-bench", "models": [{"name": "real", "path": args.model}],
        "backends": [{"backend": "gguf", "grid": {"type": list(STOCK)}}],
        "eval": {"text": args.eval, "seq_len": args.seq_len, "samples": args.eval_windows,
                 "batch_size": 4},
        "calibration": {"text": args.calibration, "samples": args.windows,
                        "seq_len": args.seq_len},
        "seed": 0, "retries": 1, "searches": [search]}


def worker_seconds(run_dir) -> dict[str, float]:
    import polars as pl

    from quantdask.store.run_store import read_frame

    tasks = read_frame(run_dir, "worker_tasks")
    seconds = (pl.col("finished_at") - pl.col("started_at")).dt.total_microseconds() / 1e6
    found = dict(tasks.group_by("kind").agg(seconds.sum()).iter_rows())
    attempts = read_frame(run_dir, "attempts")
    found["job"] = float(attempts.select(seconds.sum()).item() or 0.0)
    return found


def kl_sample(args, run_dir, count: int) -> list[tuple[str, str, float, float, float]]:
    """(unit, format, fisher's fitted KL, the KL probed, the probe's seconds) for ``count``
    cells spread over the search's units and formats."""
    import polars as pl

    from quantdask.backends import get_backend
    from quantdask.measure.reference import compute_reference
    from quantdask.process.model_source import load_model_source
    from quantdask.search.identity import probe_settings
    from quantdask.search.probes import Prober
    from quantdask.store.run_store import read_frame
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    data = json.loads((run_dir / "sweep.json").read_text()) if (
        run_dir / "sweep.json").exists() else None
    assert data is not None, "the run's sweep.json"
    parsed = sweep_from_dict(data)
    search = parsed.searches[0]
    settings = probe_settings(parsed, search)
    model = parsed.models[0]
    reference = compute_reference(model, settings, settings.read_text())
    built = load_model_source(model).build("cpu")
    prober = Prober(built, reference.windows, reference.distribution, 4, "cpu")
    cells = read_frame(run_dir, "sensitivity").filter(
        (pl.col("method") == "fisher") & (pl.col("kl") > 0))
    step = max(1, cells.height // count)
    chosen = cells.sort("layer", "unit", "format")[::step].head(count)
    backend, formats = get_backend("gguf"), search.format_options()
    out = []
    for row in chosen.iter_rows(named=True):
        members = (row["unit"],)  # granularity linear: a unit is its one member
        began = time.perf_counter()
        measured = prober.probe(row["unit"], members, row["format"], backend,
                                formats[row["format"]])
        out.append((row["unit"], row["format"], row["kl"], measured.kl,
                    time.perf_counter() - began))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--eval", required=True)
    parser.add_argument("--calibration", required=True)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--offspring", type=int, default=8)
    parser.add_argument("--refine-windows", type=int, default=16)
    parser.add_argument("--kl-sample", type=int, default=36)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--keep", help="a folder to keep the run directory in")
    args = parser.parse_args()

    import polars as pl
    import scipy.stats

    import quantdask as qd
    from quantdask.cluster.local import start_cluster
    from quantdask.report.search import agreement_table
    from quantdask.store.run_store import read_frame
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    with tempfile.TemporaryDirectory(prefix="quantdask-fisher-search-") as name:
        scratch = Path(args.keep or name)
        scratch.mkdir(parents=True, exist_ok=True)
        sizes = stock_bytes(Path(args.model), scratch)
        search = {"name": "mix", "model": "real", "backend": "gguf",
                  "base": {"type": "Q4_K_M"},
                  "formats": {label: {"tensor_type": kind} for label, kind in FORMATS.items()},
                  "budget": {"bytes": sizes["Q4_K_M"]}, "windows": args.windows,
                  "cells_per_task": 64, "sensitivity": "fisher",
                  "refine": {"generations": args.generations, "offspring": args.offspring,
                             "windows": args.refine_windows}}
        # the frontier budget: llama.cpp's Q3_K_M file's bytes, a search of its own (the same
        # cells, scored again: searches keep their cells apart), refined alike
        low = {**search, "name": "mix3", "budget": {"bytes": sizes["Q3_K_M"]}}
        data = sweep(args, search)
        data["searches"].append(low)
        run_dir = scratch / "run"
        began = time.perf_counter()
        with start_cluster(workers=args.slots, torch_threads=1) as cluster:
            results = qd.run_sweep(sweep_from_dict(data), run_dir, cluster.client)
        took = time.perf_counter() - began
        (run_dir / "sweep.json").write_text(json.dumps(data))
        params = int(results["param_count"].drop_nulls()[0])
        rows = {r["config_label"]: r for r in results.iter_rows(named=True)}
        print(f"model {args.model}: {params:,} weights; {args.eval_windows} eval windows of "
              f"{args.seq_len}, {args.windows} calibration windows; {args.slots} slots; "
              f"wall {took:.1f} s")
        print("worker seconds by kind:", {k: round(v, 1)
                                          for k, v in worker_seconds(run_dir).items()})
        verifying = results.filter(pl.col("search").is_in(["mix", "mix3"]))
        print(f"verifying jobs: {verifying.height}, their wall {verifying['wall_s'].sum():.1f} s")
        for stock in STOCK:
            plain = rows[stock]
            print(f"{stock}: {plain['size_bytes']:,} bytes, KL {plain['kl_divergence']:.5f} "
                  f"± {plain['kl_se']:.5f}, {plain['tensor_types']}")
        for row in verifying.sort("search", "size_bytes").iter_rows(named=True):
            print(f"  {row['search']} {row['config_label']} [{row['search_role']}]: "
                  f"{row['size_bytes']:,} bytes, KL {row['kl_divergence']:.5f} ± "
                  f"{row['kl_se']:.5f} (predicted {row['predicted_kl']:.5f}), "
                  f"{row['tensor_types']}; {row['quantized_by']}, quantize "
                  f"{row['quantize_s']:.1f} s, wall {row['wall_s']:.1f} s")
        refinement = read_frame(run_dir, "refinement")
        print(refinement.group_by("search", "generation").agg(
            pl.len(), pl.col("kl").min(), pl.col("kl_se").first(), pl.col("bytes").max(),
            pl.col("seconds").mean()).sort("search", "generation"))
        print(agreement_table(results))
        if args.kl_sample:
            sample = kl_sample(args, run_dir, args.kl_sample)
            rho = scipy.stats.spearmanr([s[2] for s in sample], [s[3] for s in sample])[0]
            per_cell = sum(s[4] for s in sample) / len(sample)
            cells = read_frame(run_dir, "sensitivity").filter(
                pl.col("method") == "fisher").height
            print(f"kl sample: {len(sample)} cells, Spearman(fisher fitted, kl) {rho:.3f}, "
                  f"{per_cell:.2f} s per kl cell in this process: kl's {cells} cells would "
                  f"take about {per_cell * cells:.0f} s of one process")
            for unit, label, fisher, kl, seconds in sample:
                print(f"  {unit} {label}: fisher {fisher:.3g}, kl {kl:.3g} ({seconds:.2f} s)")


if __name__ == "__main__":
    main()
