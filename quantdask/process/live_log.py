"""A running attempt's log lines, sent to the driver while the attempt runs.

The attempt's whole log comes back with its outcome; until then its lines go out as Dask events
(``worker.log_event``, to the driver that subscribed to :data:`JOB_LOG_TOPIC`), so the job's log
in the run directory shows them as they are written, on a cluster whose workers do not share the
driver's disk too. Lines are batched: one event at most every :data:`FLUSH_S` seconds per
attempt, of at most :data:`MAX_EVENT_CHARS` characters (the lines past that in one batch are
counted, not sent: the whole log has them), so a chatty job cannot flood the scheduler, which
keeps every event it relays. What is still pending when the attempt ends is dropped: its whole
log replaces what was sent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

JOB_LOG_TOPIC = "quantdask-job-log"
"""Dask event topic: {"key": the attempt's Dask key, "text": lines} while an attempt runs."""

FLUSH_S = 0.5
"""How long a logged line may wait before it is sent (the batching window)."""

MAX_EVENT_CHARS = 32_000
"""The most characters of lines one event carries."""


class LiveLog(logging.Handler):
    """Batches the lines it handles and passes each batch to ``send(text)`` from a timer
    thread, :data:`FLUSH_S` after the first line of the batch. Give it the same filter and
    formatter as the attempt's own log, so that both hold the same lines."""

    def __init__(self, send: Callable[[str], None], flush_s: float = FLUSH_S,
                 max_chars: int = MAX_EVENT_CHARS):
        super().__init__()
        self._send = send
        self._flush_s = flush_s
        self._max_chars = max_chars
        self._pending: list[str] = []
        self._chars = 0
        self._left_out = 0
        self._timer: threading.Timer | None = None
        self._closed = False
        self._lock = threading.Lock()  # the timer's thread flushes what the job's thread adds

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
        except Exception:  # noqa: BLE001 - logging's own convention for a bad record
            self.handleError(record)
            return
        with self._lock:
            if self._closed:
                return
            if self._chars + len(line) > self._max_chars:
                self._left_out += 1
            else:
                self._pending.append(line)
                self._chars += len(line)
            if self._timer is None:
                self._timer = threading.Timer(self._flush_s, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Send the pending lines now (the timer calls it)."""
        with self._lock:
            self._timer = None
            if self._closed or not (self._pending or self._left_out):
                return
            text = "".join(self._pending)
            if self._left_out:
                text += (f"[{self._left_out} more lines not shown while the attempt runs: its "
                         "whole log, when it ends, has them]\n")
            self._pending, self._chars, self._left_out = [], 0, 0
            try:
                self._send(text)
            except Exception:  # noqa: BLE001 - a live view never costs the job
                pass

    def close(self) -> None:
        """Stop: what is pending is dropped (the attempt's whole log replaces it)."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._pending = []
        super().close()


def live_sender() -> Callable[[str], None] | None:
    """How the running task sends its lines to the driver: an event under its Dask key on
    :data:`JOB_LOG_TOPIC`; None outside a Dask worker (nobody to send to). Call it in the
    task's thread; what it returns may be called from any thread (``log_event`` is
    thread-safe)."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:
        return None
    key = str(worker.get_current_task())

    def send(text: str) -> None:
        worker.log_event(JOB_LOG_TOPIC, {"key": key, "text": text})

    return send
