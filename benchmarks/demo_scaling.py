"""The demo's scaling step (its configs without its search, at 1 and 2 workers), repeated and
interleaved, as ``quantdask demo`` runs it with more repeats: the median speedup, its spread
and the verdict, each run's machine load beside it.

    .venv/bin/python -m benchmarks.demo_scaling [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="a new directory for the runs (default: a temporary one)")
    args = parser.parse_args()

    from quantdask.cli.commands import _scale, without_search
    from quantdask.demo_model import load_demo_sweep
    from quantdask.run.scaling import worker_counts_here

    with tempfile.TemporaryDirectory(prefix="quantdask-demo-scaling-") as name:
        _scale(without_search(load_demo_sweep()), worker_counts_here([1, 2]),
               args.out or f"{name}/scaling", "127.0.0.1", args.repeats)


if __name__ == "__main__":
    main()
