"""Host memory of CPU workers against the checkpoint's size: does each worker keep a private
full-precision copy of the model?

    .venv/bin/python -m benchmarks.host_memory [--slots 2] [--layers 8] [--dtype float32]

One model (the ~58M-parameter Llama of ``benchmarks.vs_loop``: vocabulary 32,000, hidden 512,
``--layers`` layers; random weights, saved as one safetensors file), swept with the baseline and
four bitsandbytes configs (nf4, fp4, int8 at two thresholds) on a local cluster of ``--slots``
CPU slots, each sweep in a fresh run directory. ``--dtype`` is the model's ``dtype:`` in the
sweep (a dtype other than the checkpoint's makes every load a conversion).

Prints two Markdown tables:

- per job: ``peak_host_rss_bytes`` (the worker's peak resident set while the job ran; on Linux
  that counts the checkpoint's memory-mapped pages it touched, which the OS page cache shares
  between processes) against the checkpoint's bytes;
- per worker, idle, before and after the sweep: its resident set, how much of it is private
  memory that no other process shares (USS), and how much is anonymous memory (RssAnon: what
  a copy of the weights in the process's own heap would show up in).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

MIB = 2**20


def _worker_memory() -> dict[str, int]:
    """This worker process's memory now (runs on the worker)."""
    import gc

    import psutil

    gc.collect()
    full = psutil.Process().memory_full_info()
    anon = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
    return {"rss": full.rss, "uss": full.uss, "anon": anon}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    import quantdask as qd
    from benchmarks.vs_loop import build_model
    from quantdask.demo_model import DEMO_EVAL_TEXT

    model_path = build_model(Path(tempfile.gettempdir()) / f"quantdask-llama58m-1408-{args.layers}",
                             args.layers)
    checkpoint = sum(f.stat().st_size for f in model_path.glob("*.safetensors"))
    sweep = qd.sweep_from_dict({
        "name": "host-memory",
        "models": [{"name": "llama58m", "path": str(model_path), "dtype": args.dtype}],
        "backends": [
            {"backend": "bitsandbytes", "grid": {"bits": [4], "quant_type": ["nf4", "fp4"]}},
            {"backend": "bitsandbytes", "grid": {"bits": [8], "int8_threshold": [6.0, 0.0]}},
        ],
        "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 128, "samples": 8, "batch_size": 4},
    })
    with tempfile.TemporaryDirectory() as run_dir, \
            qd.start_cluster(workers=args.slots, dashboard_address=None) as cluster:
        idle = cluster.client.run(_worker_memory)
        results = qd.run_sweep(sweep, run_dir, cluster.client)
        workers = cluster.client.run(_worker_memory)
    print(f"checkpoint: {checkpoint / MIB:,.0f} MiB (model dtype in the sweep: {args.dtype})\n")
    print("| job | status | worker | peak_host_rss MiB | x checkpoint |")
    print("|---|---|---|---|---|")
    for row in results.sort("started_at").iter_rows(named=True):
        peak = row["peak_host_rss_bytes"] or 0
        print(f"| {row['config_label']} | {row['status']} | {row['worker']} | "
              f"{peak / MIB:,.0f} | {peak / checkpoint:.2f} |")
    print("\n| worker | when | RSS MiB | private (USS) MiB | anonymous MiB |")
    print("|---|---|---|---|---|")
    for when, table in (("before the sweep", idle), ("after the sweep", workers)):
        for n, address in enumerate(sorted(table)):
            memory = table[address]
            print(f"| {n} | {when} | {memory['rss'] / MIB:,.0f} | {memory['uss'] / MIB:,.0f} | "
                  f"{memory['anon'] / MIB:,.0f} |")


if __name__ == "__main__":
    main()
