"""What the driver does to a running cluster's workers: list them, count their job slots, restart
a hung one, retire a failing one (never the last); and how many GPUs this machine has."""

from __future__ import annotations

import logging
import threading

from distributed import Client

log = logging.getLogger("quantdask.cluster")


def cuda_device_count() -> int:
    """How many CUDA GPUs this machine has (0 when torch has no CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def live_workers(client: Client) -> dict[str, str]:
    """The cluster's workers now: address -> name."""
    info = client.scheduler_info(n_workers=-1)["workers"]
    return {address: str(w["name"]) for address, w in info.items()}


def workers_elsewhere(client: Client) -> str | None:
    """What may put ``client``'s workers on other machines, in words (``the scheduler at
    tcp://...``); None when ``client`` was made from a ``LocalCluster`` of this process
    (``LocalCUDACluster`` is one), whose workers all run here.

    A scheduler reached by address counts, even at a loopback address (a tunnel, or workers
    that joined it from other machines), as ``quantdask run --scheduler`` always has; so does a
    cluster object that starts its workers elsewhere (SLURM, Kubernetes)."""
    from distributed import LocalCluster

    if isinstance(client.cluster, LocalCluster):
        return None
    if client.scheduler is None:
        raise RuntimeError("the Dask client is not connected to a scheduler")
    return f"the scheduler at {client.scheduler.address}"


def cluster_capacity(client: Client, jobs_per_gpu: int = 1) -> tuple[int, int]:
    """(workers, job slots) of the cluster now: a worker runs as many jobs at once as its
    ``GPU`` resource allows (``jobs_per_gpu`` per unit) and its threads take."""
    info = client.scheduler_info(n_workers=-1)["workers"].values()
    slots = sum(min(w.get("nthreads", 1), int(w.get("resources", {}).get("GPU", 0) * jobs_per_gpu))
                for w in info)
    return len(info), slots


def restart_worker(client: Client, address: str | None, wait: bool = True) -> None:
    """Replace a worker's process (a hung Python thread cannot be interrupted; only a new
    process frees its device). Dask removes a worker without a nanny; a slow restart goes on.

    ``wait=False`` restarts it from a thread of its own and returns at once: the driver keeps
    collecting results and enforcing deadlines while the worker comes back."""
    if not wait:
        threading.Thread(target=restart_worker, args=(client, address), daemon=True,
                         name=f"quantdask-restart-{address}").start()
        return
    if address is None:  # the attempt never reached a known worker: nothing to restart
        log.warning("restarting worker: its address is unknown")
        return
    try:
        status = client.restart_workers([address], timeout=120, raise_for_error=False)
    except Exception as error:  # noqa: BLE001 - the worker may be gone already
        status = {address: repr(error)}
    if status.get(address) != "OK":
        log.warning("restarting worker %s: %s", address, status.get(address))


def retire_worker(client: Client, name: str) -> bool:
    """Retire the worker called ``name`` for good, unless it is the last; True if retired."""
    workers = live_workers(client)
    addresses = [a for a, n in workers.items() if n == name]
    if len(workers) <= 1 or not addresses:
        return False
    client.retire_workers(addresses, close_workers=True)
    return True
