"""Driver overhead: no-op jobs end to end through the store, and the driver's memory.

    .venv/bin/python -m benchmarks.driver_overhead [--jobs 2000] [--memory-jobs 10000]

A benchmark-only ``noop`` backend builds the model and returns it; the eval is one 8-token
window. Throughput is jobs / the sweep's wall time (``run_sweep`` called -> returned: submit,
run, collect, and every result, attempt and log written to the run directory). Memory is the
driver process's RSS, sampled every 50 ms, from before the sweep is planned to its end.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import psutil


def run(n: int, workers: int) -> tuple[float, int, int]:
    """(seconds, RSS before, peak RSS) for a sweep of ``n`` no-op jobs."""
    from benchmarks.sweeps import synthetic
    from quantdask import run_sweep, start_cluster, sweep_from_dict

    process = psutil.Process()
    with start_cluster(workers=workers, torch_threads=1, dashboard_address=None) as cluster:
        with tempfile.TemporaryDirectory(prefix="qd-overhead-") as run_dir:
            before = process.memory_info().rss
            peak = [before]
            done = threading.Event()

            def sample():
                while not done.wait(0.05):
                    peak[0] = max(peak[0], process.memory_info().rss)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            start = time.perf_counter()
            sweep = sweep_from_dict(synthetic(f"noop{n}", "noop",
                                              [{"n": i} for i in range(n)]))
            results = run_sweep(sweep, run_dir, cluster.client)
            elapsed = time.perf_counter() - start
            done.set()
            sampler.join()
    assert results.height == n + 1 and (results["status"] == "done").all()
    return elapsed, before, peak[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--memory-jobs", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    from benchmarks.sweeps import register_synthetic_backends

    register_synthetic_backends()
    print("| jobs | workers | wall s | jobs/s | driver RSS before MB | peak MB | growth MB |")
    print("|---|---|---|---|---|---|---|")
    for n in (args.jobs, args.memory_jobs):
        elapsed, before, peak = run(n, args.workers)
        print(f"| {n} | {args.workers} | {elapsed:.1f} | {(n + 1) / elapsed:.0f} | "
              f"{before / 1e6:.0f} | {peak / 1e6:.0f} | {(peak - before) / 1e6:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
