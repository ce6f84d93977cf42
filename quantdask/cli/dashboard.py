"""The operator's view of a running sweep: a live terminal dashboard, or plain timestamped lines.

Both read a :class:`~quantdask.run.progress.SweepProgress`: the driver's own during
``quantdask run``,
or the one it writes to ``RUN_DIR/progress.json`` for ``quantdask status RUN_DIR --watch``.

>>> with LiveDashboard() as dashboard:  # doctest: +SKIP
...     run_sweep(sweep, "runs/demo", client, on_progress=dashboard.update)
"""

from __future__ import annotations

import datetime as dt
import logging
import sys
import time
from typing import IO, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from quantdask.run.progress import SweepProgress, read_progress
from quantdask.util import format_bytes, format_duration
from quantdask.words import Status

QUEUE_SHOWN = 6


def _since(iso: str, now: dt.datetime) -> float:
    return max(0.0, (now - dt.datetime.fromisoformat(iso)).total_seconds())


def summary_line(progress: SweepProgress, now: dt.datetime | None = None) -> str:
    """``5/7 jobs · 4 done · 1 failed · 0 skipped · 2 running · elapsed 0:12 · ETA 0:05``."""
    now = now or dt.datetime.now(dt.UTC)
    counts = progress.counts
    state = ("finished" if progress.completed else "stopped") if progress.finished else \
        f"{len(progress.running)} running · ETA {format_duration(progress.eta_s())}"
    settled = " · ".join(f"{counts.get(status, 0)} {status}" for status in Status)
    return (f"{progress.settled}/{progress.total} jobs · {settled} · "
            f"elapsed {format_duration(_since(progress.started_at, now))} · {state}")


def render(progress: SweepProgress, now: dt.datetime | None = None) -> Group:
    """The dashboard: header, progress bar, one row per worker, the queue, the last failures."""
    now = now or dt.datetime.now(dt.UTC)
    header = Text.assemble(("quantdask ", "bold"), (f"sweep {progress.sweep}", "bold cyan"),
                           f" · {progress.run_dir}")
    if progress.dashboard_link:
        header.append(f" · Dask dashboard: {progress.dashboard_link}", style="dim")
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=max(1, progress.total), completed=progress.settled, width=40),
                Text(summary_line(progress, now)))

    workers = Table(title="workers", title_justify="left", expand=False)
    for column in ("worker", "device", "job", "attempt", "priority", "elapsed", "peak memory"):
        workers.add_column(column, no_wrap=True)
    busy: dict[str, list] = {}
    for running in progress.running.values():
        busy.setdefault(running.worker, []).append(running)
    for worker in sorted(set(progress.workers) | set(busy)):
        if not busy.get(worker):
            workers.add_row(worker, progress.devices.get(worker, "-"), Text("idle", style="dim"),
                            "", "", "", "")
        for running in sorted(busy.get(worker, []), key=lambda r: r.started_at):
            workers.add_row(worker, progress.devices.get(worker, "-"), running.label,
                            str(running.attempt),
                            str(running.priority),
                            format_duration(_since(running.started_at, now)),
                            format_bytes(running.peak_memory_bytes))

    parts: list[RenderableType] = [header, bar, workers]
    for name, (probed, cells) in progress.probing.items():  # before its jobs join the sweep
        parts.append(Text(f"probing search {name}: {probed} of {cells} cells", style="cyan"))
    queue = progress.queue_order()
    if queue and not progress.finished:
        shown = ", ".join(f"[p{priority}] {label}" for priority, label in queue[:QUEUE_SHOWN])
        waiting = max(progress.waiting, len(queue))
        more = f" (+{waiting - QUEUE_SHOWN} more)" if waiting > QUEUE_SHOWN else ""
        parts.append(Text(f"next, by priority: {shown}{more}"))
    if progress.failures:
        failures = Table(title="last failures", title_justify="left", expand=False)
        for column in ("at", "job", "attempt", "class", "reason", "then"):
            failures.add_column(column, overflow="fold")
        for failure in progress.failures:
            failures.add_row(failure.at[11:19], failure.label, str(failure.attempt),
                             failure.failure_class, failure.message[:120],
                             Text("retrying", style="yellow") if failure.retrying
                             else Text(Status.FAILED.value, style="red"))
        parts.append(failures)
    return Group(*parts)


