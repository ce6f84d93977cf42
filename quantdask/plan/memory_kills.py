"""Workers their nanny killed for memory: Dask's own event, matched to the attempt it ended.

Dask's nanny reads its worker's RSS every ``distributed.worker.memory.monitor-interval`` and,
past the terminate fraction of the worker's memory limit, logs an event on the topic
``worker-restart-memory`` (``{"worker": address, "pid": ..., "rss": bytes}``) with the
scheduler, then terminates the worker (``distributed.worker_memory.NannyMemoryManager``). The
driver subscribes to that topic: an attempt whose worker was lost is ``out_of_memory`` when
its worker's address is in such an event, and ``worker_lost`` when not. The scheduler's news
of the lost worker may come before the event: a lost attempt waits up to ``EVENT_WAIT_S`` for
it (``run.loop``).

>>> kills = MemoryKills()
>>> kills.on_event((0.0, {"worker": "tcp://127.0.0.1:4001", "pid": 7, "rss": 400 * 2**20}))
>>> kills.rss("tcp://127.0.0.1:4001") // 2**20, kills.rss("tcp://127.0.0.1:4002")
(400, None)
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

from quantdask.job.outcome import JobOutcome
from quantdask.process.slot_memory import SlotMemory
from quantdask.records import Ended, NotDone, Where
from quantdask.util import format_bytes, utcnow
from quantdask.words import FailureClass, Status

NANNY_MEMORY_TOPIC = "worker-restart-memory"
"""The topic of the event Dask's nanny logs as it restarts its worker for memory."""

EVENT_WAIT_S = 2.0
"""How long a lost attempt waits for its nanny's event before it counts as ``worker_lost``
(both reach the driver within milliseconds of the kill; this covers a busy machine)."""

HEADROOM = 1.3
"""The fix's memory limit covers the peak the job reached with this to spare: it was stopped
there, so its true peak is higher."""


class MemoryKills:
    """The nanny's memory events as they arrive: the killed worker's address -> its RSS when
    its nanny read it (added on the client's event-loop thread, read on the driver's); and
    the lost attempts waiting for theirs (``await_event``, ``settled``: any item the caller
    keeps, with the worker's address and a reading of the caller's clock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rss: dict[str, int] = {}
        self._waiting: list[tuple[float, Any, str | None]] = []

    def on_event(self, event) -> None:
        _, message = event
        if isinstance(message, dict) and "worker" in message:
            with self._lock:
                self._rss[str(message["worker"])] = int(message.get("rss") or 0)

    def rss(self, address: str | None) -> int | None:
        """The RSS at which the worker at ``address`` was killed for memory; None: it was not."""
        with self._lock:
            return self._rss.get(address) if address else None

    def await_event(self, item: Any, address: str | None, now: float) -> None:
        """Hold ``item`` (a lost attempt of the worker at ``address``) for its nanny's event,
        ``EVENT_WAIT_S`` at most."""
        self._waiting.append((now + EVENT_WAIT_S, item, address))

    def settled(self, now: float) -> list[Any]:
        """The items whose event came, or whose wait is over (no longer held)."""
        done = [w for w in self._waiting if now >= w[0] or self.rss(w[2]) is not None]
        self._waiting = [w for w in self._waiting if w not in done]
        return [item for _, item, _ in done]

    def __len__(self) -> int:
        return len(self._waiting)


@dataclass(frozen=True)
class MemoryKill:
    """An attempt its worker's nanny killed for memory: the worker's RSS then (the peak the
    attempt reached, at least) and what its slot reported (None: it reported nothing)."""

    rss: int
    slot: SlotMemory | None

    @property
    def reached(self) -> int:
        """What the job had added to its worker when it was killed (at least)."""
        return max(0, self.rss - (self.slot.resting if self.slot is not None else 0))

    def limit_needed(self) -> int | None:
        """A memory limit under which the job's slot would have room for ``HEADROOM`` times
        what it reached (rounded up to 100 MiB); None without the slot's figures."""
        if self.slot is None:
            return None
        need = (self.slot.resting + HEADROOM * self.reached) / self.slot.terminate
        step = 100 * 2**20
        return math.ceil(need / step) * step

    def message(self) -> str:
        """What happened, with the limit, the peak, and the fix."""
        slot = self.slot
        if slot is None:
            return (f"its worker's nanny killed it for memory (Dask's {NANNY_MEMORY_TOPIC} "
                    f"event): the worker held {format_bytes(self.rss)}; fix: give the workers "
                    "a larger memory limit, or run fewer jobs per worker")
        return (f"its worker's nanny killed it for memory (Dask's {NANNY_MEMORY_TOPIC} event): "
                f"the worker held {format_bytes(self.rss)}, past {slot.terminate:.0%} of its "
                f"{format_bytes(slot.limit)} memory limit ({format_bytes(slot.kill_line)}); "
                f"it rests at {format_bytes(slot.resting)}, so the job reached at least "
                f"{format_bytes(self.reached)} of its own against the "
                f"{format_bytes(slot.offered)} the slot offers jobs. fix: CPU slots with a "
                f"memory limit of at least {format_bytes(self.limit_needed())} (quantdask run "
                "--memory-limit, start_cluster(memory_limit=...)), or stream: always, or a "
                "smaller eval.batch_size")

    def outcome(self, worker: str | None) -> JobOutcome:
        """The attempt's outcome: ``out_of_memory``, with the limit and the RSS reached."""
        return JobOutcome((Where(worker, None, None), Ended(Status.FAILED, utcnow()),
                           NotDone(FailureClass.OUT_OF_MEMORY, "KilledForMemory",
                                   self.message(), None,
                                   memory_limit_bytes=self.slot.limit if self.slot else None,
                                   killed_at_rss_bytes=self.rss)))
