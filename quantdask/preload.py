"""``dask worker --preload quantdask.preload``: what a worker sets up before it joins.

It advertises the worker's device memory in bytes as the Dask resource ``DEVICE_MEMORY``, so
that each job is placed only on a worker where it fits (see ``quantdask.plan.placement``): the
GPU's total memory (NVML, else torch); on a CPU slot with a Dask memory limit, what its nanny
lets jobs use, the terminate fraction of the limit less the worker's resting memory
(``process.slot_memory``), which it also reports as a worker metric for the driver's plan; on
one without a limit, the machine's memory. A worker started with ``--resources
GPU=1,DEVICE_MEMORY=<bytes>`` keeps the figure it was given. quantdask's own local clusters load
this preload themselves.
"""

from __future__ import annotations

import logging

from quantdask.sweepfile.sweep import DEVICE_MEMORY

log = logging.getLogger("quantdask.preload")


def device_memory_bytes(worker) -> int:
    """The memory of this worker's device: its first visible GPU; else what its memory limit
    offers jobs (and the worker reports its figures as the ``slot_memory.METRIC`` metric);
    else the machine's memory."""
    import torch

    if torch.cuda.is_available():
        from quantdask.process.devices import cuda_probe

        try:
            return int(cuda_probe(0).sample()["memory_total_bytes"])
        except Exception:  # noqa: BLE001 - no NVML here: ask CUDA (this initializes it)
            return int(torch.cuda.get_device_properties(0).total_memory)
    import psutil

    limit = worker.memory_manager.memory_limit
    if not limit:
        return int(psutil.virtual_memory().total)
    from quantdask.process.slot_memory import METRIC, slot_memory

    slot = slot_memory(int(limit))
    worker.metrics[METRIC] = lambda _worker: slot.as_metric()
    return slot.offered


def dask_setup(worker) -> None:
    """Dask calls this in the worker before it registers with the scheduler."""
    from quantdask.process.slot_memory import freeze_startup_objects

    freeze_startup_objects()
    state = worker.state
    if DEVICE_MEMORY not in state.total_resources:
        memory = device_memory_bytes(worker)
        state.total_resources[DEVICE_MEMORY] = memory
        state.available_resources[DEVICE_MEMORY] = memory
    log.info("worker %s advertises %s=%.0f", worker.name, DEVICE_MEMORY,
             state.total_resources[DEVICE_MEMORY])
