"""What to do after an attempt fails: its failure class decides (see GUIDE's failure table).

| class          | action                                                              |
|----------------|---------------------------------------------------------------------|
| unsupported    | recorded skipped with the reason; never retried                     |
| out_of_memory  | retried with more room: a whole GPU, half the eval batch, 2x memory |
| worker_lost    | retried at once (the dead worker is gone; another one takes it)     |
| timeout        | retried at once on a fresh worker (the hung one was restarted)      |
| job_error      | retried after an exponential backoff                                |

Every retry counts against the sweep's ``retries``; past it the job is recorded failed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from quantdask.spec.sweep import Job

MAX_BACKOFF_S = 300.0


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    delay_s: float = 0.0
    job: Job | None = None  # the job to run next (it may ask for more room)
    reason: str = ""


def decide(job: Job, attempt: int, failure_class: str, backoff_s: float) -> RetryDecision:
    """Whether and how to run ``job`` again after ``attempt`` failed as ``failure_class``."""
    if failure_class == "unsupported":
        return RetryDecision(False, reason="unsupported here; not retried")
    if attempt > job.retries:
        return RetryDecision(False, reason=f"no retries left ({job.retries} allowed)")
    if failure_class == "out_of_memory":
        roomier = with_more_room(job)
        more = (f" and {roomier.device_memory_bytes:,} bytes of device memory"
                if roomier.device_memory_bytes else "")
        return RetryDecision(True, 0.0, roomier, reason=(
            f"retrying with a whole device, eval batch {roomier.eval.batch_size}{more}"))
    if failure_class == "job_error":
        delay = min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S)
        return RetryDecision(True, delay, job, reason=f"retrying in {delay:g}s")
    return RetryDecision(True, 0.0, job, reason="retrying")


def with_more_room(job: Job) -> Job:
    """``job`` on a device of its own, evaluating half as many windows per forward pass, and
    asking for twice the device memory it was estimated to need (the driver caps that at the
    largest worker's)."""
    smaller = dataclasses.replace(job.eval, batch_size=max(1, job.eval.batch_size // 2))
    return dataclasses.replace(job, gpu_share=1.0, eval=smaller,
                               device_memory_bytes=2 * job.device_memory_bytes)


@dataclass
class DeviceHealth:
    """Takes a device out of rotation when it failed ``limit`` different jobs in a row and those
    jobs then ran fine on other devices: the evidence points at the device, not at the jobs (a
    config that fails everywhere retires nobody).

    Only job errors count; a done job on the device clears its record. The scheduler sends a
    failed job's retry to other workers where it can, which is also what gathers the evidence.
    """

    limit: int = 3
    streaks: dict[str, list[str]] = field(default_factory=dict)
    cleared_elsewhere: dict[str, set[str]] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)

    def failed(self, worker: str, job_id: str, failure_class: str) -> None:
        # Out of memory does not count: its retry gets more room, so success elsewhere would
        # prove nothing against this device.
        if failure_class == "job_error" and worker not in self.excluded:
            streak = self.streaks.setdefault(worker, [])
            if job_id not in streak:
                streak.append(job_id)

    def succeeded(self, worker: str, job_id: str) -> list[str]:
        """Note a done job; returns the workers that this proves bad (newly excluded)."""
        self.streaks.pop(worker, None)
        self.cleared_elsewhere.pop(worker, None)
        newly = []
        for other, streak in self.streaks.items():
            if job_id in streak and other not in self.excluded:
                cleared = self.cleared_elsewhere.setdefault(other, set())
                cleared.add(job_id)
                if len(cleared) >= self.limit:
                    self.excluded[other] = (
                        f"failed {len(streak)} different jobs in a row, {len(cleared)} of which "
                        f"then ran fine elsewhere: {', '.join(sorted(cleared))}")
                    newly.append(other)
        return newly
