"""What calibration buys: AutoRound tuned on calibration data against round-to-nearest at the
same bits, group size and format.

    .venv/bin/python -m benchmarks.calibration_vs_rtn [--iters 200] [--bits 3,4] [--work DIR]

``autoround`` with ``iters: 0`` is plain round-to-nearest of the same integer format (AutoRound's
data-driven "optimized RTN" turned off), exported and reloaded the same way; with ``iters: N``
AutoRound tunes each block's rounding and clipping on the calibration windows. Calibration:
32 windows of 128 tokens of text generated like the demo's (other sentences than the eval's);
eval: the demo eval text, 32 windows of 128 tokens, KL over the top 64 (the default). Models:
the demo model (trained, 320-token vocabulary), and a small Llama trained here with a
32,768-token output layer (as in ``benchmarks.kl_top_k``). Each job runs in this process
(``run_job``, one CPU slot's work). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def sweep_data(model: str, calibration: str, bits: list[int], iters: int) -> dict:
    from quantdask.demo_model import DEMO_EVAL_TEXT

    configs = [{"bits": b, "group_size": g, "iters": i}
               for b in bits for g in (32, 128) for i in (0, iters)]
    return {"name": "calibration-vs-rtn", "models": [{"path": model}],
            "backends": [{"backend": "autoround", "configs": configs}],
            "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 128, "samples": 32, "batch_size": 8},
            "calibration": {"text": calibration, "samples": 32, "seq_len": 128}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--bits", default="3,4")
    parser.add_argument("--work", default=None, help="where the trained 32k model is kept")
    args = parser.parse_args(argv)

    from benchmarks.kl_top_k import models
    from quantdask.backends import get_backend
    from quantdask.demo_model import generate_text
    from quantdask.job.job import run_job
    from quantdask.measure.reference import compute_reference
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    work = Path(args.work or tempfile.mkdtemp(prefix="calibration-vs-rtn-"))
    work.mkdir(parents=True, exist_ok=True)
    calibration = work / "calibration.txt"
    calibration.write_text(generate_text(2000, seed=7))
    bits = [int(b) for b in args.bits.split(",")]
    rows = []
    for name, path in models(work).items():
        if name == "qwen2-151k-random":
            continue  # flat predictions: KL there says nothing of the rounding
        jobs = expand_grid(sweep_from_dict(sweep_data(path, str(calibration), bits,
                                                      args.iters)))
        reference = compute_reference(jobs[0].model, jobs[0].eval, jobs[0].eval.read_text(),
                                      calibration=jobs[0].calibration)
        results = {}
        for job in jobs[1:]:
            record = run_job(job, get_backend(job.backend), reference=reference).record
            assert record["status"] == "done", record.get("error_message")
            results[(job.options.bits, job.options.group_size, job.options.iters)] = record
        for b in bits:
            for g in (32, 128):
                rtn, tuned = results[(b, g, 0)], results[(b, g, args.iters)]
                change = 100 * (tuned["kl_divergence"] - rtn["kl_divergence"]) \
                    / rtn["kl_divergence"]
                rows.append(f"| {name} | {b} | {g} | {rtn['kl_divergence']:.5f} | "
                            f"{tuned['kl_divergence']:.5f} | {change:+.1f}% | "
                            f"{rtn['perplexity']:.4f} | {tuned['perplexity']:.4f} | "
                            f"{tuned['calibrate_s']:.1f} |")
                print(rows[-1], flush=True)
    print(f"\n| model | bits | group | KL, round-to-nearest | KL, AutoRound {args.iters} iters "
          "| KL change | perplexity, RTN | perplexity, AutoRound | calibrate_s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
