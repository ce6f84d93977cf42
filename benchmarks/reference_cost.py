"""What the tail samples cost: the reference and a job's eval, with and without them.

    .venv/bin/python -m benchmarks.reference_cost [--tails 0,64] [--work DIR]

For each model, in this process on one torch thread (the same work a CPU slot does, without a
cluster's noise): the model's reference (``compute_reference``: the unquantized model over the
eval windows, its compact distribution kept) and then one nf4 job against it (``run_job``:
load, quantize, eval; per-layer stats off), once per tail-sample count. Prints, per model and
count, the reference's seconds, its peak RSS and its bytes, and the job's eval seconds and
peak RSS. ``m = 0`` is the reference of before (the top k and one bucket: a lower bound).

Models: ``llama-58m`` (vocabulary 32,000, hidden 512, 8 layers; the model of
``benchmarks.vs_loop``), eval 32 windows of 128 tokens of the demo text; and ``llama-128k``
(Llama 3's 128,256-token output layer under a tiny body; the model of
``benchmarks.eval_memory``), 8 windows of 2,048 tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from benchmarks import eval_memory, vs_loop


def measure(model: Path, text: Path, seq_len: int, samples: int, tails: int) -> dict:
    import torch

    import quantdask as qd
    from quantdask.job.job import run_job
    from quantdask.measure.reference import compute_reference
    from quantdask.measure.usage import PeakMemory

    sweep = qd.sweep_from_dict({
        "name": "cost", "models": [{"path": str(model)}], "layer_stats": False,
        "backends": [{"backend": "bitsandbytes", "configs": [{"bits": 4}]}],
        "eval": {"text": str(text), "seq_len": seq_len, "samples": samples, "batch_size": 4,
                 "kl_tail_samples": tails}})
    nf4 = [job for job in qd.expand_grid(sweep) if job.config_label == "nf4"][0]
    torch.set_num_threads(1)
    began = time.perf_counter()
    with PeakMemory(cuda=False) as peak:
        reference = compute_reference(nf4.model, nf4.eval, text.read_text(encoding="utf-8"))
    reference_s = time.perf_counter() - began
    record = run_job(dataclasses.replace(nf4, timeout_s=1e9), qd.get_backend("bitsandbytes"),
                     reference=reference).record
    assert record["status"] == "done", record.get("error_message")
    return {"reference_s": reference_s, "reference_peak": peak.peak_rss_bytes,
            "reference_bytes": reference.nbytes, "eval_s": record["eval_s"],
            "job_peak": record["peak_host_rss_bytes"], "kl": record["kl_divergence"],
            "kl_kind": record["kl_kind"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tails", default="0,64")
    parser.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "quantdask-refcost"))
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from quantdask.demo_model import DEMO_EVAL_TEXT

    wide = eval_memory.build_model(work / "llama-128k", 128_256)
    shapes = {"llama-58m": (vs_loop.build_model(work / "llama-58m", 8), Path(DEMO_EVAL_TEXT),
                            128, 32),
              "llama-128k": (wide, eval_memory.eval_text(work / "eval.txt", 8 * 2048, wide),
                             2048, 8)}
    print("| model | windows x seq_len | tail samples | KL is | reference s | reference peak "
          "RSS | reference bytes | nf4 eval s | nf4 job peak RSS |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for name, (model, text, seq_len, samples) in shapes.items():
        for tails in (int(m) for m in args.tails.split(",")):
            m = measure(model, text, seq_len, samples, tails)
            print(f"| {name} | {samples} x {seq_len} | {tails} | {m['kl_kind']} | "
                  f"{m['reference_s']:.1f} | {m['reference_peak'] / 2**20:,.0f} MiB | "
                  f"{m['reference_bytes'] / 2**20:,.1f} MiB | {m['eval_s']:.1f} | "
                  f"{m['job_peak'] / 2**20:,.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
