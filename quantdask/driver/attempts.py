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

from quantdask.spec.sweep import Job
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


_plain_keys_lock = threading.Lock()
_plain_keys: set[str] = set()  # job ids some table of this process used as a key


class AttemptTable:
    """Submitted attempts by Dask key, with one ``take`` for every way the driver settles them.
    ``tag`` (the driver session's id) names the attempts of a job another sweep of this
    process keys too."""

    def __init__(self, tag: str = ""):
        self._by_key: dict[str, Attempt] = {}
        self._lock = threading.Lock()
        self._submissions = 0
        self._keyed: set[str] = set()  # job ids that have had a key
        self._plain: set[str] = set()  # those keyed by their id alone
        self._tag = tag

    def new_key(self, job_id: str) -> str:
        """The Dask key for a new attempt of ``job_id``: the job id for its first, then the job
        id and a count. A Dask key names one computation: each resubmission needs a key of its
        own, or Dask hands back the earlier (failed) result; and so does the same job in two
        sweeps running at once on one client (the second's carries its tag), or cancelling one
        would cancel the other's."""
        with self._lock, _plain_keys_lock:
            self._submissions += 1
            if job_id not in self._keyed and job_id not in _plain_keys:
                key = job_id
                _plain_keys.add(job_id)
                self._plain.add(job_id)
            else:
                key = f"{job_id}-{self._tag}-{self._submissions}".replace("--", "-")
            self._keyed.add(job_id)
            return key

    def forget_keys(self) -> None:
        """Let later sweeps key this one's jobs by their ids again (at its end)."""
        with self._lock, _plain_keys_lock:
            _plain_keys.difference_update(self._plain)
            self._plain.clear()

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

