"""Idle cores lent to busy CPU slots: a job that computes while the other CPU slots of its
machine are idle uses their cores too, and gives them back when they start again.

Each CPU slot runs with its share of the cores (``cores / slots`` torch threads), because busy
slots that oversubscribe the cores fight: 2 slots x 2 threads on 2 cores made a sweep 1.5x
slower than 2 x 1. But a slot often computes alone: at a sweep's tail, while the others wait
for a reference, or when a sweep has fewer jobs than slots. Then its neighbours' cores idle
(a sweep's last job alone on 1 of 2 cores: about 20 s of a 2-minute sweep).

A running job marks itself busy with an empty file named by its process and thread in a
directory of the machine's temp dir, and between eval batches sets torch's threads to
``cores // busy jobs`` (never fewer than its own share). Marks of processes that died are
ignored and removed. Only CPU slots that quantdask started with their default threads lend
and borrow (:func:`share_cores`); an explicit ``torch_threads`` keeps a fixed count.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

BUSY_DIR = Path(tempfile.gettempdir()) / "quantdask-busy-cpu-slots"
"""Where running jobs of this machine's CPU slots mark themselves busy."""

_own_threads: int | None = None  # this slot's share; None: cores are not shared here
_marks = threading.local()  # the mark of the job running in this thread, if any


def share_cores(own_threads: int) -> None:
    """Let this process's jobs borrow idle cores; ``own_threads`` is its share when all the
    machine's slots are busy (the cluster's TorchThreads plugin calls this on CPU slots)."""
    global _own_threads
    _own_threads = own_threads
    BUSY_DIR.mkdir(parents=True, exist_ok=True)


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity: a cgroup or SLURM allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Mark the job running in this thread busy while the block runs, then give back what it
    borrowed. Does nothing where cores are not shared."""
    if _own_threads is None:
        yield
        return
    mark = BUSY_DIR / f"{os.getpid()}-{threading.get_ident()}"
    mark.touch()
    _marks.path = mark
    try:
        rebalance()
        yield
    finally:
        _marks.path = None
        mark.unlink(missing_ok=True)
        _set_threads(_own_threads)


def busy_jobs() -> int:
    """Jobs of this machine's CPU slots marked busy now (those of live processes)."""
    count = 0
    for mark in BUSY_DIR.iterdir():
        pid, _, _ = mark.name.partition("-")
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # a worker that died mid-job
            mark.unlink(missing_ok=True)
            continue
        except PermissionError:  # alive, another user's
            pass
        count += 1
    return count


def others_busy() -> bool:
    """Whether a job of another CPU slot of this machine is computing now (its cores are this
    one's too): False where cores are not shared, or nothing else is marked busy."""
    if _own_threads is None:
        return False
    mine = 1 if getattr(_marks, "path", None) is not None else 0
    try:
        return busy_jobs() > mine
    except OSError:  # the directory went away
        return False


def rebalance() -> None:
    """Take the cores idle slots leave (or give them back): call between steps of a job,
    inside :func:`busy`. Does nothing elsewhere."""
    if _own_threads is None or getattr(_marks, "path", None) is None:
        return
    try:
        busy_now = busy_jobs()
    except OSError:  # the directory went away: keep the own share
        busy_now = 0
    _set_threads(max(_own_threads, machine_cores() // max(1, busy_now)))


def _set_threads(threads: int) -> None:
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
