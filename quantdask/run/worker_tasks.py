"""The driver's side of the run's time account: each task other than a job's attempt that a
worker ran for this session (a model's reference, a search's probes), recorded as its worker
tells it ended (``process.runtime.worker_task``), in the worker_tasks frame. The attempts frame
holds the jobs' tries; together they are every second the run kept a worker busy."""

from __future__ import annotations

import datetime as dt
import logging
import re

from quantdask.records import WorkerTaskRow
from quantdask.run import LOG_CHANNEL
from quantdask.store.run_store import RunStore
from quantdask.words import Status

log = logging.getLogger(LOG_CHANNEL)
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")  # a Dask key as a file name


class WorkerTaskLog:
    """Records the tasks of session ``run_id`` as their ends arrive (``on_event``, on the
    client's event loop: one small file each). A task is this session's when its Dask key
    carries the session's id: the references' keys and the searches' tags do."""

    def __init__(self, store: RunStore, run_id: str):
        self.store, self.run_id = store, run_id

    def on_event(self, event) -> None:
        _, message = event
        key = str(message.get("key") or "")
        if self.run_id not in key:
            return  # another session's (two sweeps on one cluster), or no task's
        try:
            # One file per task, named by its key (a rerun of it writes a file of its own).
            self.store.write_rows("worker_tasks", _SAFE.sub("_", key), [row_of(self.run_id,
                                                                             message)])
        except Exception:  # a record lost must not stop the client's event loop
            log.exception("the time account of task %s was not recorded", key)


def row_of(run_id: str, message: dict) -> WorkerTaskRow:
    """The worker's end message of a task as its row."""

    def utc(seconds: float) -> dt.datetime:
        return dt.datetime.fromtimestamp(seconds, dt.UTC)

    error = message.get("error")
    return WorkerTaskRow(
        run_id=run_id, key=str(message["key"]), kind=str(message["kind"]),
        label=str(message["label"]), worker=str(message["name"]),
        device=str(message["device"]), started_at=utc(message["started"]),
        finished_at=utc(message["finished"]),
        status=Status.FAILED if error else Status.DONE, error_class=error)
