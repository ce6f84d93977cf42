"""Faults a sweep injects on purpose (``faults:`` in a sweep file), to rehearse what the driver
does when an attempt raises, runs out of memory, loses its worker, hangs, or is merely slow."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

from quantdask.words import FaultKind

if TYPE_CHECKING:
    from quantdask.sweepfile.sweep import Job

log = logging.getLogger("quantdask.job")  # into the attempt's own log

SLOW_FAULT_S = 1.5
"""How much longer a ``slow`` fault makes an attempt (before it quantizes)."""


def inject_faults(job: Job, attempt: int) -> None:
    """Make ``attempt`` of ``job`` fail the way its faults for that attempt say."""
    for fault_attempt, kind in job.faults:
        if fault_attempt == attempt:
            inject_fault(kind, attempt)


def inject_fault(kind: FaultKind, attempt: int) -> None:
    """Make this attempt fail the way ``kind`` says (see ``words.FaultKind``); ``slow`` only
    delays it: a job that is surely still running a second after it began (to rehearse a
    worker lost mid-job or to watch one run), at no cost in CPU."""
    import torch

    log.warning("injecting fault %r on attempt %d", str(kind), attempt)
    if kind == FaultKind.SLOW:
        time.sleep(SLOW_FAULT_S)
    if kind == FaultKind.RAISE:
        raise RuntimeError(f"injected fault on attempt {attempt}")
    if kind == FaultKind.OOM:
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected on attempt {attempt})")
    if kind == FaultKind.KILL:
        # A crash in mid-job: the worker's start announcement has left before it dies (one
        # lost at once would make the job look never started, and it would be requeued).
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == FaultKind.HANG:
        while True:  # only the scheduler's deadline (a worker restart) ends this
            time.sleep(60)
    if kind == FaultKind.MEMORY:
        _grow_until_restarted()


def _grow_until_restarted(step: int = 32 * 2**20, every_s: float = 0.1) -> None:
    """Hold ``step`` more bytes of host memory every ``every_s`` seconds until the nanny
    restarts the worker past its memory limit (its own event says so: the job is recorded
    ``out_of_memory``). Refused on a worker without a limit: this would fill the machine."""
    import torch
    from distributed import get_worker

    if not get_worker().memory_manager.memory_limit:
        raise RuntimeError("the memory fault needs workers with a memory limit "
                           "(start_cluster(memory_limit=...))")
    held = []
    while True:
        held.append(torch.ones(step // 4))  # written, so resident
        time.sleep(every_s)
