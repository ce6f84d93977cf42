"""One config, one Python process: the loop users write today (``for config: python job.py``).

    python -m benchmarks.naive_one INDEX [--threads N]

Runs job INDEX of the 12-config benchmark sweep with quantdask's own job function but no
orchestration: the process imports everything, loads the model, computes the unquantized
reference for KL, quantizes, evaluates, prints one JSON line, and exits.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("index", type=int)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.sweeps import twelve_configs
    from quantdask.backends import get_backend
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    jobs = [j for j in expand_grid(sweep_from_dict(twelve_configs())) if j.backend != "none"]
    job = jobs[args.index]
    from quantdask.job.job import run_job

    record = run_job(job, get_backend(job.backend), 1).record
    print(json.dumps({"config": job.config_label, "status": record["status"],
                      "perplexity": record.get("perplexity"),
                      "error": record.get("error_message")}))


if __name__ == "__main__":
    main()
