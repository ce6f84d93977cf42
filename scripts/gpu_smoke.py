"""The GPU smoke check: real CUDA metrics, two jobs sharing one GPU, and the HTML report.

    scripts/gpu_smoke.sh [--dry-run] [--out DIR]     (the shell script sets up and calls this)

On a CUDA machine: a LocalCUDACluster over every GPU runs a 4-config bitsandbytes sweep of the
demo model (plus its baseline) and checks that each job recorded a peak device memory above
zero and the physical GPU id (``cuda:<id>``), and that NVML samples were taken; then one GPU
with ``jobs_per_gpu: 2`` runs the sweep again and two jobs must have run on it at once; then
the HTML report of the first run is written. Each worker must advertise its GPU's memory
(the ``DEVICE_MEMORY`` resource that placement by memory uses). ``--dry-run`` does the same on
CPU slots (the tests run it so that this script does not rot), checking ``cpu`` where CUDA
would be.
Exit 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIGS = [{"bits": 4, "quant_type": "nf4"}, {"bits": 4, "quant_type": "fp4"},
           {"bits": 4, "quant_type": "nf4", "double_quant": True}, {"bits": 8}]


def sweep(name: str, jobs_per_gpu: int = 1, dry_run: bool = False, configs: int = len(CONFIGS)):
    """The smoke sweep (the baseline and the first ``configs`` of ``CONFIGS``); a dry run
    evaluates a quarter of the tokens (CPU slots are slow, and the checks are about where and
    how jobs ran, not about the numbers)."""
    from quantdask import sweep_from_dict
    from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR

    return sweep_from_dict({
        "name": name, "models": [{"name": "demo", "path": DEMO_MODEL_DIR}],
        "backends": [{"backend": "bitsandbytes", "configs": CONFIGS[:configs]}],
        "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 64 if dry_run else 128,
                 "samples": 16 if dry_run else 32, "batch_size": 8},
        "retries": 1, "jobs_per_gpu": jobs_per_gpu,
    })


def overlapping(attempts) -> list[tuple[str, str]]:
    """Pairs of attempts that ran at the same time on the same worker."""
    rows = attempts.filter(attempts["started_at"].is_not_null()).to_dicts()
    return [(a["job_id"], b["job_id"]) for i, a in enumerate(rows) for b in rows[i + 1:]
            if a["worker"] == b["worker"] and a["started_at"] < b["finished_at"]
            and b["started_at"] < a["finished_at"]]


def memory_advertised_as_expected(client, gpus: list[str], dry_run: bool) -> tuple[bool, str]:
    """Whether every worker advertises its device memory for placement: the total of one of
    the chosen GPUs by NVML, or on a CPU slot the worker's memory limit."""
    from quantdask.placement import advertised_memory

    advertised = advertised_memory(client)
    if dry_run:
        limits = {str(w["name"]): w["memory_limit"]
                  for w in client.scheduler_info(n_workers=-1)["workers"].values()}
        ok = bool(advertised) and advertised == limits
    else:
        from quantdask.devices import NvmlProbe, nvml_uuid

        # This process sees every GPU: CUDA index g, looked up in NVML by its UUID.
        totals = {NvmlProbe(nvml_uuid(int(g))).sample()["memory_total_bytes"] for g in gpus}
        ok = bool(advertised) and all(m in totals for m in advertised.values())
    shown = ", ".join(f"{n}: {(m or 0) / 2**30:.1f} GiB" for n, m in sorted(advertised.items()))
    return ok, shown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU slots instead of GPUs")
    parser.add_argument("--out", default=str(REPO / "runs" / "gpu-smoke"))
    parser.add_argument("--no-report", action="store_true",
                        help="skip the HTML report (it needs the Jupyter stack)")
    args = parser.parse_args()
    import torch

    import quantdask as qd

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        print("smoke: no CUDA GPU visible (torch.cuda.is_available() is False); "
              "use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"smoke: {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failures.append(what)

    device_pattern = r"cpu" if args.dry_run else r"cuda:\d+"
    started = time.perf_counter()
    where = {"workers": 2} if args.dry_run else {}
    with qd.start_cluster(**where) as cluster:
        print(f"smoke: {cluster.n_workers} workers ({cluster.kind}), "
              f"GPUs {cluster.gpus or '-'}", flush=True)
        ok, shown = memory_advertised_as_expected(cluster.client, cluster.gpus, args.dry_run)
        check(ok, f"each worker advertises its device memory for placement ({shown})")
        results = qd.run_sweep(sweep("smoke", dry_run=args.dry_run), out / "sweep", cluster.client)
    check(results.height == len(CONFIGS) + 1 and (results["status"] == "done").all(),
          f"{results.height} jobs done: {results['status'].to_list()}")
    for row in results.sort("config_label").to_dicts():
        print(f"smoke:      {row['config_label']:10} {row['device']:8} peak device "
              f"{(row['peak_device_mem_bytes'] or 0) / 2**20:8.1f} MiB  wall {row['wall_s']:.2f}s"
              f"  ppl {row['perplexity']:.4f}  KL {row['kl_divergence']:.3g}", flush=True)
    check(bool((results["peak_device_mem_bytes"] > 0).all()),
          "every job recorded a peak device memory above zero")
    check(all(re.fullmatch(device_pattern, d or "") for d in results["device"]),
          f"every job recorded its device as {device_pattern}: "
          f"{sorted(set(results['device'].to_list()))}")
    samples = qd.read_device_samples(out / "sweep")
    check(samples.height > 0 and bool((samples["memory_total_bytes"] > 0).all()),
          f"{samples.height} device samples with memory totals")

    shared = {"workers": 1} if args.dry_run else {"gpus": [0]}
    with qd.start_cluster(jobs_per_worker=2, **shared) as cluster:
        packed = qd.run_sweep(sweep("smoke-shared", jobs_per_gpu=2, dry_run=args.dry_run,
                                    configs=2), out / "shared", cluster.client)
    pairs = overlapping(qd.read_attempts(out / "shared"))
    check(len(pairs) > 0, f"two jobs ran at once on one {'slot' if args.dry_run else 'GPU'} "
                          f"({len(pairs)} overlapping pairs)")
    both = {job for pair in pairs for job in pair}
    flagged = packed.filter(packed["job_id"].is_in(list(both)))["peak_shared"].to_list()
    check(bool(flagged) and all(flagged),
          f"the peaks of jobs that ran at once are flagged shared ({flagged})")
    tags = qd.read_device_samples(out / "shared")["job_id"].drop_nulls().to_list()
    check(any("," in tag for tag in tags),
          f"samples taken while two jobs ran carry both ({sum(',' in t for t in tags)} of "
          f"{len(tags)} job samples)")

    if args.no_report:
        print("smoke: report skipped (--no-report)", flush=True)
    else:
        report = qd.write_report(out / "sweep")
        check(report.exists() and report.stat().st_size > 500_000,
              f"HTML report written: {report} ({report.stat().st_size / 1e6:.2f} MB)")
    print(f"smoke: {'passed' if not failures else 'FAILED: ' + '; '.join(failures)} "
          f"in {time.perf_counter() - started:.0f}s", flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
