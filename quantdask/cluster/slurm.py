"""A SLURM partition as a quantdask cluster, through dask-jobqueue: one GPU per worker job.

>>> cluster = slurm_cluster(scheduler_host="10.0.0.5", queue="gpu", account="ml")  # doctest: +SKIP
>>> print(cluster.job_script())                                             # doctest: +SKIP
>>> with start_cluster(cluster=cluster, adapt=Adapt(0, 16)) as handle:      # doctest: +SKIP
...     run_sweep(sweep, "runs/big", handle.client)

Each SLURM job runs one Dask worker on one GPU (``--gres=gpu:1``) with the ``GPU`` resource and
the ``quantdask.preload`` preload (it advertises the GPU's memory), and as many threads as the
sweep's ``jobs_per_gpu``. The scheduler runs in the driver's process on the submitting node, so
the results store stays with the driver: workers need no shared filesystem for results.
"""

from __future__ import annotations

from typing import Any

from quantdask.cluster.local import SCHEDULER_OPTIONS, WORKER_PRELOAD
from quantdask.errors import SpecError


def slurm_cluster(
    *,
    scheduler_host: str,
    queue: str | None = None,
    account: str | None = None,
    cpus_per_gpu: int = 8,
    memory: str = "64GB",
    walltime: str = "04:00:00",
    jobs_per_gpu: int = 1,
    gres: str = "gpu:1",
    dashboard_address: str = "127.0.0.1:8787",
    job_script_prologue: list[str] | None = None,
    **kwargs: Any,
):
    """A ``dask_jobqueue.SLURMCluster`` set up for quantdask (see the module docstring).

    ``scheduler_host`` is the address the compute nodes reach the scheduler on (the submitting
    node's, never picked silently); the dashboard stays on 127.0.0.1 unless
    ``dashboard_address`` says otherwise (reach it with ``ssh -L 8787:127.0.0.1:8787``).
    ``job_script_prologue`` lines run before the worker starts (``module load``, ``source
    .venv/bin/activate``); other keywords go to ``SLURMCluster`` as they are.
    """
    try:
        from dask_jobqueue import SLURMCluster
    except ImportError as err:
        raise SpecError("cluster", f"SLURM needs dask-jobqueue ({err}); "
                                   "pip install 'quantdask[slurm]'") from None
    if isinstance(jobs_per_gpu, bool) or not isinstance(jobs_per_gpu, int) or jobs_per_gpu < 1:
        raise SpecError("jobs_per_gpu", f"must be a positive integer, got {jobs_per_gpu!r}")
    return SLURMCluster(
        queue=queue, account=account,
        cores=jobs_per_gpu,  # Dask threads: the jobs one GPU runs at once
        processes=1,  # one worker per SLURM job, so one worker per GPU
        job_cpu=cpus_per_gpu,  # what SLURM books for torch's own threads
        memory=memory, walltime=walltime,
        job_extra_directives=[f"--gres={gres}"],
        worker_extra_args=["--resources", "GPU=1", "--preload", WORKER_PRELOAD],
        job_script_prologue=job_script_prologue or [],
        scheduler_options={"host": scheduler_host, "dashboard_address": dashboard_address,
                           **SCHEDULER_OPTIONS},
        **kwargs,
    )
