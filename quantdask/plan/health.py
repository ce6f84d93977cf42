"""Which devices keep failing: a worker whose device fails different jobs that then run fine
elsewhere is taken out of rotation (GUIDE's failure handling)."""

from __future__ import annotations

from dataclasses import dataclass, field

from quantdask.words import FailureClass


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

    def failed(self, worker: str, job_id: str, failure_class: FailureClass) -> None:
        # Out of memory does not count: its retry gets more room, so success elsewhere would
        # prove nothing against this device.
        if failure_class == FailureClass.JOB_ERROR and worker not in self.excluded:
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
