"""The time per task item in llama.cpp against the torch in-memory path (issue 69).

    .venv/bin/python -m benchmarks.gguf_task_time [--limit 160] [--slots 1]

One sweep on a local cluster of ``--slots`` CPU slots over one Llama built here that
llama.cpp's converter takes (``tests.gguf_models.large_vocab_model``: a Llama-2 style
tokenizer padded to 32,000 tokens, hidden 512, 8 layers, random weights, saved in bfloat16):
the baseline (its tasks scored once beside the reference, in torch), nf4 (torch, the model in
memory through lm-eval's HFLM) and the GGUF configs Q4_K_M and F32 (llama.cpp through
``quantdask.gguf.tasks_lm``). The task: the demo's ``demo_facts`` (eight choices a question:
``--limit`` questions, 8 log-likelihood requests each), batch 16. Prints one row per job:
task seconds, seconds per question and per request, and the accuracy (chance, 1/8, on random
weights: these are figures of time). lm-eval's own GGUF path (``--model gguf``) needs a
llama.cpp server to talk to; it is run only where ``llama_cpp.server`` imports.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--limit", type=int, default=160)
    args = parser.parse_args()

    import polars as pl

    import quantdask as qd
    from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_TASKS_DIR
    from tests.gguf_models import large_vocab_model

    work = Path(tempfile.gettempdir()) / "quantdask-bench" / "llama-32k-gguf"
    if not (work / "config.json").exists():
        large_vocab_model(work, vocab=32_000, hidden=512, ffn=1408, layers=8)
    sweep = qd.sweep_from_dict({
        "name": "gguf-task-time", "models": [{"name": "llama-32k", "path": str(work)}],
        "backends": [{"backend": "bitsandbytes", "configs": [{"bits": 4, "quant_type": "nf4"}]},
                     {"backend": "gguf", "configs": [{"type": "Q4_K_M"}, {"type": "F32"}]}],
        "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 128, "samples": 8, "batch_size": 8},
        "tasks": {"names": ["demo_facts"], "include_path": DEMO_TASKS_DIR,
                  "limit": args.limit, "batch_size": 16},
        "layer_stats": False, "timeout_s": 3600,
    })
    with tempfile.TemporaryDirectory() as run_dir, qd.start_cluster(workers=args.slots) as c:
        results = qd.run_sweep(sweep, run_dir, c.client)
        tasks = qd.read_tasks(run_dir).filter(pl.col("metric") == "acc")
    table = results.join(tasks.select("job_id", "value", "samples"), on="job_id").sort(
        "backend", "config_label").select(
        "config_label", pl.col("runtime").fill_null("torch").str.split(" (").list.first(),
        pl.col("tasks_s").round(2),
        (pl.col("tasks_s") / pl.col("samples") * 1000).round(1).alias("ms per question"),
        (pl.col("tasks_s") / (pl.col("samples") * 8) * 1000).round(2).alias("ms per request"),
        pl.col("value").round(4).alias("acc"), "samples")
    with pl.Config(tbl_formatting="MARKDOWN", tbl_hide_column_data_types=True,
                   tbl_hide_dataframe_shape=True, tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=60):
        print(table)
    if importlib.util.find_spec("llama_cpp.server") is None:
        print("lm-eval's own GGUF path: not run (it talks to a llama.cpp server; "
              "llama_cpp.server, llama-cpp-python's [server] extra, is not installed here)")


if __name__ == "__main__":
    main()
