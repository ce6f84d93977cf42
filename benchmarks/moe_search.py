"""A search of a mixture-of-experts model, GGUF and GPTQ: each layer's experts one unit per
projection (every expert in one format, as llama.cpp stores them and vLLM's fused MoE kernel
runs them), every verifying job's bytes against the probes' prediction, and the mix against
uniform formats at equal bytes.

GGUF: a tiny Mixtral (hidden 256, 4 experts of FFN width 256, 2 layers) built with a
Llama-2-style tokenizer llama.cpp's converter reads; Q2_K, Q4_K and Q8_0 per unit at 5 bits per
weight, beside llama.cpp's own Q4_K_M and Q3_K_M, every job measured in llama.cpp. GPTQ: the
tests' tiny Mixtral (hidden 64, 4 experts); 3, 4 and 8 bits at group size 32, budget 16 bits
per weight (its float32 embeddings are most of it). Nothing downloaded.

    .venv/bin/python -m benchmarks.moe_search [--skip gguf|gptq]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

COLUMNS = ("config_label", "status", "bits_per_weight", "size_bytes", "predicted_bytes",
           "kl_divergence", "kl_se")


def gguf_sweep(root: Path):
    from quantdask.demo_model import generate_text
    from tests.gguf_models import cached_f32, gguf_search_sweep, llama2_style_model

    folder = llama2_style_model(root / "mixtral", ffn=256, experts=4)
    cached_f32(folder)
    (root / "calibration.txt").write_text(generate_text(300, seed=11))
    return gguf_search_sweep(folder, str(root / "calibration.txt"), "gguf-moe", "moe",
                             types=("Q4_K_M", "Q3_K_M"), samples=16)


def gptq_sweep(root: Path):
    from quantdask.demo_model import generate_text
    from quantdask.sweepfile.sweep_file import sweep_from_dict
    from tests.conftest import sweep_dict
    from tests.tiny_families import build_tiny

    (root / "calibration.txt").write_text(generate_text(300, seed=5))
    return sweep_from_dict(sweep_dict(
        name="gptq-moe", backends=[],
        models=[{"name": "moe", "path": str(build_tiny("mixtral", root / "mixtral"))}],
        eval={"text": sweep_dict()["eval"]["text"], "seq_len": 64, "samples": 16,
              "batch_size": 8},
        calibration={"text": str(root / "calibration.txt"), "samples": 8, "seq_len": 64},
        searches=[{"name": "mix", "model": "moe", "backend": "gptq",
                   "base": {"group_size": 32},
                   "formats": {"b3": {"bits": 3}, "b4": {"bits": 4}, "b8": {"bits": 8}},
                   "budget": {"bits_per_weight": 16.0}, "windows": 8}],
        artifacts={"keep": "done", "to": str(root / "models"), "verify": True}, retries=0))


def main() -> None:
    import polars as pl

    import quantdask as qd
    from quantdask.cluster.local import start_cluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", choices=("gguf", "gptq"), action="append", default=[])
    args = parser.parse_args()
    pl.Config.set_tbl_rows(40)
    pl.Config.set_tbl_width_chars(200)
    with tempfile.TemporaryDirectory() as scratch, start_cluster(workers=2) as cluster:
        for name, make in (("gguf", gguf_sweep), ("gptq", gptq_sweep)):
            if name in args.skip:
                continue
            root = Path(scratch) / name
            root.mkdir()
            results = qd.run_sweep(make(root), root / "run", cluster.client)
            print(f"\n{name}: every job done: {set(results['status']) == {'done'}}; bytes "
                  "equal to the prediction: " + str(all(
                      r["size_bytes"] == r["predicted_bytes"] for r in results.iter_rows(
                          named=True) if r["predicted_bytes"] is not None)))
            print(results.select(*COLUMNS).sort("bits_per_weight"))


if __name__ == "__main__":
    main()
