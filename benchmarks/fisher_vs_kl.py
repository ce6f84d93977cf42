"""Fisher against kl on the same searches: the Spearman of their cell scores, the measured KL
(eval windows) of each method's allocation at equal bytes with error bars, and each method's
probing worker time.

    .venv/bin/python -m benchmarks.fisher_vs_kl [--models demo,fragile,deep] [--windows 16]

The models (nothing tuned on them):
- ``demo``: the built-in demo model (trained on the project's own text, 4 layers);
- ``fragile``: the demo model with one planted outlier unit made without changing its function
  (``tests.test_search.fragile_model``: one input column of layer 2's down_proj per group of 32
  times 64, the matching up_proj row divided by 64);
- ``deep``: a 24-layer Llama (hidden 256, ffn 512, random weights), for the time at depth.

Each runs one sweep holding two identical HQQ searches (b2, b3, b4 at group 32, and keep; one
budget between uniform b2 and b3, at 7.2 bits per weight of the whole model on the demo, with
its float32 embeddings), one scored by ``kl``, one by ``fisher``, verified on the same eval
windows on a 2-slot LocalCluster; worker time by method from the worker_tasks frame.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def deep_model(folder: Path) -> str:
    from tests.gguf_models import llama2_style_model

    llama2_style_model(folder, hidden=256, ffn=512, layers=24, seed=3)
    return str(folder)


def search(name: str, model: str, method: str, windows: int, budget: float) -> dict:
    return {"name": name, "model": model, "backend": "hqq", "base": {"group_size": 32},
            "formats": {"b2": {"bits": 2}, "b3": {"bits": 3}, "b4": {"bits": 4}, "keep": None},
            "budget": {"bits_per_weight": budget}, "windows": windows, "tie": [],
            "cells_per_task": 32, "sensitivity": method}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,fragile,deep")
    parser.add_argument("--windows", type=int, default=16)
    args = parser.parse_args()

    import polars as pl
    import scipy.stats

    import quantdask as qd
    from quantdask.cluster.local import start_cluster
    from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR, generate_text
    from quantdask.store.run_store import read_frame
    from quantdask.sweepfile.sweep_file import sweep_from_dict
    from tests.test_search import fragile_model

    with tempfile.TemporaryDirectory(prefix="quantdask-fisher-vs-kl-") as name, \
            start_cluster(workers=2, torch_threads=1) as cluster:
        scratch = Path(name)
        calibration = scratch / "calibration.txt"
        calibration.write_text(generate_text(1500, seed=12))
        paths = {"demo": DEMO_MODEL_DIR, "fragile": fragile_model(scratch / "fragile"),
                 "deep": None}
        budgets = {"demo": 7.2, "fragile": 7.2, "deep": 5.0}
        for label in args.models.split(","):
            path = paths[label] or deep_model(scratch / "deep")
            runs = {}
            for method in ("kl", "fisher"):
                data = {"name": f"fvk-{label}-{method}",
                        "models": [{"name": label, "path": path}],
                        "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 64, "samples": 32,
                                 "batch_size": 8},
                        "calibration": {"text": str(calibration), "samples": args.windows,
                                        "seq_len": 64},
                        "searches": [search("mix", label, method, args.windows,
                                            budgets[label])]}
                run_dir = scratch / f"run-{label}-{method}"
                runs[method] = (run_dir, qd.run_sweep(sweep_from_dict(data), run_dir,
                                                      cluster.client))
            cells = {m: read_frame(d, "sensitivity").filter(
                (pl.col("layer") >= 0) & (pl.col("format") != "keep")).select(
                "unit", "format", pl.col("kl").alias(m)) for m, (d, _) in runs.items()}
            pairs = cells["kl"].join(cells["fisher"], on=["unit", "format"]).drop_nulls()
            rho = scipy.stats.spearmanr(pairs["kl"], pairs["fisher"])[0]
            seconds = (pl.col("finished_at") - pl.col("started_at")).dt.total_microseconds() / 1e6
            probing = {m: float(read_frame(d, "worker_tasks").filter(pl.col("kind").is_in(
                ["probe", "fisher pass"])).select(seconds.sum()).item() or 0.0)
                for m, (d, _) in runs.items()}
            print(f"{label}: {pairs.height} cells, Spearman(kl, fisher) {rho:.3f}; probing "
                  f"worker seconds kl {probing['kl']:.1f}, fisher {probing['fisher']:.1f} "
                  f"({probing['fisher'] / max(probing['kl'], 1e-9):.2f}x)")
            for method, (_, results) in runs.items():
                for row in results.filter(pl.col("search").is_not_null()).sort(
                        "size_bytes").iter_rows(named=True):
                    print(f"  {method:6} {row['config_label']:24} [{row['search_role']}] "
                          f"{row['size_bytes']:>9,} B: KL {row['kl_divergence']:.5f} ± "
                          f"{row['kl_se']:.5f} (predicted {row['predicted_kl']:.5f})")

if __name__ == "__main__":
    main()
