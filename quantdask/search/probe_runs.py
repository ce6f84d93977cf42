"""A search's tasks on the cluster (its units, its calibration reference, its probe chunks),
run as the sweep runs its jobs: each failure is classed as a job's is and handled by
``plan.retry``'s table.

| class          | what follows                                                          |
|----------------|-----------------------------------------------------------------------|
| unsupported    | the search fails at once (the task cannot run here)                  |
| out_of_memory  | run again at once on a whole device, with half the forward batch     |
| worker_lost    | run again at once (another worker takes it)                           |
| timeout        | past the sweep's ``timeout_s``: its worker restarted, run again      |
| job_error      | run again after the sweep's backoff                                   |

Past the sweep's ``retries`` the search fails with :class:`ProbeFailed`, naming the task, its
class and its last error; what the finished tasks recorded stays, and a rerun runs the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import CancelledError
from dataclasses import dataclass, field

from distributed import Client, Future, wait

from quantdask.errors import QuantdaskError, UnsupportedHere
from quantdask.job.outcome import failure_class_of
from quantdask.plan.policy import past_deadline, worker_went_away
from quantdask.plan.retry import by_class
from quantdask.process.runtime import JOB_START_TOPIC
from quantdask.run import LOG_CHANNEL, topics
from quantdask.words import FailureClass

log = logging.getLogger(LOG_CHANNEL)

POLL_S = 0.25


@dataclass(frozen=True)
class Room:
    """What an attempt of a task holds: its Dask resources and its forward batch."""

    resources: dict[str, float]
    batch_size: int

    def more(self) -> Room:
        """The room after running out of memory: a whole device, half the batch."""
        return Room({**self.resources, "GPU": max(1.0, self.resources.get("GPU", 1.0))},
                    max(1, self.batch_size // 2))


@dataclass(frozen=True)
class ProbeTask:
    """One task of a search: ``what`` names it in messages; ``submit(room, key, attempt)``
    submits attempt number ``attempt`` of it under the Dask key ``key``."""

    what: str
    submit: Callable[[Room, str, int], Future]


@dataclass(frozen=True)
class ProbeRules:
    """The sweep's rules for failed attempts (``Sweep.retries``, ``timeout_s``,
    ``retry_backoff_s``)."""

    retries: int
    timeout_s: float
    backoff_s: float


class ProbeFailed(QuantdaskError):
    """A search's task failed past its retries (or could not run here at all)."""

    def __init__(self, what: str, failure_class: FailureClass, attempts: int, message: str):
        self.failure_class = failure_class
        super().__init__(f"{what} failed {attempts} time{'s' * (attempts > 1)}, last as "
                         f"{failure_class}: {message} (the cells already probed are kept; a "
                         "rerun probes the rest)")


@dataclass
class _Attempt:
    index: int
    number: int
    room: Room
    future: Future
    started: float | None = None  # the driver's clock when the worker began it
    worker: str | None = None
    cut: bool = False  # cancelled at its deadline


@dataclass
class _Runs:
    client: Client
    tasks: list[ProbeTask]
    rules: ProbeRules
    clock: Callable[[], float]
    tag: str
    live: dict[str, _Attempt] = field(default_factory=dict)  # Dask key -> attempt
    delayed: list[tuple[float, int, int, Room]] = field(default_factory=list)

    def submit(self, index: int, number: int, room: Room) -> None:
        key = f"{self.tag}-{index}-a{number}"
        self.live[key] = _Attempt(index, number, room,
                                  self.tasks[index].submit(room, key, number))

    def on_start(self, event) -> None:  # on the client's event loop: only note it
        _, message = event
        attempt = self.live.get(message.get("key"))
        if attempt is not None:
            attempt.started, attempt.worker = self.clock(), message.get("address")

    def ended(self) -> list[_Attempt]:
        done = [key for key, a in self.live.items() if a.future.done()]
        return [self.live.pop(key) for key in done]

    def enforce_deadlines(self) -> None:
        from quantdask.cluster.operations import restart_worker

        late = past_deadline({k: (a.started, self.rules.timeout_s) for k, a in self.live.items()
                              if a.started is not None}, self.clock())
        for key in late:
            attempt = self.live[key]
            attempt.cut = True
            attempt.future.cancel()
            restart_worker(self.client, attempt.worker, wait=False)

    def failed(self, attempt: _Attempt) -> None:
        """Retry ``attempt``'s task as its failure class says, or raise ``ProbeFailed``."""
        what = self.tasks[attempt.index].what
        failure, message = self._classify(attempt)
        decision = by_class(attempt.number, self.rules.retries, failure, self.rules.backoff_s)
        log.warning("%s, attempt %d: %s: %s; %s", what, attempt.number, failure, message,
                    decision.reason)
        if not decision.retry:
            raise ProbeFailed(what, failure, attempt.number, message)
        room = attempt.room.more() if failure == FailureClass.OUT_OF_MEMORY else attempt.room
        self.delayed.append((self.clock() + decision.delay_s, attempt.index,
                             attempt.number + 1, room))

    def _classify(self, attempt: _Attempt) -> tuple[FailureClass, str]:
        if attempt.cut:
            return FailureClass.TIMEOUT, (f"no result after timeout_s={self.rules.timeout_s:g}s "
                                          f"on worker {attempt.worker}; it was restarted")
        error = (attempt.future.exception() if attempt.future.status == "error"
                 else CancelledError("cancelled by the scheduler"))
        message = f"{type(error).__name__}: {error}"
        if worker_went_away(error):
            return FailureClass.WORKER_LOST, message
        if isinstance(error, UnsupportedHere):
            return FailureClass.UNSUPPORTED, message
        return failure_class_of(error), message

    def submit_due(self) -> None:
        now = self.clock()
        for _, index, number, room in [d for d in self.delayed if d[0] <= now]:
            self.submit(index, number, room)
        self.delayed = [d for d in self.delayed if d[0] > now]


def run_probe_tasks(client: Client, tasks: list[ProbeTask], room: Room, rules: ProbeRules,
                    tag: str, stop: threading.Event | None = None,
                    tick: Callable[[], None] = lambda: None,
                    clock: Callable[[], float] = time.monotonic
                    ) -> Generator[tuple[int, Future], None, None]:
    """Run every task of ``tasks`` (see the module), each first in ``room``; yields (index,
    its finished future) as each finishes. Returns early, everything cancelled, once ``stop``
    is set; ``tick()`` is called between polls (the driver shows its progress there)."""
    runs = _Runs(client, tasks, rules, clock, tag)
    topics.subscribe(client, JOB_START_TOPIC, runs.on_start)
    try:
        for index in range(len(tasks)):
            runs.submit(index, 1, room)
        while runs.live or runs.delayed:
            if stop is not None and stop.is_set():
                break
            ended = runs.ended()
            for attempt in ended:
                if attempt.future.status == "finished":
                    yield attempt.index, attempt.future
                else:
                    runs.failed(attempt)
            runs.enforce_deadlines()
            runs.submit_due()
            tick()
            running = [a.future for a in runs.live.values() if not a.future.done()]
            if not ended and running:
                try:
                    wait(running, timeout=POLL_S, return_when="FIRST_COMPLETED")
                except (TimeoutError, CancelledError):  # one cancelled: ended next time
                    pass
            elif not ended:
                time.sleep(POLL_S)
    finally:  # an error, a stop or a caller gone: nothing keeps running unseen
        topics.unsubscribe(client, JOB_START_TOPIC, runs.on_start)
        client.cancel([a.future for a in runs.live.values()])

