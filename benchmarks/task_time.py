"""What task accuracy costs per job, against the eval: ``tasks_s`` beside ``eval_s``.

    .venv/bin/python -m benchmarks.task_time [--slots 2] [--limit N]

One sweep on a local cluster of ``--slots`` CPU slots over two models: the demo model (~0.9M
parameters, vocabulary 320) and the ~58M-parameter Llama of ``benchmarks.vs_loop`` (vocabulary
32,000, hidden 512, 8 layers, random weights; built once), each unquantized (the baseline), nf4
and int8; the demo eval (32 windows of 128 tokens) and the demo's multiple-choice task
``demo_facts`` (480 questions of eight choices: 3,840 log-likelihood requests; ``--limit``
fewer), batch 16. Prints one row per job: eval seconds, task seconds and their ratio, with the
task phase's peak RSS; the baseline's task time is that of its model's tasks part, scored once
beside the reference.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()

    import polars as pl

    import quantdask as qd
    from benchmarks.vs_loop import build_model
    from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR, DEMO_TASKS_DIR

    work = Path(tempfile.gettempdir()) / "quantdask-bench"
    large = build_model(work / "llama-58m", layers=8)
    sweep = qd.sweep_from_dict({
        "name": "task-time",
        "models": [{"name": "demo", "path": DEMO_MODEL_DIR},
                   {"name": "llama-58m", "path": str(large)}],
        "backends": [{"backend": "bitsandbytes", "configs": [
            {"bits": 4, "quant_type": "nf4"}, {"bits": 8}]}],
        "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 128, "samples": 32, "batch_size": 8},
        "tasks": {"names": ["demo_facts"], "include_path": DEMO_TASKS_DIR,
                  "limit": args.limit, "batch_size": 16},
        "layer_stats": False, "timeout_s": 3600,
    })
    with tempfile.TemporaryDirectory() as run_dir, qd.start_cluster(workers=args.slots) as c:
        results = qd.run_sweep(sweep, run_dir, c.client)
        tasks = qd.read_tasks(run_dir).filter(pl.col("metric") == "acc")
    table = results.join(tasks.select("job_id", "value", "samples"), on="job_id").sort(
        "model", "config_label").select(
        "model", "param_count", "config_label", pl.col("eval_s").round(2),
        pl.col("tasks_s").round(2),
        (pl.col("tasks_s") / pl.col("eval_s")).round(1).alias("tasks / eval"),
        (pl.col("tasks_peak_host_rss_bytes") / 2**20).round(0).alias("tasks peak RSS MiB"),
        pl.col("value").round(4).alias("acc"), "samples")
    with pl.Config(tbl_formatting="MARKDOWN", tbl_hide_column_data_types=True,
                   tbl_hide_dataframe_shape=True, tbl_rows=-1, tbl_cols=-1):
        print(table)


if __name__ == "__main__":
    main()
