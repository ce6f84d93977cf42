"""A bf16 checkpoint's GGUF KL against a float32 reference and against one in bf16 (issue 69).

    bash ../shared/real-models/RECIPE.sh .venv/bin/python /work/real
    .venv/bin/python -m benchmarks.reference_dtype --real /work/real

The RECIPE's SmolLM2-135M saved in bfloat16 (as most checkpoints ship), then three sweeps of
the baseline and GGUF Q4_K_M on its eval text, each on a fresh local cluster: the default
(``eval.reference_dtype: float32``), ``reference_dtype: model`` (the reference in bf16, what
quantdask computed before), and the model loaded with ``dtype: float32``. The GGUF file is the
same in all three (converted from the same checkpoint); the first and third references are
the same bf16 weights computed in float32, so their KLs must agree, and the second reads the
reference's own bf16 rounding into every KL. Prints each sweep's KL, top-1 agreement and
perplexity, and the baseline's KL (the bf16 noise floor in the first).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

CASES = {"float32 reference (default)": ({}, "auto"),
         "bf16 reference (reference_dtype: model)": ({"reference_dtype": "model"}, "auto"),
         "model loaded in float32 (dtype: float32)": ({}, "float32")}


def bf16_copy(source: Path, out: Path) -> Path:
    """``source`` saved again in bfloat16 (its tokenizer beside it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (out / "config.json").exists():
        AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(
            torch.bfloat16).save_pretrained(out)
        AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", type=Path, default=Path("/work/real"))
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()

    import polars as pl

    import quantdask as qd

    work = Path(tempfile.gettempdir()) / "quantdask-bench"
    model = bf16_copy(args.real / "smollm2-135m", work / "smollm2-135m-bf16")
    rows = []
    for case, (eval_extra, dtype) in CASES.items():
        sweep = qd.sweep_from_dict({
            "name": "reference-dtype",
            "models": [{"name": "smollm2-bf16", "path": str(model), "dtype": dtype}],
            "backends": [{"backend": "gguf", "configs": [{"type": "Q4_K_M"}]}],
            "eval": {"text": str(args.real / "enwiki_sample.txt"), "seq_len": args.seq_len,
                     "samples": args.samples, "batch_size": 4, **eval_extra},
            "layer_stats": False, "timeout_s": 3600})
        with tempfile.TemporaryDirectory() as run_dir, qd.start_cluster(workers=1) as c:
            results = qd.run_sweep(sweep, run_dir, c.client)
        for row in results.to_dicts():
            rows.append({"case": case, "config": row["config_label"],
                         "reference_dtype": row.get("reference_dtype"),
                         "kl": row["kl_divergence"], "top1": row["top1_agreement"],
                         "perplexity": row["perplexity"]})
    with pl.Config(tbl_formatting="MARKDOWN", tbl_hide_column_data_types=True,
                   tbl_hide_dataframe_shape=True, tbl_rows=-1, tbl_width_chars=200,
                   fmt_str_lengths=60, float_precision=5):
        print(pl.DataFrame(rows))


if __name__ == "__main__":
    main()
