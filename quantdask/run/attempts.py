"""The attempts a sweep has submitted and not yet settled.

The client's event-loop thread notes when an attempt starts while the driver's loop takes
attempts out, so the table holds one lock for both and hands out what it took: nothing is
settled twice.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from quantdask.sweepfile.sweep import Job
from quantdask.util import utcnow


@dataclass
class Attempt:
    """One try of a job, under the Dask key it was submitted with."""

    job: Job
    number: int
    queued_at: dt.datetime
    key: str
    started: float | None = None  # driver's monotonic clock when the worker began it
    started_at: dt.datetime | None = None
    worker_address: str | None = None
    worker_name: str | None = None
    restricted_to: list[str] = field(default_factory=list)  # worker addresses it may run on
    reference_key: str = ""  # the Dask key of the reference it depends on

    @classmethod
    def unsubmitted(cls, job: Job, number: int) -> Attempt:
        """An attempt that never reached a worker (parked on its reference, or a delayed
        retry), to be settled as failed."""
        return cls(job, number, utcnow(), job.id)


class AttemptTable:
    """Submitted attempts by Dask key, with one ``take`` for every way the driver settles them.
    ``tag`` (the driver session's id) is part of every key it makes."""

    def __init__(self, tag: str = ""):
        self._by_key: dict[str, Attempt] = {}
        self._lock = threading.Lock()
        self._submissions = 0
        self._tag = tag

    def new_key(self, job_id: str) -> str:
        """The Dask key for a new attempt of ``job_id``: the job id, this driver session's tag
        and a count. A Dask key names one computation, for every client of the scheduler
        and for as long as the scheduler holds it: a key used before (a retry, an earlier
        sweep of the same job, another client's) would hand back that earlier result without
        running anything."""
        with self._lock:
            self._submissions += 1
            return f"{job_id}-{self._tag}-{self._submissions}".replace("--", "-")

    def add(self, attempt: Attempt) -> None:
        with self._lock:
            self._by_key[attempt.key] = attempt

    def pop(self, key: str) -> Attempt | None:
        """The attempt under ``key``, taken out (None if it was settled already)."""
        with self._lock:
            return self._by_key.pop(key, None)

    def get(self, key: str) -> Attempt | None:
        """The attempt under ``key``, left in (None if it was settled already)."""
        with self._lock:
            return self._by_key.get(key)

    def take(self, select: Callable[[dict[str, Attempt]], Iterable[str]]
             ) -> list[tuple[str, Attempt]]:
        """Take out the attempts whose keys ``select`` picks from the table as it is now."""
        with self._lock:
            keys = list(select(dict(self._by_key)))
            return [(key, self._by_key.pop(key)) for key in keys if key in self._by_key]

    def take_all(self) -> list[tuple[str, Attempt]]:
        return self.take(list)  # every key

    def waiting(self) -> dict[str, Attempt]:
        """The attempts no worker has begun yet (a copy)."""
        with self._lock:
            return {k: a for k, a in self._by_key.items() if a.started is None}

    def note_start(self, key: str, now: float, address: str, name: str) -> Attempt | None:
        """Note that a worker began ``key``; None if it is no attempt of this table."""
        with self._lock:
            attempt = self._by_key.get(key)
            if attempt is not None:
                attempt.started = now
                attempt.started_at = utcnow()
                attempt.worker_address = address
                attempt.worker_name = name
            return attempt


def label(job: Job) -> str:
    """How progress and logs name a job: model and config."""
    return f"{job.model.label} {job.config_label}"

