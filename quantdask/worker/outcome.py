"""What one attempt brings back to the driver, typed: the row it adds to the attempts and
results frames, and beside it what is stored elsewhere (per-layer rows, the worker's device
samples, the attempt's log), so that no layer has to pop transport keys out of a dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantdask.util import utcnow


@dataclass
class JobOutcome:
    """One attempt's outcome, made by ``run_job`` on a worker or by the driver when the attempt
    ended outside it (its worker lost, its deadline passed, no worker left).

    ``record`` holds the flat columns (``status``; the measurements when done; ``failure_class``,
    ``error_class``, ``error_message``, ``traceback`` when not; where and when it ran).
    """

    record: dict[str, Any]
    layers: list[dict[str, Any]] = field(default_factory=list)  # rows of the layers frame
    device_samples: list[dict[str, Any]] = field(default_factory=list)
    log: str = ""  # the attempt's own log lines (empty when it ended outside the job)

    @property
    def status(self) -> str:
        return self.record["status"]

    @property
    def failure_class(self) -> str | None:
        return self.record.get("failure_class")

    @classmethod
    def outside(cls, failure_class: str, error_class: str, message: str, tb: str = "",
                worker: str | None = None, status: str = "failed") -> JobOutcome:
        """The outcome of an attempt that ended outside ``run_job``."""
        return cls({"status": status, "failure_class": failure_class,
                    "error_class": error_class, "error_message": message,
                    "traceback": tb or None, "finished_at": utcnow(), "worker": worker})