class LiveDashboard:
    """``rich.live.Live`` over :func:`render`; pass :meth:`update` as ``on_progress``."""

    def __init__(self, console: Console | None = None, refresh_per_second: float = 4):
        self.console = console or Console()
        self._progress: SweepProgress | None = None
        self._frame: RenderableType = Text("")
        self._live = Live(console=self.console, refresh_per_second=refresh_per_second,
                          get_renderable=self._renderable, transient=False)

    def _renderable(self):
        # Rich's refresh thread calls this: a failure here would stop the dashboard for good,
        # so it shows the last good frame instead.
        if self._progress is None:
            return Text("quantdask: starting the sweep ...")
        try:
            self._frame = render(self._progress)
        except Exception as error:  # noqa: BLE001
            logging.getLogger("quantdask.dashboard").debug("frame not drawn: %s", error)
        return self._frame

    def update(self, progress: SweepProgress) -> None:
        """Show ``progress`` (pass a :meth:`SweepProgress.snapshot`, as ``run_sweep`` does:
        the view reads it from another thread)."""
        self._progress = progress

    def __enter__(self) -> LiveDashboard:
        self._live.__enter__()
        # Log lines (a worker restarted, ...) must print above the dashboard, not through it:
        # point the logging handlers at the stderr that Live now redirects.
        self._handlers = [(h, h.stream) for h in logging.getLogger().handlers
                          if isinstance(h, logging.StreamHandler) and h.stream in
                          (sys.__stderr__, sys.__stdout__)]
        for handler, stream in self._handlers:
            handler.setStream(sys.stderr if stream is sys.__stderr__ else sys.stdout)
        return self

    def __exit__(self, *exc) -> None:
        self._live.refresh()
        for handler, stream in self._handlers:
            handler.setStream(stream)
        self._live.__exit__(*exc)


class PlainLog:
    """Timestamped lines for a log file or a pipe: each attempt's start and end (with its
    metrics or its error), and the counts whenever a job settles. Pass :meth:`update` as
    ``on_progress``; it prints what happened since the last call."""

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream or sys.stdout
        self._seen = 0
        self._settled: int | None = None
        self._closed = False

    @staticmethod
    def _stamp(iso: str) -> str:
        return dt.datetime.fromisoformat(iso).strftime("%Y-%m-%dT%H:%M:%SZ")

    def update(self, progress: SweepProgress) -> None:
        for event in progress.events:
            if event["seq"] > self._seen:
                print(f"{self._stamp(event['at'])} {event['text']}", file=self.stream)
                self._seen = event["seq"]
        if progress.settled != self._settled or (progress.finished and not self._closed):
            self._settled = progress.settled
            self._closed = progress.finished
            now = dt.datetime.now(dt.UTC)
            print(f"{self._stamp(now.isoformat())} {summary_line(progress, now)}",
                  file=self.stream)
        self.stream.flush()


def watch(run_dir: str, console: Console | None = None, interval_s: float = 1.0,
          plain: bool | None = None, stream: TextIO | None = None) -> int:
    """Follow the sweep running on ``run_dir`` from its ``progress.json`` until it finishes
    (0), or until its driver is found gone without finishing (1). Needs no cluster."""
    from quantdask.store.run_store import RunStore

    console = console or Console()
    plain = (not console.is_terminal) if plain is None else plain
    live = None if plain else LiveDashboard(console)
    show = live.update if live is not None else PlainLog(stream or console.file).update
    if live is not None:
        live.__enter__()
    store = RunStore(run_dir)
    try:
        while True:
            # The lock first: a driver writes its last progress before it lets go of the run
            # directory, so a free lock and then a read sees the end of the sweep.
            driver_running = store.is_locked()
            progress = read_progress(run_dir)
            if progress is not None:
                show(progress)
            if not driver_running:
                if progress is not None and progress.finished:
                    return 0
                if live is not None:
                    live.__exit__(None, None, None)
                    live = None
                message = ("no sweep is running there" if progress is None else
                           f"its driver stopped without finishing (last update "
                           f"{progress.updated_at or progress.started_at})")
                print(f"quantdask: {run_dir}: {message}", file=stream or console.file)
                return 1
            time.sleep(interval_s)
    finally:
        if live is not None:
            live.__exit__(None, None, None)
