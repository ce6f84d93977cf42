"""A worker process's side of the cluster: the plugins a cluster registers on each worker (torch
threads, warm imports), the start announcement that starts a task's deadline, the span of a
task told to the driver for the run's time account, the device a task runs on, and the library
notices that are noise in a job's log."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

from distributed.diagnostics.plugin import WorkerPlugin

from quantdask.process import library_noise
from quantdask.process.devices import physical_gpu_id
from quantdask.process.slot_memory import METRIC as SLOT_METRIC

JOB_START_TOPIC = "quantdask-job-start"
"""Dask event topic on which a worker announces that it began an attempt (for deadlines)."""


def announce_start(task: dict | None = None) -> tuple[str, str]:
    """Tell the driver the running task (a job attempt or a reference) began, so its deadline
    starts now; returns (worker name, host). ``task``: a worker task's kind, label and start
    (``worker_task``), with which the driver accounts for its time if its worker dies."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:  # not inside a Dask worker (a direct call, e.g. in a notebook)
        return "local", socket.gethostname()
    # The slot's memory figures ride along: a slot killed for memory has left the scheduler
    # by the time the driver asks what it offered.
    slot = worker.metrics.get(SLOT_METRIC)
    worker.log_event(JOB_START_TOPIC, {"key": worker.get_current_task(),
                                       "address": worker.address, "name": str(worker.name),
                                       "slot": slot(worker) if slot is not None else None,
                                       **({"device": torch_device()[1], **task} if task
                                          else {})})
    return str(worker.name), socket.gethostname()


TASK_END_TOPIC = "quantdask-task-end"
"""Dask event topic on which a worker tells the driver that a task other than a job's attempt
ended: its key, kind, label, worker, device, start, end and error (``worker_task``)."""


@contextlib.contextmanager
def worker_task(kind: str, label: str) -> Iterator[tuple[str, str]]:
    """Run a task other than a job's attempt (a reference's part, a search's probe: ``kind``,
    a ``words.WorkerTaskKind``; ``label``, its model): announced as it starts (its deadline
    starts), and as it ends, done or failed, its span told to the driver on
    ``TASK_END_TOPIC``, which records it in the run's time account (the worker_tasks frame; a
    job's attempt has its own record). Yields (worker name, host). Inside another (a
    search's reference computes a model's reference) it is that task's: nothing more is
    announced or told, so no second counts the same time twice."""
    if getattr(_running, "task", False):
        yield _worker_identity()
        return
    started, error = time.time(), None
    name, host = announce_start({"kind": str(kind), "label": str(label),
                                 "started": float(started)})
    _running.task = True
    try:
        yield name, host
    except BaseException as raised:
        error = type(raised).__name__
        raise
    finally:
        _running.task = False
        _tell_end(kind, label, started, error)


_running = threading.local()  # whether this thread runs a worker_task now


def _worker_identity() -> tuple[str, str]:
    try:
        from distributed import get_worker

        return str(get_worker().name), socket.gethostname()
    except ValueError:
        return "local", socket.gethostname()


def _tell_end(kind: str, label: str, started: float, error: str | None) -> None:
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:  # not inside a Dask worker: nothing to account for
        return
    # Plain values only (the event travels as msgpack: a StrEnum does not).
    worker.log_event(TASK_END_TOPIC, {
        "key": str(worker.get_current_task()), "kind": str(kind), "label": str(label),
        "name": str(worker.name), "device": torch_device()[1], "started": float(started),
        "finished": time.time(), "error": error})


def held_resources() -> dict[str, float]:
    """The resources Dask holds on this worker for the running task (``GPU``, device memory),
    as the scheduler granted them: {} outside a Dask worker."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        return {}
    task = worker.state.tasks.get(worker.get_current_task())
    return dict(task.resource_restrictions) if task is not None else {}


def torch_device() -> tuple[str, str, bool]:
    """(torch device, recorded device label with the physical GPU id, is CUDA)."""
    import torch

    if torch.cuda.is_available():
        return "cuda:0", f"cuda:{physical_gpu_id(0)}", True
    return "cpu", "cpu", False


def quiet_libraries() -> None:
    """Silence transformers' progress bars and notices, and the libraries' known notices
    (``library_noise``), in a job's log."""
    library_noise.quiet_notices()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


class TorchThreads(WorkerPlugin):
    """Caps torch's threads on each worker so that workers sharing a CPU do not fight over it;
    with ``share``, a job computing while other slots idle borrows their cores (see
    ``cpu_share``)."""

    name = "quantdask-torch-threads"

    def __init__(self, threads: int, share: bool = False):
        self.threads = threads
        self.share = share

    def setup(self, worker) -> None:
        import torch

        torch.set_num_threads(self.threads)
        if self.share:
            from quantdask.process.cpu_share import share_cores

            share_cores(self.threads)


class WarmImports(WorkerPlugin):
    """Imports the heavy libraries when a worker starts (as dask-cuda's ``pre_import`` does):
    otherwise each worker's first job pays seconds of imports, counted as its load time."""

    name = "quantdask-warm-imports"
    # transformers.modeling_utils is what loading any model imports first (about 1.2 s of
    # CPU: sympy, the quantizers); each architecture's own module is cheap after it.
    modules = ("torch", "transformers", "transformers.modeling_utils", "bitsandbytes")

    def setup(self, worker) -> None:
        from quantdask.util import import_offline

        if os.environ.get(library_noise.SHOW_ENV) != "1":
            quiet_libraries()  # before bitsandbytes' import-time notices
        for module in self.modules:
            try:
                import_offline(module)  # (bitsandbytes would fetch a kernel as it imports)
            except ImportError:  # an optional backend: its jobs are skipped with the reason
                pass
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401 (lazy)
