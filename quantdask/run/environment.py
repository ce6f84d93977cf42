"""A session's environment rows: the driver's and every worker's (``process.environment``),
captured as the session starts, so a run resumed after an upgrade records both."""

from __future__ import annotations

from quantdask.process.environment import capture_environment
from quantdask.records import EnvironmentRow
from quantdask.store.run_store import RunStore
from quantdask.util import utcnow

DRIVER = "driver"
"""The environment frame's ``process`` of the driver's rows (a worker's: its address)."""


def record_environment(store: RunStore, run_id: str, client) -> list[EnvironmentRow]:
    """Capture the driver's environment and each of ``client``'s workers', and write them as
    the session's file of the environment frame. A worker that cannot say records why."""
    now = utcnow()
    found: dict[str, dict[str, str]] = {DRIVER: capture_environment()}
    for worker, env in client.run(capture_environment, on_error="return").items():
        found[worker] = (env if isinstance(env, dict)
                         else {"capture_error": f"{type(env).__name__}: {env}"})
    rows = [EnvironmentRow(run_id=run_id, process=process, captured_at=now,
                           component=component, value=value)
            for process, env in found.items() for component, value in env.items()]
    store.write_rows("environment", run_id, rows)
    return rows
