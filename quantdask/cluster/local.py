"""Start or connect to the Dask cluster that runs the jobs: one worker per GPU (or CPU slot).

>>> with start_cluster(workers=2) as cluster:  # doctest: +SKIP
...     print(cluster.dashboard_link)
>>> with start_cluster(address="tls://node0:8786", security=tls_security(  # doctest: +SKIP
...         "ca.pem", "me.pem", "me-key.pem")) as cluster:
...     print(cluster.n_workers)

Everything quantdask starts binds to 127.0.0.1 (its dashboard too) unless told otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from distributed import Client
from distributed.security import Security

from quantdask.cluster.adapt import Adapt
from quantdask.cluster.operations import cuda_device_count
from quantdask.errors import SpecError
from quantdask.process.runtime import TorchThreads, WarmImports
from quantdask.process.slot_memory import slot_memory_limit

log = logging.getLogger("quantdask.cluster")

CLOSE_TIMEOUT_S = 60
WORKER_PRELOAD = "quantdask.preload"
"""Loaded by every worker quantdask starts (and by ``dask worker --preload quantdask.preload``):
the worker advertises its device memory before it joins."""
FORK_SERVER_PRELOAD = ("quantdask.process.library_noise", "distributed", *WarmImports.modules,
                       "quantdask.process.fork_server_exit")
"""What the CPU slots' fork server imports before it forks a worker (``use_fork_server``): the
libraries' notices quieted first, the server's quick exit last. Names held as strings: CPython's
fork server swallows an ImportError of one, so tests/test_architecture.py imports each."""

SCHEDULER_OPTIONS = {"allowed_failures": 0}
"""Dask would rerun a task whose worker died up to 3 times on its own, silently; quantdask's
retry policy counts and classifies those losses instead, so Dask is told to rerun nothing.
(A scheduler reached by address keeps its own setting.)"""


def tls_security(ca_file: str, cert: str, key: str | None = None) -> Security:
    """Dask security settings for mutual TLS: ``ca_file`` signs every certificate; ``cert``
    (and ``key``, unless the cert file holds it) identify this process. quantdask's local
    clusters use the same pair for their scheduler and workers; ``require_encryption`` refuses
    any plain-TCP connection."""
    for name, path in (("tls_ca_file", ca_file), ("tls_cert", cert), ("tls_key", key)):
        if path is not None and not os.path.isfile(path):
            raise SpecError(name, f"no file at {path}; give the PEM file's path")
    return Security(tls_ca_file=ca_file, tls_client_cert=cert, tls_client_key=key,
                    tls_scheduler_cert=cert, tls_scheduler_key=key, tls_worker_cert=cert,
                    tls_worker_key=key, require_encryption=True)


SHUTDOWN_RACES = ("Failed to communicate with scheduler during heartbeat",
                  "Scheduler was unaware of this worker")
"""What a worker logs when its heartbeat meets the scheduler already closed (or already
forgetting it) as its cluster closes: Dask's own shutdown race, with a traceback, news to
nobody when quantdask is closing the cluster on purpose."""


def _not_a_shutdown_race(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(SHUTDOWN_RACES)


async def quiet_shutdown_races() -> None:
    """(Run on each worker as quantdask closes its local cluster; a coroutine, so that
    ``Client.run`` need not wait for it.) Drop the heartbeat's shutdown-race lines from here
    on: mid-run, before this, they still show."""
    logging.getLogger("distributed.worker").addFilter(_not_a_shutdown_race)


@dataclass
class ClusterHandle:
    """A Dask client and, for a cluster started here, the cluster (closed on exit)."""

    client: Client
    cluster: Any = None
    kind: str = "external"
    gpus: list[str] = field(default_factory=list)  # physical GPU ids

    @property
    def dashboard_link(self) -> str:
        return self.client.dashboard_link

    @property
    def n_workers(self) -> int:
        return len(self.client.scheduler_info(n_workers=-1)["workers"])

    def close(self) -> None:
        if self.cluster is not None:
            # Sent ahead of the close, not waited on (a busy worker must not hold it up); a
            # cluster already broken closes all the same.
            with contextlib.suppress(Exception):
                self.client.run(quiet_shutdown_races, wait=False)
        self.client.close()
        if self.cluster is not None:
            try:
                # Bounded: a nanny restarting a killed worker can hold a close up; its
                # processes are children of this one and end with it.
                self.cluster.close(timeout=CLOSE_TIMEOUT_S)
            except TimeoutError:
                log.warning("the local cluster did not close within %ds; its worker "
                            "processes end with this process", CLOSE_TIMEOUT_S)

    def __enter__(self) -> ClusterHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _parse_gpus(gpus: str | list[int] | None) -> list[int] | None:
    if gpus is None:
        return None
    if isinstance(gpus, str):
        try:
            gpus = [int(g) for g in gpus.split(",") if g.strip()]
        except ValueError:
            raise SpecError("gpus", f"must be comma-separated GPU ids such as 0,1, "
                                    f"got {gpus!r}") from None
    if not gpus or any(not isinstance(g, int) or g < 0 for g in gpus):
        raise SpecError("gpus", f"must be GPU ids >= 0 such as 0,1, got {gpus!r}")
    return list(gpus)


def start_cluster(
    workers: int | None = None,
    gpus: str | list[int] | None = None,
    address: str | None = None,
    host: str = "127.0.0.1",
    dashboard_address: str | None = "127.0.0.1:0",
    torch_threads: int | None = None,
    jobs_per_worker: int = 1,
    adapt: Adapt | None = None,
    security: Security | None = None,
    cluster: Any = None,
    scheduler: str | None = None,
    memory_limit: int | str | None = None,
) -> ClusterHandle:
    """A cluster to run sweeps on; use it as a context manager.

    - ``address="tcp://host:8786"`` (or ``tls://``; ``scheduler=`` is the same): connect to a
      running Dask scheduler. Its workers must carry the ``GPU`` resource (``dask worker
      ADDRESS --nthreads 1 --resources GPU=1 --preload quantdask.preload``; see
      docs/beyond-one-machine.md).
    - ``cluster=``: a Dask cluster object made elsewhere (``dask_jobqueue.SLURMCluster``, see
      ``quantdask.cluster.slurm``); it is not closed on exit.
    - With CUDA GPUs: ``dask_cuda.LocalCUDACluster``, one worker per GPU in ``gpus`` (default all).
    - Without: ``distributed.LocalCluster`` with ``workers`` single-threaded processes (default 2),
      each holding resource ``GPU=1`` as a CPU slot that stands in for a GPU.

    ``adapt=Adapt(1, 4)`` lets a local (or given) cluster grow and shrink with the queue; on GPUs
    it never goes past the GPUs chosen. ``security=tls_security(...)`` makes every connection
    mutual TLS. Servers bind to ``host`` (127.0.0.1 unless you choose otherwise);
    ``dashboard_address=None`` turns the dashboard off. ``jobs_per_worker`` (a sweep's
    ``jobs_per_gpu``) is how many jobs one worker may run at once; ``torch_threads`` caps torch's
    threads on CPU slots. ``memory_limit`` (bytes, "1600MiB"): each CPU slot's Dask memory
    limit (GPU workers and workers started elsewhere refuse it; ``process.slot_memory``).
    """
    if isinstance(jobs_per_worker, bool) or not isinstance(jobs_per_worker, int) \
            or jobs_per_worker < 1:
        raise SpecError("jobs_per_worker", f"must be a positive integer, got {jobs_per_worker!r}")
    if address is not None and scheduler is not None and address != scheduler:
        raise SpecError("scheduler", "give the scheduler's address once (address= or scheduler=)")
    address = address or scheduler
    memory_limit = slot_memory_limit(memory_limit, address is not None or cluster is not None)
    if address is not None or cluster is not None:
        if workers is not None or gpus is not None:
            raise SpecError("scheduler", "connects to an existing cluster; do not combine it "
                                         "with --workers or --gpus")
        return _connect(address, cluster, adapt, security)
    selected, available = _local_devices(workers, gpus, adapt, memory_limit)
    common: dict[str, Any] = {
        "host": host, "dashboard_address": dashboard_address, "threads_per_worker":
        jobs_per_worker, "resources": {"GPU": 1}, "silence_logs": logging.ERROR,
        "scheduler_kwargs": SCHEDULER_OPTIONS, "preload": [WORKER_PRELOAD],
    }
    if security is not None:
        common.update(security=security, protocol="tls://")
    if available and workers is None:
        return _start_cuda_cluster(_physical_gpus(selected or list(range(available)), adapt),
                                   common, adapt)
    common.update({"memory_limit": memory_limit} if memory_limit is not None else {})
    return _start_cpu_slots(workers or 2, common, adapt, torch_threads, jobs_per_worker,
                            security)


def _local_devices(workers: int | None, gpus: str | list[int] | None, adapt: Adapt | None,
                   memory_limit: int | None = None) -> tuple[list[int] | None, int]:
    """(the GPUs chosen, or None for all; the CUDA GPUs this process sees), the worker count and
    GPU ids checked, and a memory limit refused for GPU workers (theirs is their GPU's)."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or workers < 1):
        raise SpecError("workers", f"must be a positive integer, got {workers!r}")
    if workers is not None and adapt is not None:
        raise SpecError("adapt", "sets the number of workers itself (MIN:MAX); do not combine "
                                 "it with --workers")
    selected = _parse_gpus(gpus)
    available = cuda_device_count()
    if selected is not None and available == 0:
        raise SpecError("gpus", "no CUDA GPU is visible here; use --workers N for CPU slots")
    if selected is not None and max(selected) >= available:
        raise SpecError("gpus", f"GPU {max(selected)} does not exist; this machine has "
                                f"{available} (ids 0-{available - 1})")
    if memory_limit is not None and available and workers is None:
        raise SpecError("memory_limit", f"--memory-limit (start_cluster(memory_limit=...)) is a "
                        f"CPU slot's Dask memory limit, and this machine's {available} GPU(s) "
                        "make GPU workers, whose device memory is the GPU's own (they run "
                        "without a host memory limit): drop --memory-limit, or give --workers N "
                        "for CPU slots")
    return selected, available


def _connect(address: str | None, cluster: Any, adapt: Adapt | None,
             security: Security | None) -> ClusterHandle:
    """A client of a running scheduler (``address``) or of a cluster object made elsewhere."""
    if address is not None and cluster is not None:
        raise SpecError("cluster", "give a cluster object or an address, not both")
    if address is not None and adapt is not None:
        raise SpecError("adapt", "a scheduler reached by address cannot scale its workers "
                                 "from here; start them adaptively where they run")
    if cluster is not None:
        if adapt is not None:
            adapt.apply(cluster)
        client = Client(cluster, security=security or getattr(cluster, "security", None))
    else:
        client = Client(address, security=security)
    return ClusterHandle(client=client, kind="external")


def _physical_gpus(local: list[int], adapt: Adapt | None) -> list[str]:
    """The physical ids of the GPUs this process calls ``local``: ids count the GPUs it sees,
    so they map through an inherited CUDA_VISIBLE_DEVICES (e.g. a SLURM allocation). Its
    entries are kept as they are, numbers or UUIDs (``GPU-...``, ``MIG-...``, which dask-cuda
    takes too); never parsed as numbers."""
    inherited = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                 if g.strip()]
    physical = [inherited[i] if i < len(inherited) else str(i) for i in local]
    if adapt is not None and adapt.maximum > len(physical):
        raise SpecError("adapt.maximum", f"{adapt.maximum} workers, but {len(physical)} "
                                         f"GPU(s) chosen: one worker per GPU, so at most "
                                         f"{len(physical)}")
    return physical


def _start_cpu_slots(n: int, common: dict[str, Any], adapt: Adapt | None,
                     torch_threads: int | None, jobs_per_worker: int,
                     security: Security | None) -> ClusterHandle:
    """``n`` CPU slots (single-threaded worker processes holding ``GPU=1``) on this machine."""
    if adapt is not None:
        # At least one from the start: placement learns the workers' memory from the first.
        n = max(1, adapt.minimum)
        import psutil

        # Each slot's share of the host, as if all were running: a slot added later must not
        # advertise (as its device memory) what the earlier ones already have.
        common.setdefault("memory_limit", psutil.virtual_memory().total // adapt.maximum)
    threads = torch_threads or max(1, (os.cpu_count() or 1)
                                   // ((adapt.maximum if adapt else n) * jobs_per_worker))
    from distributed import LocalCluster

    _fork_cpu_slots_from_a_warm_server()
    _keep_nannies_of_lost_workers()
    _keep_glibc_malloc_defaults()
    local_cluster = LocalCluster(
        n_workers=n, processes=True,
        # CPU slots stay on the CPU even on a machine with GPUs.
        env={"CUDA_VISIBLE_DEVICES": ""}, **common,
    )
    if adapt is not None:
        adapt.apply(local_cluster)
    client = Client(local_cluster, security=security)
    client.register_plugin(TorchThreads(threads, share=torch_threads is None))
    client.register_plugin(WarmImports())
    log.info("started %d CPU slots%s; dashboard %s", n,
             f" (adapting {adapt.minimum}-{adapt.maximum})" if adapt else "",
             client.dashboard_link)
    return ClusterHandle(client=client, cluster=local_cluster, kind="cpu")


def _fork_cpu_slots_from_a_warm_server() -> None:
    """Start (and restart) CPU slots by forking a server process that imported torch,
    transformers and bitsandbytes once, instead of spawning an interpreter that imports them
    again: about 7 s of CPU per worker on a 2-core machine, paid at every start, every restart
    after a timeout and every slot adaptive scaling adds. (Dask's ``forkserver`` method; the
    server imports but never computes, so no thread or device state is forked.)

    The setting is process-wide (Dask reads it whenever a nanny starts a worker). dask-cuda
    workers keep Dask's default ``spawn`` unless this process started CPU slots before.
    """
    import dask
    from distributed.utils import get_mp_context

    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    # After Dask's own first call, which sets its preload list once: this one replaces it (it
    # takes effect when the server first starts). Only libraries that start no thread when
    # imported: a fork copies just the forking thread, so a lock another thread held (polars'
    # allocator, say; quantdask imports polars) would stay locked in every worker. The
    # libraries' known notices are quieted first (quantdask.process.library_noise).
    # Last, the server's quick exit (quantdask.process.fork_server_exit).
    get_mp_context().set_forkserver_preload(list(FORK_SERVER_PRELOAD))


def _keep_nannies_of_lost_workers() -> None:
    """Never let the local cluster close a nanny because its worker was once lost.

    A ``SpecCluster`` (LocalCluster, LocalCUDACluster) closes a worker's nanny for good when,
    ``distributed.deploy.lost-worker-timeout`` (15 s) after the worker left the scheduler, no
    worker of that name is there. The timer belongs to the earlier loss, but it looks at the
    present: a worker killed by a job and brought back by its nanny, then restarted by
    quantdask (a hung job) within 15 s, has its nanny closed in the middle of that restart and
    the cluster stays a slot short. A local nanny brings its worker back itself, so the timer
    only does harm here. (Process-wide, like every Dask setting.)
    """
    import dask

    dask.config.set({"distributed.deploy.lost-worker-timeout": "24h"})


def _keep_glibc_malloc_defaults() -> None:
    """Start workers with glibc's own malloc tuning, not Dask's ``MALLOC_TRIM_THRESHOLD_``.

    Dask's nanny sets that variable (to 65536) in each worker's environment, to hand freed
    memory back to the OS at once (dataframe workloads). Any explicit glibc threshold also
    turns off glibc's dynamic mmap threshold: every tensor over 128 KiB becomes a fresh
    mapping, page-faulted in again at each batch. A torch eval on one thread took 6.7 s with
    it and 5.1 s without (the vs_loop model, nf4). The nanny also writes it into the
    environment of the process that starts the cluster, so a notebook's later subprocesses
    inherited the slowdown too. (Process-wide, like every Dask setting; a variable the user
    set in the shell still wins.)
    """
    import dask

    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", default={}))
    environ["MALLOC_TRIM_THRESHOLD_"] = None  # Dask's way to unset one
    dask.config.set({"distributed.nanny.pre-spawn-environ": environ})


def _start_cuda_cluster(gpus: list[str], common: dict[str, Any],
                        adapt: Adapt | None) -> ClusterHandle:
    # dask_cuda imports CUDA bindings at import time, so it is imported only when GPUs exist.
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as err:
        raise SpecError("gpus", dask_cuda_missing(err)) from None
    # Adaptive: start the minimum (at least one: dask-cuda refuses none, and placement learns
    # the GPUs' memory from it); dask-cuda gives each new worker the next unused GPU.
    _keep_nannies_of_lost_workers()
    _keep_glibc_malloc_defaults()
    cluster = LocalCUDACluster(
        CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)),
        n_workers=max(1, adapt.minimum) if adapt is not None else len(gpus),
        # No host-memory limit (0: distributed's parse_memory_limit, which dask-cuda 26.10
        # calls, makes it None; its device-host file then keeps host data unbounded). Dask's
        # default splits the host's memory between the workers, and the nanny pauses a worker
        # at 80% of its limit and kills it at 95%. A GPU worker's host memory is not Dask data:
        # it maps a checkpoint and builds a model before moving it to its GPU. Any limit is
        # read once, when the cluster starts: on a VM whose memory grows after boot that can
        # be a few GiB, and the workers would pause before the first job and hang the sweep.
        # Running out of host memory for real is a worker lost (retried), as any process
        # killed by the kernel is.
        memory_limit=0, **common,
    )
    if adapt is not None:
        adapt.apply(cluster)
    client = Client(cluster, security=common.get("security"))
    client.register_plugin(WarmImports())
    log.info("started %d GPU workers on GPUs %s; dashboard %s", len(client.scheduler_info(
        n_workers=-1)["workers"]), gpus, client.dashboard_link)
    return ClusterHandle(client=client, cluster=cluster, kind="cuda", gpus=list(gpus))


def dask_cuda_missing(error: ImportError) -> str:
    """What to install when ``import dask_cuda`` failed with ``error``: dask-cuda itself, or
    the CUDA bindings it imports (``cuda.bindings``, from cuda-core's cu12/cu13 extra), named
    with the extra that matches this torch's CUDA version."""
    import torch

    major = (torch.version.cuda or "13").split(".")[0]
    missing = getattr(error, "name", None) or str(error)
    if missing.startswith("dask_cuda"):
        what = "dask-cuda is not installed"
    else:
        what = f"dask-cuda is installed but cannot import {missing!r} ({error})"
    return (f"{what}; GPU workers need it: pip install 'quantdask[gpu-cu{major}]' (dask-cuda "
            f"with the CUDA {major} bindings, matching torch's CUDA {torch.version.cuda})")
