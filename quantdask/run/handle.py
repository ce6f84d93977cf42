"""A sweep running beside the notebook: the handle ``qd.submit_sweep`` returns at once.

The sweep's driver loop runs in a background thread of this process; the handle reads what it
has recorded so far and what it is doing, waits for it (``wait``, or ``await handle``), stops it
(``cancel``), and shows itself in JupyterLab through the view it is given: the progress widget
that updates itself (``run.widget``, which ``submit_sweep`` passes; plain text elsewhere).
An interrupt while waiting stops only the waiting. A kernel restart ends the process and the
sweep with it, as a killed driver: nothing recorded is lost, and the next run of the sweep
resumes.

>>> handle = submit_sweep(sweep, "runs/demo", cluster.client)  # doctest: +SKIP
>>> handle.results                      # what has finished so far  # doctest: +SKIP
>>> handle.wait()                       # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import polars as pl

from quantdask.run import LOG_CHANNEL
from quantdask.store.summary import failures_table
from quantdask.util import format_duration

if TYPE_CHECKING:
    from quantdask.run.loop import SweepDriver
    from quantdask.run.progress import SweepProgress
    from quantdask.store.run_store import RunStore
    from quantdask.sweepfile.sweep import Job, Sweep

log = logging.getLogger(LOG_CHANNEL)


class Session(Protocol):
    """What a handle needs of its sweep's session (``run.sweep.SweepSession`` is one,
    made by ``start_session``): the sweep, its run directory, its jobs and its driver loop;
    ``run`` runs it to its end (in the handle's thread), ``results`` reads what it recorded."""

    sweep: Sweep
    store: RunStore
    jobs: list[Job]
    driver: SweepDriver

    def run(self) -> None: ...

    def results(self) -> pl.DataFrame: ...


@dataclass
class Listeners:
    """Who hears of each result and progress update: the caller's callbacks, and what
    watches the handle (its widget, live charts), added while the sweep runs."""

    on_result: Callable[[dict[str, Any]], None] | None = None
    on_progress: Callable[[SweepProgress], None] | None = None
    results: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)
    updates: list[Callable[[SweepProgress], None]] = field(default_factory=list)

    def result(self, record: dict[str, Any]) -> None:
        if self.on_result is not None:
            self.on_result(record)
        for listener in list(self.results):
            _quietly(listener, record)

    def progress(self, progress: SweepProgress) -> None:
        if self.on_progress is not None:
            self.on_progress(progress)
        for listener in list(self.updates):
            _quietly(listener, progress)


def _quietly(listener: Callable, value: Any) -> None:
    try:
        listener(value)
    except Exception as error:  # noqa: BLE001 - a view must never stop the sweep
        log.error("a sweep listener failed: %s", error)


