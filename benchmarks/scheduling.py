"""Scheduling quality: jobs of known, uneven length at 1, 2, 4, 8 and 16 workers.

    .venv/bin/python -m benchmarks.scheduling [--workers 1,2,4,8,16]

A benchmark-only ``sleep`` backend holds its worker for a set time (the longest jobs get the
highest priority, as a user would set them). For each worker count, a fresh LocalCluster runs
the 24 jobs; the makespan (first attempt start -> last attempt end) is compared with the lower
bound no schedule can beat, max(longest attempt, total attempt time / workers), both from the
measured attempts (so per-job overhead counts on both sides and the ratio is the idle time the
scheduling left).
"""

from __future__ import annotations

import argparse
import tempfile

DURATIONS = [4.0, 3.0, 2.5, 2.0, 2.0, 1.5, 1.5, 1.5, 1.2, 1.0, 1.0, 1.0,
             0.8, 0.8, 0.6, 0.6, 0.5, 0.5, 0.4, 0.4, 0.3, 0.3, 0.2, 0.2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4,8,16")
    args = parser.parse_args()
    from benchmarks.sweeps import register_synthetic_backends, synthetic
    from quantdask import (
        read_attempts,
        read_sessions,
        run_sweep,
        start_cluster,
        sweep_from_dict,
        sweep_summary,
    )

    register_synthetic_backends()
    configs = [{"seconds": s, "n": i} for i, s in enumerate(DURATIONS)]
    sweep = sweep_from_dict(synthetic("sched", "sleep", configs,
                                      priority_by=lambda c: int(c["seconds"] * 10)))
    print(f"{len(DURATIONS)} jobs, {sum(DURATIONS):.1f} s of sleep, longest {max(DURATIONS)} s\n")
    print("| workers | work s | longest s | lower bound s | makespan s | makespan / bound |")
    print("|---|---|---|---|---|---|")
    for n in [int(x) for x in args.workers.split(",")]:
        with tempfile.TemporaryDirectory(prefix="qd-sched-") as run_dir:
            with start_cluster(workers=n, torch_threads=1, dashboard_address=None) as cluster:
                results = run_sweep(sweep, run_dir, cluster.client)
            assert (results["status"] == "done").all(), results
            row = sweep_summary(read_attempts(run_dir), read_sessions(run_dir)).row(0, named=True)
        print(f"| {n} | {row['work_s']:.2f} | {row['longest_task_s']:.2f} | "
              f"{row['lower_bound_s']:.2f} | {row['makespan_s']:.2f} | "
              f"{row['makespan_vs_lower_bound']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
