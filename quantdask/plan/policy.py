"""The sweep driver's decisions, kept pure: what an attempt that ended without a result counts
as (and whether it is requeued uncounted), and everything that depends on time (each such
function takes ``now``, a reading of the driver's monotonic clock); ``loop`` does the Dask and
disk I/O, ``retry`` decides what follows a failure and ``health`` which devices to retire.

The split follows distributed's ``deploy/adaptive_core.py`` (decisions) beside ``adaptive.py``
(I/O), so the policy is tested with a fake clock, no cluster and no sleeps.

>>> grace = Grace(grace_s=120)
>>> grace.overdue({"job-a"}, now=0.0), grace.overdue({"job-a"}, now=120.0)
(set(), {'job-a'})
"""

from __future__ import annotations

import traceback
from collections.abc import Iterable, Mapping
from concurrent.futures import CancelledError
from dataclasses import dataclass, field

from distributed.scheduler import KilledWorker

from quantdask.errors import UnsupportedHere
from quantdask.job.outcome import JobOutcome, failure_class_of
from quantdask.sweepfile.sweep import Job
from quantdask.words import FailureClass, Status


def past_deadline(running: Mapping[str, tuple[float, float]], now: float) -> list[str]:
    """The keys of ``running`` (key -> (started, timeout_s)) that have run past their deadline.

    >>> past_deadline({"a": (0.0, 30.0), "b": (0.0, 60.0)}, now=31.0)
    ['a']
    """
    return [key for key, (started, timeout_s) in running.items() if now - started > timeout_s]


def stranded(waiting: Mapping[str, Iterable[str]], alive: set[str]) -> list[str]:
    """Waiting attempts (key -> the worker addresses they may run on, none = any) whose allowed
    workers are all gone: Dask would hold them forever.

    >>> stranded({"a": ["tcp://w1"], "b": [], "c": ["tcp://w1", "tcp://w2"]}, {"tcp://w2"})
    ['a']
    """
    return [key for key, allowed in waiting.items()
            if allowed and not alive.intersection(allowed)]


@dataclass
class Grace:
    """Since when each key has been in some bad state (no worker has room for it, say):
    ``overdue(keys_in_state, now)`` returns those in it for ``grace_s`` or longer. A key that
    leaves the state and comes back starts its grace afresh."""

    grace_s: float
    since: dict[str, float] = field(default_factory=dict)

    def overdue(self, keys: Iterable[str], now: float) -> set[str]:
        self.since = {key: self.since.get(key, now) for key in keys}
        return {key for key, since in self.since.items() if now - since >= self.grace_s}


@dataclass
class WorkerWatch:
    """Whether the cluster is gone: it had workers and has had none for ``grace_s``.

    A cluster that never had one yet (a SLURM queue, adaptive scaling from zero) is waited for.
    """

    grace_s: float
    seen_workers: bool = False
    none_since: float | None = None

    def observe(self, alive: int, now: float) -> None:
        """Note how many workers are alive now."""
        self.seen_workers = self.seen_workers or alive > 0
        if alive or not self.seen_workers:
            self.none_since = None
        elif self.none_since is None:
            self.none_since = now

    def gone(self, now: float) -> bool:
        return self.none_since is not None and now - self.none_since >= self.grace_s


def requeue_uncounted(lost: bool, cut: bool, started: bool, cancelled: bool,
                      requeues: int, max_requeues: int) -> bool:
    """Whether an attempt that ended without a result is put back in the queue without
    counting it: its worker (or its reference's) died before the attempt began, or the
    scheduler dropped it (a cancellation quantdask did not make). Never for a reference
    quantdask cut at its deadline, and at most ``max_requeues`` times per job."""
    dropped = cancelled or not started
    return lost and not cut and dropped and requeues < max_requeues


@dataclass
class Requeues:
    """How often each job was put back in the queue uncounted (see ``requeue_uncounted``).

    >>> requeues = Requeues(max_requeues=1)
    >>> [requeues.take("a", lost=True, cut=False, started=False, cancelled=False)
    ...  for _ in range(2)]
    [True, False]
    """

    max_requeues: int
    counts: dict[str, int] = field(default_factory=dict)

    def take(self, job_id: str, *, lost: bool, cut: bool, started: bool,
             cancelled: bool) -> bool:
        """Whether ``job_id``'s attempt is requeued uncounted; counts it when it is."""
        requeue = requeue_uncounted(lost, cut, started, cancelled,
                                    self.counts.get(job_id, 0), self.max_requeues)
        if requeue:
            self.counts[job_id] = self.counts.get(job_id, 0) + 1
        return requeue


def worker_went_away(error: BaseException) -> bool:
    """Whether a future ended in ``error`` because its worker died or the scheduler dropped it
    (Dask says so with these errors), rather than because the job raised."""
    return isinstance(error, (KilledWorker, CancelledError)) \
        or "CommClosed" in type(error).__name__


def outcome_of_error(error: BaseException, job: Job, *, lost: bool, cut: bool,
                     in_reference: bool, worker: str | None) -> JobOutcome:
    """The outcome of an attempt whose future ended in ``error`` instead of a ``JobOutcome``
    (and was not requeued): ``lost`` its worker, its model's reference ``cut`` at its deadline,
    or the error raised ``in_reference`` (each of the model's jobs records one failed attempt).

    >>> outcome_of_error(UnsupportedHere("no kernel"), None, lost=False, cut=False,
    ...                  in_reference=False, worker="w1").status
    <Status.SKIPPED: 'skipped'>
    """
    if cut:
        return JobOutcome.outside(
            FailureClass.TIMEOUT, "JobTimeout", f"its model's reference (eval windows and baseline "
            f"log-probs) ran past timeout_s={job.timeout_s:g}s; its worker was restarted",
            worker=worker)
    if isinstance(error, UnsupportedHere):
        return JobOutcome.outside(FailureClass.UNSUPPORTED, type(error).__name__, str(error),
                                  worker=worker, status=Status.SKIPPED)
    where = "in its model's reference: " if in_reference else ""
    return JobOutcome.outside(
        FailureClass.WORKER_LOST if lost else failure_class_of(error), type(error).__name__,
        where + (str(error) or type(error).__name__),
        "".join(traceback.format_exception(error)), worker=worker)
