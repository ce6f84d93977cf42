"""quantdask against the way users sweep today, on the same machine, in one run.

    .venv/bin/python -m benchmarks.vs_naive [--slots 2] [--reps 3]

The same 12 bitsandbytes configs of the demo model, three ways, each repeated ``--reps`` times
in turn (a, b, c, a, b, c, ...) so that machine noise hits all three alike:

(a) serial: one Python process per config, one after the other (torch with every core);
(b) parallel: one process per config, ``--slots`` at a time (torch threads split among them);
(c) quantdask: a LocalCluster of ``--slots`` CPU slots started, the sweep run, the cluster
    closed: all of it timed (the cluster start is part of what the user waits for).

Each process of (a) and (b) imports torch and transformers, loads the model and computes the
unquantized reference for KL itself; quantdask does those once per worker / once per model (and
runs one job more: the baseline). Prints a Markdown table of medians and ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = 12


def naive(index: int, threads: int) -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.naive_one", str(index),
                          "--threads", str(threads)], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    if out.returncode != 0 or '"status": "done"' not in out.stdout:
        raise RuntimeError(f"naive job {index} failed: {out.stdout[-500:]} {out.stderr[-2000:]}")


def serial() -> float:
    start = time.perf_counter()
    for index in range(CONFIGS):
        naive(index, threads=os.cpu_count() or 1)
    return time.perf_counter() - start


def parallel(slots: int) -> float:
    threads = max(1, (os.cpu_count() or 1) // slots)
    start = time.perf_counter()
    with ThreadPoolExecutor(slots) as pool:
        list(pool.map(lambda i: naive(i, threads), range(CONFIGS)))
    return time.perf_counter() - start


def with_quantdask(slots: int) -> float:
    from benchmarks.sweeps import twelve_configs
    from quantdask import run_sweep, start_cluster, sweep_from_dict

    sweep = sweep_from_dict(twelve_configs())
    with tempfile.TemporaryDirectory(prefix="qd-bench-") as run_dir:
        start = time.perf_counter()
        with start_cluster(workers=slots, dashboard_address=None) as cluster:
            results = run_sweep(sweep, run_dir, cluster.client)
        elapsed = time.perf_counter() - start
    if (results["status"] != "done").any() or results.height != CONFIGS + 1:
        raise RuntimeError(f"quantdask run incomplete:\n{results}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"serial": [], "parallel": [], "quantdask": []}
    for rep in range(args.reps):
        times["serial"].append(serial())
        times["parallel"].append(parallel(args.slots))
        times["quantdask"].append(with_quantdask(args.slots))
        print(f"rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.1f}s" for k, v in times.items()),
              flush=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{CONFIGS} configs, {args.slots} slots, {os.cpu_count()} cores, median of "
          f"{args.reps}\n")
    print("| way | runs (s) | median s | quantdask faster by |")
    print("|---|---|---|---|")
    for way, label in (("serial", "(a) serial, a process per config"),
                       ("parallel", f"(b) {args.slots} processes at a time"),
                       ("quantdask", f"(c) quantdask, {args.slots} slots")):
        runs = ", ".join(f"{t:.1f}" for t in times[way])
        ratio = median[way] / median["quantdask"]
        print(f"| {label} | {runs} | {median[way]:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
