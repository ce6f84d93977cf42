"""A sweep's live progress: what each worker runs now, counts, ETA, the queue, the last failures.

The driver keeps a :class:`SweepProgress` up to date as jobs are queued, start, send telemetry
and finish, and writes it to ``RUN_DIR/progress.json`` (atomically, at most once a second), so
``quantdask status RUN_DIR --watch`` shows the same view from another terminal with no
connection to the cluster.

>>> read_progress("runs/demo").counts  # doctest: +SKIP
{'done': 7, 'failed': 0, 'skipped': 0}
"""

from __future__ import annotations

import datetime as dt
import heapq
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantdask.store.figures import kl_text, perplexity_text
from quantdask.util import atomic_write, utcnow
from quantdask.words import FailureClass, Status

PROGRESS_FILE = "progress.json"
WRITE_EVERY_S = 1.0
RECENT_FAILURES = 5
EVENTS_KEPT = 500  # the event lines a watcher can catch up on
QUEUE_KEPT = 20  # the head of the queue a view is given


def describe_result(record: dict) -> str:
    """One line on how an attempt ended: its metrics, or its error's first line."""
    if record["status"] == Status.DONE:
        kl = kl_text(record["kl_divergence"], record.get("kl_se"), record.get("kl_kind"),
                     record.get("kl_tail_mass"))
        line = (f"ppl {perplexity_text(record['perplexity'], record.get('ln_ppl_se'))}, "
                f"KL {kl}, {record['bits_per_weight']:.3g} bits/weight, "
                f"{record['wall_s']:.1f}s")
        share = record.get("quantized_share")
        if record.get("quantized_params") and share is not None:  # none for the baseline
            line += f", {share:.0%} of weights quantized"
            if share < 0.5 and record.get("full_precision"):  # most of the model untouched
                line += f" (full precision: {record['full_precision']})"
        return line
    message = (record.get("error_message") or "").strip().splitlines()
    return f"{record.get('error_class')}: {message[0] if message else ''}"


@dataclass
class RunningJob:
    """An attempt running on a worker now."""

    key: str
    job_id: str
    label: str
    priority: int
    attempt: int
    worker: str
    started_at: str  # ISO 8601, UTC
    peak_memory_bytes: int | None = None  # the worker's device memory (or RSS) since it began
    peak_host_rss_bytes: int | None = None  # the worker process's, sampled once a second
    host_memory_limit_bytes: int | None = None  # its Dask memory limit (None: no limit)


@dataclass
class FailureLine:
    """A failed attempt: what, when, why, and whether it is tried again."""

    at: str
    job_id: str
    label: str
    attempt: int
    failure_class: str
    message: str
    retrying: bool


