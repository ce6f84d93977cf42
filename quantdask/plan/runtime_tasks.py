"""A tasks block asking a config whose runtime is its own (``OwnRuntime``: GGUF in llama.cpp)
for a task that runtime cannot score, refused before anything runs: the tasks' configs come
from lm-eval's index (no dataset is read), the reason from the runtime's ``task_refusal``.

>>> check_runtime_tasks(qd.expand_grid(qd.load_sweep("sweep.yaml")))  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantdask.backends import get_backend
from quantdask.backends.capabilities import OwnRuntime
from quantdask.errors import SpecError

if TYPE_CHECKING:
    from quantdask.sweepfile.sweep import Job


def check_runtime_tasks(jobs: list[Job]) -> None:
    """Raise :class:`SpecError` (field ``tasks.names``) for the first task of a job's tasks
    block that its backend's own runtime cannot score, naming the task, the config and the
    reason, with the fixes."""
    checked: set[tuple[str, int]] = set()
    for job in jobs:
        runtime = get_backend(job.backend).has(OwnRuntime)
        if job.tasks is None or runtime is None or runtime.task_refusal is None:
            continue
        if (job.backend, id(job.tasks)) in checked:
            continue
        checked.add((job.backend, id(job.tasks)))
        for name, config in job.tasks.task_configs().items():
            why = runtime.task_refusal(config)
            if why is not None:
                raise SpecError(
                    "tasks.names",
                    f"{job.config_label} ({job.backend}) scores its tasks in "
                    f"{runtime.runtime}, which cannot score the task {name!r}: {why}; drop "
                    f"{name!r} from the tasks block, or leave {job.backend} configs out of "
                    "this sweep (every torch backend scores it)")
