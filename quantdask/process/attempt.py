"""The start and end of a task on a worker, shared by a job's attempt and a model's reference.

Both announce that they began (the driver's deadline for them starts then), measure their own
elapsed time against the same deadline, quiet the libraries' notices, and tag the worker's
device samples with their key while they run. A job also keeps its own log lines.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from quantdask.process.devices import this_workers_sampler
from quantdask.process.live_log import LiveLog
from quantdask.process.runtime import announce_start, quiet_libraries, worker_task
from quantdask.process.slot_memory import release_memory
from quantdask.records import Row
from quantdask.util import heap_trimmed, utcnow


@dataclass
class AttemptScope:
    """Where and since when a task runs; ``samples`` are the worker's device samples taken
    while it ran (filled when the scope ends, if it takes them)."""

    key: str
    worker: str
    host: str
    began: float  # time.monotonic() at the start announcement
    started_at: Any  # the same moment, UTC
    samples: list[Row] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.monotonic() - self.began


@contextlib.contextmanager
def attempt_scope(key: str, take_samples: bool = True,
                  task: tuple[str, str] | None = None) -> Iterator[AttemptScope]:
    """Run a task under ``key``: announced, timed from now, libraries quieted, the device's
    samples tagged with ``key``. With ``take_samples`` False they stay on the worker (a
    reference's: the next job's record, or the sweep's end, takes them). A task other than a
    job's attempt names its (kind, label) in ``task``: its span goes into the run's time
    account (``runtime.worker_task``)."""
    import torch

    announced = (worker_task(*task) if task is not None
                 else contextlib.nullcontext(announce_start()))
    with announced as (worker, host):
        scope = AttemptScope(key, worker, host, time.monotonic(), utcnow())
        sampler = this_workers_sampler()
        if sampler is not None:  # mark the task's samples, and take one even if it is short
            sampler.job_started(key)
        try:
            quiet_libraries()
            # On a CPU slot the device is the host: its freed heap goes back while the task
            # runs, so the RSS the nanny counts follows what the task holds.
            with heap_trimmed if not torch.cuda.is_available() else contextlib.nullcontext():
                yield scope
        finally:
            release_memory()  # the task's garbage and freed heap are not the next task's
            if torch.cuda.is_available():
                with contextlib.suppress(Exception):  # a sticky CUDA error must not lose it
                    torch.cuda.empty_cache()
            if sampler is not None:
                scope.samples = sampler.job_finished(key, take=take_samples)


class ThisThread(logging.Filter):
    """Passes only the lines logged in the thread that made it. Jobs packed on one worker run
    in threads of one process and log on the same logger: each job's handlers take this
    filter, so each job's log holds its own lines only."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread == self.thread


@contextlib.contextmanager
def captured_log(logger: logging.Logger, prefix: str,
                 live: Callable[[str], None] | None = None) -> Iterator[io.StringIO]:
    """Copy what ``logger`` says in this thread into a buffer, each line with ``prefix``; with
    ``live``, send the same lines to it too, in batches while they are logged
    (``process.live_log``: the driver shows them in the job's log while the attempt runs)."""
    buffer = io.StringIO()
    handlers: list[logging.Handler] = [logging.StreamHandler(buffer)]
    if live is not None:
        handlers.append(LiveLog(live))
    only_this_thread = ThisThread()
    formatter = logging.Formatter(f"%(asctime)s %(levelname)s {prefix} %(message)s")
    for handler in handlers:
        handler.addFilter(only_this_thread)
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield buffer
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
            handler.close()  # the live one drops its pending lines: the whole log has them
