"""Running attempts' log lines in their jobs' logs, as their workers send them.

A worker sends a running attempt's lines in batches (``process.live_log``: Dask events on
``JOB_LOG_TOPIC``, so a worker needs no share of the driver's disk). The driver's loop appends
them to the job's log (``logs/jobs/<job_id>.log``) under a line saying the attempt is running,
so ``quantdask logs`` and ``handle.logs`` show them from any process while it runs. When the
attempt ends, the recorder settles its section: the attempt's whole log, which has every one of
those lines, takes its place in one atomic rewrite, so the job's log holds each line once. An
attempt that ended outside the job (its worker lost, past its deadline, cancelled) brings no
whole log: the lines it sent stay, followed by the line saying how it ended.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from quantdask.run.attempts import Attempt
from quantdask.store.run_store import RunStore
from quantdask.util import utcnow


@dataclass(frozen=True)
class _Section:
    """The running attempt's part of its job's log: from byte ``start`` to the end."""

    job_id: str
    number: int
    start: int


class LiveLogs:
    """The sections of the job logs that running attempts write into (see the module)."""

    def __init__(self, store: RunStore):
        self.store = store
        self._events: collections.deque[tuple[str, str]] = collections.deque()
        self._open: dict[str, _Section] = {}  # attempt key -> its section

    def on_event(self, event) -> None:
        # On the client's event loop thread: only queue it (the loop does the disk I/O).
        _, message = event
        self._events.append((str(message["key"]), str(message["text"])))

    def write(self, attempt_of: Callable[[str], Attempt | None]) -> None:
        """Append the lines that arrived to the logs of the attempts still running
        (``attempt_of(key)`` is None for one that is not); those of a settled attempt are
        dropped (its whole log is written), and the section of an attempt that left without
        being settled (requeued after its worker died) is closed first."""
        for key in [k for k in self._open if attempt_of(k) is None]:
            self._close(key)
        while self._events:
            key, text = self._events.popleft()
            attempt = attempt_of(key)
            if attempt is None:
                continue
            if key not in self._open:
                self._begin(key, attempt)
            self.store.append_job_log(attempt.job.id, text)

    def _begin(self, key: str, attempt: Attempt) -> None:
        job_id = attempt.job.id
        for other in [k for k, s in self._open.items() if s.job_id == job_id]:
            self._close(other)  # a job's log holds one open section, at its end
        where = f" on worker {attempt.worker_name}" if attempt.worker_name else ""
        start = self.store.append_job_log(job_id, (
            f"{utcnow().isoformat()} INFO {job_id} attempt={attempt.number} (running{where}): "
            "its lines so far; its whole log replaces them when it ends\n"))
        self._open[key] = _Section(job_id, attempt.number, start)

    def settle(self, key: str, job_id: str, text: str, whole: bool) -> None:
        """Write an ended attempt's ``text`` into its job's log: in place of the lines it sent
        while it ran when ``whole`` (every line it logged), after them otherwise."""
        text = text if text.endswith("\n") else text + "\n"
        section = self._open.pop(key, None)
        if section is None:
            self.store.append_job_log(job_id, text)
            return

        def tail(sent: str) -> str:
            return text if whole else sent.partition("\n")[2] + text  # the running line off

        self.store.replace_job_log_tail(job_id, section.start, tail)

    def _close(self, key: str) -> None:
        section = self._open[key]
        self.settle(key, section.job_id, (
            f"{utcnow().isoformat()} WARNING {section.job_id} attempt={section.number} ended "
            "without an outcome (its worker went away, or the driver stopped): the lines "
            "above are what it sent while it ran\n"), whole=False)

    def close(self) -> None:
        """At the driver's end: close every section still open, drop what is queued."""
        self._events.clear()
        for key in list(self._open):
            self._close(key)
