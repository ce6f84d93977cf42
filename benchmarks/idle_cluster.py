"""What an idle quantdask cluster of CPU slots costs in CPU: under Dask's default monitoring,
and under the test suite's (``DASK_MONITORING`` in tests/conftest.py: the sampling profiler
off, the event loop's tick, the memory and the system monitors slower).

    .venv/bin/python benchmarks/idle_cluster.py [--seconds 30] [--workers 2]

Each setting runs in its own process: a local cluster is started, left alone for 5 s, then
every process of it (the driver holding the scheduler and the nannies; each worker; the fork
server) is measured over ``--seconds`` of idleness. Printed: each process's CPU as a share of
one core. Nothing runs on the cluster, so all of it is monitoring and housekeeping.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure(seconds: float, workers: int) -> dict[str, float]:
    """This process's local cluster, idle: CPU share of one core per process kind."""
    import psutil

    from quantdask.cluster.local import start_cluster

    def cpu() -> dict[int, tuple[str, float]]:
        me = psutil.Process()
        found = {}
        for process in [me, *me.children(recursive=True)]:
            try:
                times = process.cpu_times()
                if process.pid == me.pid:
                    kind = "driver (scheduler, nannies)"
                elif process.ppid() == me.pid:  # the workers are forked from it
                    kind = "fork server"
                else:
                    kind = "workers"
                found[process.pid] = (kind, times.user + times.system)
            except psutil.Error:
                continue
        return found

    with start_cluster(workers=workers, dashboard_address=None):
        time.sleep(5)
        before = cpu()
        time.sleep(seconds)
        after = cpu()
    shares: dict[str, float] = {}
    for pid, (kind, spent) in after.items():
        shares[kind] = shares.get(kind, 0.0) + (spent - before.get(pid, (kind, spent))[1]) / seconds
    return shares


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--as-the-suite", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.as_the_suite:
            import tests.conftest  # noqa: F401 - sets the suite's Dask settings, as pytest does
        print(json.dumps(measure(args.seconds, args.workers)))
        return 0
    # Dask's defaults: none of the DASK_* settings this shell may carry
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("DASK_")},
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name, extra in (("Dask's defaults", []), ("the test suite's", ["--as-the-suite"])):
        run = subprocess.run([sys.executable, __file__, "--child", "--seconds",
                              str(args.seconds), "--workers", str(args.workers), *extra],
                             capture_output=True, text=True, env=env, cwd=REPO, check=True)
        shares = json.loads(run.stdout.strip().splitlines()[-1])
        parts = ", ".join(f"{kind} {share:.1%}" for kind, share in sorted(shares.items()))
        print(f"{name}: {sum(shares.values()):.1%} of a core idle ({parts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
