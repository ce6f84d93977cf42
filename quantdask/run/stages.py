"""Work a capability runs on the cluster before a sweep's jobs, adding jobs of its own (a
mixed-precision search probes, allocates, then hands its verifying jobs to the sweep).

Each capability package registers its stage here when it is imported (``quantdask.search``
does, and ``import quantdask`` imports it); the driver's core reaches a stage only through
this list, never by importing the capability.

>>> register_stage(PreJobStage("search", wanted=lambda s: bool(s.searches),
...                            run=run_searches))  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Client

    from quantdask.run.progress import SweepProgress
    from quantdask.store.run_store import RunStore
    from quantdask.sweepfile.sweep import Job, Sweep


@dataclass
class StageWatch:
    """Who follows a stage while it runs: ``stop`` ends it early (a cancelled sweep),
    ``progress`` counts its work and ``tick()`` shows it (the sweep's driver). Its Dask keys
    carry ``run_id``, the session's: its tasks are that session's in the time account
    (``run.worker_tasks``)."""

    stop: threading.Event = field(default_factory=threading.Event)
    progress: SweepProgress | None = None
    tick: Callable[[], None] = lambda: None
    run_id: str = ""


StageRun = Callable[["Sweep", "RunStore", "Client", "list[Job]", StageWatch], "list[Job] | None"]
"""``run(sweep, store, client, placed, watch) -> jobs``: the stage's work on the cluster, given
the sweep's placed jobs; the jobs it adds, or None when ``watch.stop`` ended it early."""


@dataclass(frozen=True)
class PreJobStage:
    """A capability's work before the jobs: ``run`` when ``wanted(sweep)``. ``check(sweep)``
    raises a ``SpecError`` for what the sweep file and the models' files alone rule out; it
    runs before any cluster starts or anything is written (``run.sweep.refuse_early``)."""

    name: str
    wanted: Callable[[Sweep], bool]
    run: StageRun
    check: Callable[[Sweep], None] | None = None


_STAGES: dict[str, PreJobStage] = {}


def register_stage(stage: PreJobStage) -> PreJobStage:
    """Run ``stage`` before the jobs of every sweep that wants it (once per name)."""
    _STAGES[stage.name] = stage
    return stage


def stages_for(sweep: Sweep) -> list[PreJobStage]:
    """The registered stages ``sweep`` wants, in the order they were registered."""
    return [stage for stage in _STAGES.values() if stage.wanted(sweep)]