class SweepHandle:
    """A sweep running in the background of this process (see the module)."""

    def __init__(self, session: Session, listeners: Listeners,
                 reporter: Callable[..., Path] | None = None,
                 view: Callable[[SweepHandle], object] | None = None):
        self._session = session
        self._listeners = listeners
        self._reporter = reporter  # qd.write_report (the report layer sits above this one)
        # What shows the handle in a notebook: view(handle) is the object to display
        # (submit_sweep passes run.widget.progress_view; the widget knows the handle, not
        # the other way round).
        self._view = view
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"quantdask-sweep-{session.sweep.name}")
        self._error: BaseException | None = None
        # Waiting is on this event, never on Thread.join: an interrupt inside join can leave a
        # running thread marked as stopped (CPython's _wait_for_tstate_lock).
        self._finished = threading.Event()
        self.run_dir = Path(session.store.root)
        self.sweep = session.sweep

    def start(self) -> SweepHandle:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._session.run()
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits
            log.error("sweep %s stopped: %s: %s", self.sweep.name, type(error).__name__, error)
            self._error = error
        finally:  # the final view: every listener sees the end
            try:
                self._listeners.progress(self._session.driver.progress.snapshot())
            finally:
                self._finished.set()

    @property
    def results(self) -> pl.DataFrame:
        """What has finished so far: this sweep's recorded results (the results schema)."""
        return self._session.results()

    @property
    def progress(self) -> SweepProgress:
        """The live progress: counts by status (``.counts``), the running jobs (``.running``),
        the last failures, and the estimated time left (``.eta_s()``)."""
        return self._session.driver.progress.snapshot()

    def done(self) -> bool:
        """Whether the sweep has ended (finished, cancelled, or stopped by an error)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> pl.DataFrame:
        """Wait for the sweep's end and return its results; raises what stopped it, or
        ``TimeoutError`` after ``timeout`` seconds (the sweep goes on). An interrupt (a kernel
        interrupt, Ctrl-C) stops only the waiting: the sweep goes on too."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._finished.is_set():
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"sweep {self.sweep.name} still running after {timeout:g}s")
            self._finished.wait(left)
        if self._error is not None:
            raise self._error
        return self.results

    def __await__(self):
        return asyncio.get_running_loop().run_in_executor(None, self.wait).__await__()

    def cancel(self) -> list[str]:
        """Stop the sweep: submit nothing more, cancel the running attempts and record them as
        cancelled (their jobs have no result: the next run of the sweep runs exactly those
        and the ones not started). Returns the ids of the jobs whose attempts were running."""
        self._session.driver.stop.set()
        self._finished.wait()
        return list(self._session.driver.cancelled)

    def failures(self) -> pl.DataFrame:
        """The jobs that failed or were skipped so far, with the first line of the error (the
        report's ``failures_table``)."""
        return failures_table(self.results)

    def logs(self, job: str) -> str:
        """A job's log, every attempt (a running one's lines so far: ``run.live_logs``):
        ``job`` is its id, a unique prefix, or its config label (with one model)."""
        ids = [j.id for j in self._session.jobs]
        matches = ([i for i in ids if i == job] or [i for i in ids if i.startswith(job)]
                   or [j.id for j in self._session.jobs if j.config_label == job])
        if len(matches) != 1:
            raise KeyError(f"{job!r} names {len(matches)} jobs of sweep {self.sweep.name}; "
                           "give a job id")
        path = self._session.store.job_log_path(matches[0])
        return path.read_text(encoding="utf-8") if path.exists() else ""

    def report(self, output: str | None = None) -> Path:
        """The run directory's HTML report (``qd.write_report``), of what has finished."""
        if self._reporter is None:
            raise RuntimeError("this handle has no report writer: use qd.submit_sweep, or "
                               "qd.write_report(handle.run_dir)")
        return self._reporter(self.run_dir, output)

    def on_result(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call ``listener(record)`` after each result from now on (from the sweep's thread)."""
        self._listeners.results.append(listener)

    def on_progress(self, listener: Callable[[SweepProgress], None]) -> None:
        """Call ``listener(progress)`` with each progress update from now on."""
        self._listeners.updates.append(listener)

    def summary(self) -> str:
        """One line: settled jobs by status, running ones, the time left, and where."""
        progress = self.progress
        counts = ", ".join(f"{n} {status}" for status, n in progress.counts.items())
        eta = progress.eta_s()
        state = ("cancelled" if self._session.driver.stop.is_set() and self.done()
                 else "finished" if self.done() else "running")
        left = f"; about {format_duration(eta)} left" if eta and not self.done() else ""
        probing = "".join(f"probing search {name}: {probed} of {cells} cells; "
                          for name, (probed, cells) in progress.probing.items())
        return (f"sweep {self.sweep.name} ({state}): {probing}{progress.settled}/"
                f"{progress.total} jobs settled ({counts}), {len(progress.running)} "
                f"running{left}; {self.run_dir}")

    def __repr__(self) -> str:
        return f"<SweepHandle {self.summary()}>"

    def _ipython_display_(self) -> None:
        if self._view is None:
            print(repr(self))
            return
        from IPython.display import display

        display(self._view(self))
