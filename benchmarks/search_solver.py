"""The search's allocator on a large problem: 1,000 units x 5 formats (each linear of a
~140-layer model), budgets of 3 to 6 bits per weight, three candidates each.

    .venv/bin/python -m benchmarks.search_solver [--units 1000] [--repeats 3]

Each unit has a sensitivity drawn log-normally (over two orders of magnitude, as probes find
on real models), KL falling with the bits as round-to-nearest's error does (x0.3 per bit), and
the stored bytes of HQQ with its scales (2.3, 3.4, 4.5, 8.5 and 16 bits per weight). Prints,
per budget, the exact solver's time (scipy's milp) and the fallback's (no extra), the best of
``--repeats`` runs of each, and the fallback's KL above the exact one. Run it on an idle
machine: it times one process on one core.
"""

from __future__ import annotations

import argparse
import random
import time

from quantdask.search.allocation import allocate

BITS = {"b2": 2.3, "b3": 3.4, "b4": 4.5, "b8": 8.5, "keep": 16.0}
ERROR = {"b2": 1.0, "b3": 0.3, "b4": 0.09, "b8": 0.0003, "keep": 0.0}


def problem(units: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    cells = {}
    for u in range(units):
        weights, sensitivity = rng.randint(100_000, 10_000_000), rng.lognormvariate(0, 1.2)
        cells[f"layers.{u // 7}.linear{u % 7}"] = {
            f: (sensitivity * ERROR[f] * rng.uniform(0.8, 1.2), int(weights * BITS[f] / 8))
            for f in BITS}
    return cells


def best_time(run, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - began)
    return min(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cells = problem(args.units)
    full = sum(c["keep"][1] for c in cells.values())
    print(f"{args.units} units x {len(BITS)} formats, {full / 2**20:.0f} MiB at 16 bits; "
          f"best of {args.repeats}")
    print("| budget (bits/weight) | milp, 1 candidate (s) | milp, 3 candidates (s) "
          "| fallback, 3 candidates (s) | fallback's KL above milp's |")
    print("|---|---|---|---|---|")
    for bits in (3.0, 4.0, 4.5, 6.0):
        budget = int(full * bits / 16)
        one, _ = best_time(lambda b=budget: allocate(cells, b, solver="milp"), args.repeats)
        three, exact = best_time(lambda b=budget: allocate(cells, b, solver="milp",
                                                           candidates=3), args.repeats)
        fallback_s, fallback = best_time(lambda b=budget: allocate(
            cells, b, solver="fallback", candidates=3), args.repeats)
        gap = (fallback[0].kl - exact[0].kl) / exact[0].kl
        print(f"| {bits} | {one:.2f} | {three:.2f} | {fallback_s:.2f} | {gap:.4%} |")


if __name__ == "__main__":
    main()
