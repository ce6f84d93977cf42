"""What task accuracy costs per job, against the eval: ``tasks_s`` beside ``eval_s``.

    .venv/bin/python -m benchmarks.task_time [--slots 2] [--limit N]
    .venv/bin/python -m benchmarks.task_time --gguf [--slots 1] [--limit 160]

One sweep on a local cluster of ``--slots`` CPU slots over two models: the demo model (~0.9M
parameters, vocabulary 320) and the ~58M-parameter Llama of ``benchmarks.vs_loop`` (vocabulary
32,000, hidden 512, 8 layers, random weights; built once), each unquantized (the baseline), nf4
and int8; the demo eval (32 windows of 128 tokens) and the demo's multiple-choice task
``demo_facts`` (480 questions of eight choices: 3,840 log-likelihood requests; ``--limit``
fewer), batch 16. Prints one row per job: eval seconds, task seconds and their ratio, with the
task phase's peak RSS; the baseline's task time is that of its model's tasks part, scored once
beside the reference.

``--gguf``: the time per task item in llama.cpp against the torch in-memory path (issue 69),
on one Gemma llama.cpp's converter takes (``tests.gguf_models.gemma_style_model``: a
SentencePiece vocabulary of 512 pieces, which lm-eval splits into context and continuation as
a real one; hidden 512, 8 layers, random weights): the baseline and nf4 in torch (lm-eval's
HFLM on the model in memory), GGUF Q4_K_M and F32 in llama.cpp (``quantdask.gguf.tasks_lm``).
lm-eval's own GGUF path (``--model gguf``) needs a llama.cpp server to talk to; it is not run where
llama-cpp-python's server does not import (its ``[server]`` extra), and the output says so.
"""

from __future__ import annotations

import argparse
import importlib
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--gguf", action="store_true",
                        help="llama.cpp's time per task item against torch's")
    args = parser.parse_args()

    import polars as pl

    import quantdask as qd

    sweep = gguf_sweep(args.limit or 160) if args.gguf else torch_sweep(args.limit)
    slots = args.slots or (1 if args.gguf else 2)
    with tempfile.TemporaryDirectory() as run_dir, qd.start_cluster(workers=slots) as c:
        results = qd.run_sweep(sweep, run_dir, c.client)
        tasks = qd.read_tasks(run_dir).filter(pl.col("metric") == "acc")
    table = results.join(tasks.select("job_id", "value", "samples"), on="job_id").sort(
        "model", "backend", "config_label").select(
        "model", "param_count", "config_label",
        pl.col("runtime").fill_null("torch").str.split(" (").list.first(),
        pl.col("eval_s").round(2), pl.col("tasks_s").round(2),
        (pl.col("tasks_s") / pl.col("eval_s")).round(1).alias("tasks / eval"),
        (pl.col("tasks_s") / pl.col("samples") * 1000).round(1).alias("ms per question"),
        (pl.col("tasks_peak_host_rss_bytes") / 2**20).round(0).alias("tasks peak RSS MiB"),
        pl.col("value").round(4).alias("acc"), "samples")
    with pl.Config(tbl_formatting="MARKDOWN", tbl_hide_column_data_types=True,
                   tbl_hide_dataframe_shape=True, tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=60,
                   tbl_width_chars=240):
        print(table)
    if args.gguf:
        try:
            importlib.import_module("llama_cpp.server.app")
        except ImportError as error:
            print(f"lm-eval's own GGUF path: not run (it talks to a llama.cpp server, and "
                  f"llama-cpp-python's does not import here: {error}; its [server] extra)")


def _sweep(name: str, models: list[dict], backends: list[dict], limit: int | None):
    import quantdask as qd
    from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_TASKS_DIR

    return qd.sweep_from_dict({
        "name": name, "models": models, "backends": backends,
        "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 128, "samples": 32, "batch_size": 8},
        "tasks": {"names": ["demo_facts"], "include_path": DEMO_TASKS_DIR,
                  "limit": limit, "batch_size": 16},
        "layer_stats": False, "timeout_s": 3600,
    })


def torch_sweep(limit: int | None):
    """The demo model and the 58M Llama of ``benchmarks.vs_loop``, nf4 and int8."""
    from benchmarks.vs_loop import build_model
    from quantdask.demo_model import DEMO_MODEL_DIR

    large = build_model(Path(tempfile.gettempdir()) / "quantdask-bench" / "llama-58m", layers=8)
    return _sweep("task-time", [{"name": "demo", "path": DEMO_MODEL_DIR},
                                {"name": "llama-58m", "path": str(large)}],
                  [{"backend": "bitsandbytes", "configs": [{"bits": 4, "quant_type": "nf4"},
                                                           {"bits": 8}]}], limit)


def gguf_sweep(limit: int):
    """A Gemma llama.cpp converts: nf4 in torch, Q4_K_M and F32 in llama.cpp."""
    from tests.gguf_models import gemma_style_model

    work = Path(tempfile.gettempdir()) / "quantdask-bench" / "gemma-24m-gguf"
    if not (work / "config.json").exists():
        gemma_style_model(work, hidden=512, ffn=1408, layers=8)
    return _sweep("gguf-task-time", [{"name": "gemma-24m", "path": str(work)}],
                  [{"backend": "bitsandbytes", "configs": [{"bits": 4, "quant_type": "nf4"}]},
                   {"backend": "gguf", "configs": [{"type": "Q4_K_M"}, {"type": "F32"}]}],
                  limit)


if __name__ == "__main__":
    main()
