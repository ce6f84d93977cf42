"""The driver's side of the run's time account: each task other than a job's attempt that a
worker ran for this session (a model's reference, a search's probes), recorded as its worker
tells it ended (``process.runtime.worker_task``), in the worker_tasks frame. The attempts frame
holds the jobs' tries; together they are every second the run kept a worker busy.

A task whose worker dies tells no end. Its start was told (with its kind, label and start
time), so it is recorded as ``lost`` once the driver sees its worker gone from the scheduler
(polled every :data:`LOST_POLL_S` while such a task runs, and once as the session ends): its
span is from the start it told to then, within a poll of the scheduler's view."""

from __future__ import annotations

import datetime as dt
import logging
import re
import threading
import time

from quantdask.records import WorkerTaskRow
from quantdask.run import LOG_CHANNEL
from quantdask.store.run_store import RunStore
from quantdask.words import WorkerTaskEnd

log = logging.getLogger(LOG_CHANNEL)
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")  # a Dask key as a file name

LOST_POLL_S = 1.0
"""How often the driver looks for the workers of running tasks, while any runs."""


class WorkerTaskLog:
    """Records the tasks of session ``run_id`` as their ends arrive (``on_event``, on the
    client's event loop: one small file each), and those lost with their workers (``on_start``
    notes each start; :meth:`watch` looks for their workers). A task is this session's when its
    Dask key carries the session's id: the references' keys and the searches' tags do."""

    def __init__(self, store: RunStore, run_id: str):
        self.store, self.run_id = store, run_id
        self._running: dict[str, dict] = {}  # key -> its start message
        self._lock = threading.Lock()

    def on_start(self, event) -> None:
        """A task's start (``JOB_START_TOPIC``): a worker task's is kept until its end."""
        _, message = event
        key = str(message.get("key") or "")
        if self.run_id in key and "kind" in message:  # (a job's attempt has its own record)
            with self._lock:
                self._running[key] = dict(message)

    def on_event(self, event) -> None:
        _, message = event
        key = str(message.get("key") or "")
        if self.run_id not in key:
            return  # another session's (two sweeps on one cluster), or no task's
        with self._lock:
            self._running.pop(key, None)
        self._write(key, row_of(self.run_id, message))

    def reap(self, alive: set[str], now: float | None = None) -> list[str]:
        """Record as lost every running task whose worker (by address) is not in ``alive``,
        ended ``now``; the keys recorded."""
        now = time.time() if now is None else now
        with self._lock:
            gone = {k: m for k, m in self._running.items() if m.get("address") not in alive}
            for key in gone:
                del self._running[key]
        for key, message in gone.items():
            log.warning("task %s was lost with its worker %s: its %.1f s are in the time "
                        "account as lost", key, message.get("name"),
                        now - float(message["started"]))
            self._write(key, lost_row(self.run_id, message, now))
        return list(gone)

    def watch(self, alive, stop: threading.Event) -> threading.Thread:
        """A thread calling :meth:`reap` with ``alive()`` (the scheduler's worker addresses)
        every :data:`LOST_POLL_S` while a task runs, until ``stop``; then once more."""
        def loop() -> None:
            while not stop.wait(LOST_POLL_S):
                if self._running:
                    self._reap_safely(alive)
            if self._running:
                self._reap_safely(alive)

        thread = threading.Thread(target=loop, name="quantdask-lost-tasks", daemon=True)
        thread.start()
        return thread

    def _reap_safely(self, alive) -> None:
        try:
            self.reap(set(alive()))
        except Exception:  # the scheduler gone at the end: nothing more to learn
            log.debug("could not look for the workers of running tasks", exc_info=True)

    def _write(self, key: str, row: WorkerTaskRow) -> None:
        try:
            # One file per task, named by its key (a rerun of it writes a file of its own).
            self.store.write_rows("worker_tasks", _SAFE.sub("_", key), [row])
        except Exception:  # a record lost must not stop the client's event loop
            log.exception("the time account of task %s was not recorded", key)


def _utc(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


def row_of(run_id: str, message: dict) -> WorkerTaskRow:
    """The worker's end message of a task as its row."""
    error = message.get("error")
    return WorkerTaskRow(
        run_id=run_id, key=str(message["key"]), kind=str(message["kind"]),
        label=str(message["label"]), worker=str(message["name"]),
        device=str(message["device"]), started_at=_utc(message["started"]),
        finished_at=_utc(message["finished"]),
        status=WorkerTaskEnd.FAILED if error else WorkerTaskEnd.DONE, error_class=error)


def lost_row(run_id: str, message: dict, ended: float) -> WorkerTaskRow:
    """A task's start message as the row of a task lost with its worker, ended ``ended``."""
    return WorkerTaskRow(
        run_id=run_id, key=str(message["key"]), kind=str(message["kind"]),
        label=str(message["label"]), worker=str(message["name"]),
        device=str(message.get("device") or ""), started_at=_utc(message["started"]),
        finished_at=_utc(max(ended, float(message["started"]))),
        status=WorkerTaskEnd.LOST, error_class="worker lost")
