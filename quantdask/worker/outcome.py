"""What one attempt brings back to the driver, typed, and the words its outcome is said in.

``Status`` and ``FailureClass`` are the results' vocabulary (GUIDE's failure table), defined
here once and used by the worker, the driver, the store and the report: a typo is then an
``AttributeError``, never a silent new status. ``JobOutcome`` is the row an attempt adds to the
attempts and results frames, and beside it what is stored elsewhere (per-layer rows, the
worker's device samples, the attempt's log), so that no layer has to pop transport keys out of
a dict.

>>> Status.DONE == "done", f"{FailureClass.OUT_OF_MEMORY}"
(True, 'out_of_memory')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from quantdask.errors import JobTimeout
from quantdask.util import utcnow

if TYPE_CHECKING:
    from quantdask.worker.measure import PeakMemory


class Status(StrEnum):
    """How a job (or one attempt of it) ended."""

    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"  # unsupported here: recorded with the reason, never retried


ATTEMPT_CANCELLED = "cancelled"
"""How an attempt stopped by ``SweepHandle.cancel()`` ended: in the attempts frame only. Its
job has no result, so the next run of the sweep runs it."""


class FailureClass(StrEnum):
    """Why a job failed or was skipped, and so what the driver does about it (``retry``)."""

    UNSUPPORTED = "unsupported"
    OUT_OF_MEMORY = "out_of_memory"
    WORKER_LOST = "worker_lost"
    TIMEOUT = "timeout"
    JOB_ERROR = "job_error"


_ALLOCATION_FAILED = ("out of memory", "can't allocate memory", "cannot allocate memory")


def failure_class_of(error: BaseException) -> FailureClass:
    """``timeout`` for a deadline, ``out_of_memory`` for an allocation failure on any device,
    else ``job_error``.

    >>> failure_class_of(MemoryError()), failure_class_of(ValueError("bad"))
    (<FailureClass.OUT_OF_MEMORY: 'out_of_memory'>, <FailureClass.JOB_ERROR: 'job_error'>)
    """
    import torch

    if isinstance(error, JobTimeout):
        return FailureClass.TIMEOUT
    if isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)):
        return FailureClass.OUT_OF_MEMORY
    message = str(error).lower()
    if any(words in message for words in _ALLOCATION_FAILED):
        return FailureClass.OUT_OF_MEMORY
    return FailureClass.JOB_ERROR


def peak_columns(peak: PeakMemory) -> dict[str, Any]:
    """The results' peak-memory columns from a finished :class:`PeakMemory` block."""
    return {"peak_device_mem_bytes": peak.peak_device_bytes,
            "peak_device_reserved_bytes": peak.peak_reserved_bytes,
            "peak_host_rss_bytes": peak.peak_rss_bytes, "peak_shared": peak.shared}


@dataclass
class JobOutcome:
    """One attempt's outcome, made by ``run_job`` on a worker or by the driver when the attempt
    ended outside it (its worker lost, its deadline passed, no worker left).

    ``record`` holds the flat columns (``status``; the measurements when done; ``failure_class``,
    ``error_class``, ``error_message``, ``traceback`` when not; where and when it ran).
    """

    record: dict[str, Any]
    layers: list[dict[str, Any]] = field(default_factory=list)  # rows of the layers frame
    windows: list[dict[str, Any]] = field(default_factory=list)  # rows of the windows frame
    tasks: list[dict[str, Any]] = field(default_factory=list)  # rows of the tasks frame
    speed: list[dict[str, Any]] = field(default_factory=list)  # rows of the speed frame
    device_samples: list[dict[str, Any]] = field(default_factory=list)
    log: str = ""  # the attempt's own log lines (empty when it ended outside the job)

    @property
    def status(self) -> Status:
        return Status(self.record["status"])

    @property
    def failure_class(self) -> FailureClass | None:
        value = self.record.get("failure_class")
        return None if value is None else FailureClass(value)

    @classmethod
    def outside(cls, failure_class: FailureClass, error_class: str, message: str, tb: str = "",
                worker: str | None = None, status: Status = Status.FAILED) -> JobOutcome:
        """The outcome of an attempt that ended outside ``run_job``."""
        return cls({"status": status, "failure_class": failure_class,
                    "error_class": error_class, "error_message": message,
                    "traceback": tb or None, "finished_at": utcnow(), "worker": worker})
