"""What to do after an attempt fails: its failure class decides (see GUIDE's failure table),
and the retries that wait out their backoff.

| class          | action                                                              |
|----------------|---------------------------------------------------------------------|
| unsupported    | recorded skipped with the reason; never retried                     |
| out_of_memory  | retried with more room: a whole GPU, half the eval batch, 2x memory |
|                | (killed by its nanny: only on a worker that offers more, else final) |
| worker_lost    | retried at once (the dead worker is gone; another one takes it)     |
| timeout        | retried at once on a fresh worker (the hung one was restarted)      |
| job_error      | retried after an exponential backoff                                |

Every retry counts against the sweep's ``retries``; past it the job is recorded failed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from quantdask.plan.memory_kills import MemoryKill
from quantdask.sweepfile.sweep import Job
from quantdask.util import format_bytes
from quantdask.words import FailureClass

MAX_BACKOFF_S = 300.0


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    delay_s: float = 0.0
    job: Job | None = None  # the job to run next (it may ask for more room)
    reason: str = ""


def decide(job: Job, attempt: int, failure_class: FailureClass,
           backoff_s: float) -> RetryDecision:
    """Whether and how to run ``job`` again after ``attempt`` failed as ``failure_class``."""
    decision = by_class(attempt, job.retries, failure_class, backoff_s)
    if not decision.retry:
        return decision
    if failure_class == FailureClass.OUT_OF_MEMORY:
        roomier = with_more_room(job)
        more = (f" and {roomier.device_memory_bytes:,} bytes of device memory"
                if roomier.device_memory_bytes else "")
        return RetryDecision(True, 0.0, roomier, reason=(
            f"retrying with a whole device, eval batch {roomier.eval.batch_size}{more}"))
    return dataclasses.replace(decision, job=job)


def by_class(attempt: int, retries: int, failure_class: FailureClass,
             backoff_s: float) -> RetryDecision:
    """The table's decision for any task allowed ``retries`` retries (a job, a search's
    probe) after its ``attempt`` failed as ``failure_class``; what runs next is the caller's
    (more room after ``out_of_memory``).

    >>> by_class(1, 2, FailureClass.JOB_ERROR, 2.0).delay_s, by_class(3, 2,
    ...     FailureClass.WORKER_LOST, 2.0).reason
    (2.0, 'no retries left (2 allowed)')
    """
    if failure_class == FailureClass.UNSUPPORTED:
        return RetryDecision(False, reason="unsupported here; not retried")
    if attempt > retries:
        return RetryDecision(False, reason=f"no retries left ({retries} allowed)")
    if failure_class == FailureClass.JOB_ERROR:
        delay = min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
        return RetryDecision(True, delay, reason=f"retrying in {delay:g}s")
    return RetryDecision(True, 0.0, reason="retrying")


def after_failure(job: Job, number: int, failure_class: FailureClass, backoff_s: float,
                  final: bool, kill: MemoryKill | None = None,
                  room: float = 0.0) -> RetryDecision:
    """What follows failed attempt ``number``: a retry (see ``decide``; for one its nanny
    killed for memory, ``kill``: ``after_memory_kill``, with ``room``, the most a worker
    offers), unless the attempt was settled ``final`` (no worker left for it)."""
    if final:
        return RetryDecision(False, reason="not retried: no worker left")
    if kill is not None:
        return after_memory_kill(job, number, kill, room)
    return decide(job, number, failure_class, backoff_s)


def with_more_room(job: Job) -> Job:
    """``job`` on a device of its own, evaluating half as many windows (and task requests) per
    forward pass, and asking for twice the device memory it was estimated to need (the driver
    caps that at the largest worker's). Batch sizes are not part of the job's id; a method
    whose figures depend on them (``BackendOptions.batch_dependent``: LLM.int8) keeps its
    own, or its retry would measure something else."""
    more = dataclasses.replace(job, gpu_share=1.0,
                               device_memory_bytes=2 * job.device_memory_bytes)
    if job.options.batch_dependent():
        return more
    smaller = dataclasses.replace(job.eval, batch_size=max(1, job.eval.batch_size // 2))
    tasks = job.tasks and dataclasses.replace(job.tasks,
                                              batch_size=max(1, job.tasks.batch_size // 2))
    return dataclasses.replace(more, eval=smaller, tasks=tasks)


def after_memory_kill(job: Job, number: int, kill: MemoryKill, room: float) -> RetryDecision:
    """What follows attempt ``number`` of ``job``, which its worker's nanny killed for memory:
    a retry alone (``with_more_room``) that only a worker offering more than the killed one
    can take (``room``: the most any live worker offers), while retries are left; else none,
    and the record keeps the limit, the peak reached and the fix (``MemoryKill.message``)."""
    decision = by_class(number, job.retries, FailureClass.OUT_OF_MEMORY, 0.0)
    if not decision.retry:
        return decision
    offered = kill.slot.offered if kill.slot is not None else 0
    if room <= offered:
        return RetryDecision(False, reason=f"not retried: no worker offers more than the "
                                           f"{format_bytes(offered)} its slot offered")
    roomier = with_more_room(job)
    need = int(min(room, max(roomier.device_memory_bytes, offered + 1)))
    roomier = dataclasses.replace(roomier, device_memory_bytes=need)
    return RetryDecision(True, 0.0, roomier, reason=(
        f"retrying alone on a worker that offers more than {format_bytes(offered)}: eval "
        f"batch {roomier.eval.batch_size} and {need:,} bytes of device memory"))


@dataclass(frozen=True)
class DelayedRetry:
    """A failed attempt's successor, waiting out its backoff until ``due``."""

    due: float
    job: Job
    attempt: int  # the number of the attempt to make
    failed_on: str | None  # the worker the last attempt failed on (the retry avoids it)


@dataclass
class RetryQueue:
    """Retries waiting for their backoff (see ``decide`` for the delays)."""

    waiting: list[DelayedRetry] = field(default_factory=list)

    def add(self, now: float, delay_s: float, job: Job, attempt: int,
            failed_on: str | None) -> None:
        self.waiting.append(DelayedRetry(now + delay_s, job, attempt, failed_on))

    def pop_due(self, now: float) -> list[DelayedRetry]:
        """The retries whose backoff is over, no longer waiting."""
        due = [r for r in self.waiting if r.due <= now]
        self.waiting = [r for r in self.waiting if r.due > now]
        return due

    def take_all(self) -> list[DelayedRetry]:
        taken, self.waiting = self.waiting, []
        return taken

    def __len__(self) -> int:
        return len(self.waiting)
