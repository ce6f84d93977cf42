"""``dask worker --preload quantdask.preload``: what a worker sets up before it joins.

It advertises the worker's device memory in bytes as the Dask resource ``DEVICE_MEMORY``, so
that each job is placed only on a worker where it fits (see ``quantdask.plan.placement``): the
GPU's
total memory (NVML, else torch), or on a CPU slot the worker's memory limit. A worker started
with ``--resources GPU=1,DEVICE_MEMORY=<bytes>`` keeps the figure it was given. quantdask's own
local clusters load this preload themselves.
"""

from __future__ import annotations

import logging

from quantdask.sweepfile.sweep import DEVICE_MEMORY

log = logging.getLogger("quantdask.preload")


def device_memory_bytes(worker) -> int:
    """The memory of this worker's device: its first visible GPU, else its memory limit."""
    import torch

    if torch.cuda.is_available():
        from quantdask.process.devices import cuda_probe

        try:
            return int(cuda_probe(0).sample()["memory_total_bytes"])
        except Exception:  # noqa: BLE001 - no NVML here: ask CUDA (this initializes it)
            return int(torch.cuda.get_device_properties(0).total_memory)
    import psutil

    return int(worker.memory_manager.memory_limit or psutil.virtual_memory().total)


def dask_setup(worker) -> None:
    """Dask calls this in the worker before it registers with the scheduler."""
    state = worker.state
    if DEVICE_MEMORY not in state.total_resources:
        memory = device_memory_bytes(worker)
        state.total_resources[DEVICE_MEMORY] = memory
        state.available_resources[DEVICE_MEMORY] = memory
    log.info("worker %s advertises %s=%.0f", worker.name, DEVICE_MEMORY,
             state.total_resources[DEVICE_MEMORY])
