"""What a search's probes cost: cells per second on 1 and 2 CPU slots, and what starting each
cell at its unit's decoder layer (from the captured hidden states) saves against running the
whole model for every cell.

    .venv/bin/python -m benchmarks.search_probes [--windows 64] [--seq-len 128]

On the demo model (4 layers, 28 linears) with HQQ at 2, 3, 4 and 8 bits, group 32, plus each
format on every unit at once: 116 probed cells and 28 kept ones. ``search.searches.probe`` runs
them as Dask tasks on a fresh local cluster of 1 slot, then of 2 (each time: the probe
reference, the units' task and every chunk; the cluster's start is not counted; a fresh run
directory, so nothing is reused), each slot computing on one thread (one core). Then in this
process, one ``Prober``: every cell timed as the search runs it (from its layer) and from the
first layer. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR, generate_text

FORMATS = {"b2": {"bits": 2}, "b3": {"bits": 3}, "b4": {"bits": 4}, "b8": {"bits": 8},
           "keep": None}


def sweep(work: Path, windows: int, seq_len: int):
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    calibration = work / "calibration.txt"
    calibration.write_text(generate_text(600, seed=11))
    return sweep_from_dict({
        "name": "bench", "models": [{"name": "demo", "path": DEMO_MODEL_DIR}],
        "eval": {"text": DEMO_EVAL_TEXT, "seq_len": seq_len, "samples": 8},
        "calibration": {"text": str(calibration), "seq_len": seq_len},
        "searches": [{"name": "mix", "model": "demo", "backend": "hqq",
                      "base": {"group_size": 32}, "formats": FORMATS,
                      "budget": {"bits_per_weight": 8.0}, "windows": windows,
                      "cells_per_task": 8}]})


def on_slots(spec, work: Path, slots: int) -> tuple[float, int]:
    """Seconds to probe every cell on ``slots`` CPU slots, and the cells probed."""
    import quantdask as qd
    from quantdask.search.probing import probe
    from quantdask.store.run_store import RunStore

    # One torch thread per slot: one slot computes on one core, as a GPU worker on one GPU (a
    # lone CPU slot would otherwise take both cores, and 2 slots would only share them).
    with qd.start_cluster(workers=slots, torch_threads=1, dashboard_address=None) as cluster:
        store = RunStore(work / f"run-{slots}").create()
        began = time.perf_counter()
        probed = probe(spec, spec.searches[0], store, cluster.client)
        seconds = time.perf_counter() - began
    return seconds, sum(len(c) for c in probed.cells.values())


def in_process(spec) -> tuple[float, float, int]:
    """Seconds for every probed cell from its layer and from the first layer, and cells."""
    from quantdask.backends import get_backend
    from quantdask.measure.reference import compute_reference
    from quantdask.process.model_source import load_model_source
    from quantdask.search.identity import probe_settings
    from quantdask.search.probes import Prober, linear_units

    class FromTheStart(Prober):
        def measure(self, first_layer: int = 0):
            return super().measure(0)

    search = spec.searches[0]
    settings = probe_settings(spec, search)
    model = spec.models[0]
    reference = compute_reference(model, settings, settings.read_text())
    backend, formats = get_backend("hqq"), search.format_options()
    times = []
    for kind in (Prober, FromTheStart):
        built = load_model_source(model).build("cpu")
        prober = kind(built, reference.windows, reference.distribution, settings.batch_size,
                      "cpu")
        units = linear_units(built, "linear")
        began, cells = time.perf_counter(), 0
        for unit, modules in units.items():
            for label, options in formats.items():
                if options is not None:
                    prober.probe(unit, modules, label, backend, options)
                    cells += 1
        times.append(time.perf_counter() - began)
    return times[0], times[1], cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        spec = sweep(work, args.windows, args.seq_len)
        one, cells = on_slots(spec, work, 1)
        two, _ = on_slots(spec, work, 2)
        print(f"{cells} cells (with keep), {args.windows} windows of {args.seq_len} tokens")
        print("| slots | probing (s) | cells/s | against 1 slot |")
        print("|---|---|---|---|")
        print(f"| 1 | {one:.1f} | {cells / one:.1f} | 1.00 |")
        print(f"| 2 | {two:.1f} | {cells / two:.1f} | {two / one:.2f} |")
        started, whole, probed = in_process(spec)
        print(f"\nIn one process, {probed} probed cells: from each unit's layer {started:.1f} s, "
              f"from the first layer {whole:.1f} s ({started / whole:.2f}x)")


if __name__ == "__main__":
    main()