@dataclass
class SweepProgress:
    """The live view of one sweep (one driver session) on one run directory."""

    sweep: str
    run_dir: str
    total: int
    dashboard_link: str | None = None
    slots: int = 1
    workers: list[str] = field(default_factory=list)
    devices: dict[str, str] = field(default_factory=dict)  # worker -> its device
    started_at: str = field(default_factory=lambda: utcnow().isoformat())
    updated_at: str = ""
    finished: bool = False
    completed: bool = False  # finished with every job settled (not an error or an interrupt)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(map(str, Status), 0))
    running: dict[str, RunningJob] = field(default_factory=dict)  # Dask key -> attempt
    queued: dict[str, list] = field(default_factory=dict)  # job id -> [priority, order, label]
    failures: list[FailureLine] = field(default_factory=list)
    waiting: int = 0  # jobs queued, all of them (``queued`` may hold only the head)
    events: list[dict] = field(default_factory=list)  # {"seq", "at", "text"}, the last ones
    run_id: str = ""  # the driver session writing this
    done_seconds: float = 0.0  # this session's done attempts: total time and count (the ETA)
    done_attempts: int = 0
    searches: dict[str, list[int]] = field(default_factory=dict)  # name -> [probed, cells]

    def __post_init__(self):
        self._lock = threading.Lock()
        self._order = 0
        self._written = 0.0

    def _event(self, text: str) -> None:
        """Note a line for plain logs and watchers (call under the lock)."""
        seq = self.events[-1]["seq"] + 1 if self.events else 1
        self.events.append({"seq": seq, "at": utcnow().isoformat(), "text": text})
        del self.events[:-EVENTS_KEPT]

    # -- updates, from the driver (any thread) --------------------------------------------

    def already_finished(self, statuses: list[str]) -> None:
        """Count the jobs a previous session finished (a resumed run)."""
        with self._lock:
            for status in statuses:
                self.counts[status] = self.counts.get(status, 0) + 1

    def search_started(self, name: str, cells: int, recorded: int) -> None:
        """A search's probing begins: ``cells`` in all, ``recorded`` of them by an earlier
        run."""
        with self._lock:
            self.searches[name] = [recorded, cells]
            self._event(f"search  {name}: {cells} cells, {recorded} recorded earlier, "
                        f"{cells - recorded} to probe")

    def cells_probed(self, name: str, count: int) -> None:
        with self._lock:
            entry = self.searches[name]
            entry[0] += count
            self._event(f"search  {name}: {entry[0]} of {entry[1]} cells probed")

    def search_finished(self, name: str, jobs: int) -> None:
        with self._lock:
            self._event(f"search  {name}: allocated; {jobs} jobs verify it")

    def jobs_added(self, total: int) -> None:
        """The searches' jobs joined the sweep: ``total`` jobs now."""
        with self._lock:
            self.total = total

    @property
    def probing(self) -> dict[str, list[int]]:
        """The searches still probing: name -> [cells probed, cells]."""
        with self._lock:
            return {name: list(entry) for name, entry in self.searches.items()
                    if entry[0] < entry[1] and not self.finished}

    def job_queued(self, job_id: str, label: str, priority: int) -> None:
        with self._lock:
            self._order += 1
            self.queued[job_id] = [priority, self._order, label]

    def job_started(self, key: str, job_id: str, label: str, priority: int, attempt: int,
                    worker: str) -> None:
        with self._lock:
            self.queued.pop(job_id, None)
            self.running[key] = RunningJob(key, job_id, label, priority, attempt, worker,
                                           utcnow().isoformat())
            self._event(f"start   {label} (attempt {attempt}, priority {priority}) on worker "
                        f"{worker}")

    def telemetry(self, worker: str, device: str, job_id: str | None,
                  memory_used_bytes: int | None, host_rss_bytes: int | None = None,
                  host_memory_limit_bytes: int | None = None) -> None:
        """A worker's latest device reading (and its process's memory against its limit):
        the peaks so far of the attempt it runs."""
        with self._lock:
            if worker not in self.workers:  # a worker that joined (or restarted) since
                self.workers.append(worker)
                self.workers.sort()
            self.devices[worker] = device
            for running in self.running.values():
                if running.worker == worker and running.job_id == job_id:
                    if memory_used_bytes is not None:
                        running.peak_memory_bytes = max(running.peak_memory_bytes or 0,
                                                        memory_used_bytes)
                    if host_rss_bytes is not None:
                        running.peak_host_rss_bytes = max(running.peak_host_rss_bytes or 0,
                                                          host_rss_bytes)
                    running.host_memory_limit_bytes = host_memory_limit_bytes

    def attempt_ended(self, key: str, job_id: str, label: str, attempt: int, record: dict,
                      final: bool) -> None:
        """An attempt ended: ``final`` when its job is settled (no retry follows)."""
        with self._lock:
            running = self.running.pop(key, None)
            if running is not None and record["status"] == Status.DONE:
                # Only done attempts set the pace: a skip or a crash is no measure of a job.
                started = dt.datetime.fromisoformat(running.started_at)
                self.done_seconds += (utcnow() - started).total_seconds()
                self.done_attempts += 1
            if final:
                self.queued.pop(job_id, None)
                status = str(record["status"])
                self.counts[status] = self.counts.get(status, 0) + 1
            where = f" on worker {record['worker']}" if record.get("worker") else ""
            if record["status"] == Status.DONE:
                self._event(f"done    {label} (attempt {attempt}){where}: "
                            f"{describe_result(record)}")
                return
            failure = FailureLine(utcnow().isoformat(), job_id, label, attempt,
                                  record.get("failure_class") or FailureClass.JOB_ERROR,
                                  describe_result(record), retrying=not final)
            self.failures.append(failure)
            del self.failures[:-RECENT_FAILURES]
            then = "retrying" if not final else "no more retries"
            self._event(f"{record['status']:7} {label} (attempt {attempt}){where}, "
                        f"{failure.failure_class}: {failure.message}; {then}")

    def attempt_dropped(self, key: str) -> None:
        """An attempt that will be submitted again (requeued, cut at its deadline)."""
        with self._lock:
            self.running.pop(key, None)

    def finish(self, completed: bool) -> None:
        with self._lock:
            self.finished = True
            self.completed = completed
            self.running.clear()

    # -- reading ---------------------------------------------------------------------------

    @property
    def settled(self) -> int:
        return sum(self.counts.values())

    def eta_s(self, now: dt.datetime | None = None) -> float | None:
        """Seconds left at this session's pace: the work left (jobs not settled x the mean
        done attempt, less what the running ones have done) over the slots it can use."""
        left = self.total - self.settled
        if left <= 0:
            return 0.0
        if not self.done_attempts:
            return None
        now = now or utcnow()
        mean = self.done_seconds / self.done_attempts
        with self._lock:
            elapsed = [(now - dt.datetime.fromisoformat(r.started_at)).total_seconds()
                       for r in self.running.values()]
        work = left * mean - sum(min(e, mean) for e in elapsed)
        return max(0.0, work) / max(1, min(self.slots, left))

    def queue_order(self, first: int | None = None) -> list[tuple[int, str]]:
        """Jobs waiting to start, in the order they will (highest priority first); the
        ``first`` ones only when given."""
        with self._lock:
            entries = list(self.queued.values())
        key = lambda entry: (-entry[0], entry[1])  # noqa: E731
        waiting = sorted(entries, key=key) if first is None else heapq.nsmallest(first, entries,
                                                                                  key=key)
        return [(priority, label) for priority, _, label in waiting]

    def to_dict(self) -> dict[str, Any]:
        """Everything a view needs; of the queue, its head and its length (a sweep of 10,000
        jobs must not copy them all four times a second)."""
        head = self.queue_order(first=QUEUE_KEPT)
        with self._lock:
            queued = self.queued
            self.queued = {}
            try:
                data = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
            finally:
                self.queued = queued
            data["waiting"] = len(queued)
        data["queued"] = {f"queued-{i}": [priority, i, label]
                          for i, (priority, label) in enumerate(head)}
        data["eta_s"] = self.eta_s()
        return data

    def snapshot(self) -> SweepProgress:
        """A copy taken under the lock: what a view renders while the driver goes on."""
        return SweepProgress.from_dict(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepProgress:
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["counts"] = dict(data.get("counts", {}))
        fields["queued"] = {k: list(v) for k, v in data.get("queued", {}).items()}
        fields["running"] = {k: RunningJob(**v) for k, v in data.get("running", {}).items()}
        fields["failures"] = [FailureLine(**f) for f in data.get("failures", [])]
        return cls(**fields)

    def write(self, force: bool = False) -> None:
        """Write ``RUN_DIR/progress.json`` (at most once a second unless ``force``): a new
        file renamed into place, so a reader sees a whole one; no fsync, it is a view."""
        now = time.monotonic()
        if not force and now - self._written < WRITE_EVERY_S:
            return
        self._written = now
        self.updated_at = utcnow().isoformat()
        body = json.dumps(self.to_dict(), indent=1).encode()
        atomic_write(Path(self.run_dir) / PROGRESS_FILE, lambda f: f.write(body), durable=False)


def read_progress(run_dir: str | os.PathLike) -> SweepProgress | None:
    """The progress the last driver on ``run_dir`` wrote (None if none has run there)."""
    path = Path(run_dir) / PROGRESS_FILE
    try:
        return SweepProgress.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
