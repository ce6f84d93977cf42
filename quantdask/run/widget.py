"""A sweep handle's live view in JupyterLab: an ipywidgets box that updates itself as the
sweep goes: a bar per status, the running jobs with their workers, the last failures, the time
left and a link to the Dask dashboard. Its widgets' values are its state (tests read them)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from quantdask.util import format_duration
from quantdask.words import Status

if TYPE_CHECKING:
    from quantdask.run.handle import SweepHandle
    from quantdask.run.progress import SweepProgress

BAR_STYLES = {Status.DONE: "success", Status.FAILED: "danger", Status.SKIPPED: "warning"}
FAILURES_SHOWN = 5


class ProgressWidget:
    """The live view of ``handle`` (``.view``, the box to display); updated after each result
    and with each progress update, from the sweep's thread."""

    def __init__(self, handle: SweepHandle):
        import ipywidgets as widgets

        progress = handle.progress
        self.title = widgets.HTML()
        self.bars = {status: widgets.IntProgress(
            min=0, max=max(1, progress.total), description=str(status),
            bar_style=BAR_STYLES[status]) for status in Status}
        self.counts = {status: widgets.Label() for status in Status}
        self.running = widgets.HTML()
        self.probing = widgets.HTML()  # a search's probes, before its jobs join the sweep
        self.failures = widgets.HTML()
        rows = [widgets.HBox([self.bars[s], self.counts[s]]) for s in Status]
        self.view = widgets.VBox([self.title, *rows, self.probing, self.running,
                                  self.failures])
        self._handle = handle
        self.update(progress)
        handle.on_progress(self.update)
        handle.on_result(lambda record: self.update(handle.progress))

    def update(self, progress: SweepProgress) -> None:
        """Show ``progress``: counts, running jobs, failures, time left."""
        handle = self._handle
        state = "running" if not progress.finished else (
            "finished" if progress.completed else "stopped")
        eta = progress.eta_s() if not progress.finished else None
        link = (f' · <a href="{html.escape(progress.dashboard_link)}" target="_blank">Dask '
                f"dashboard</a>" if progress.dashboard_link else "")
        self.title.value = (
            f"<b>sweep {html.escape(progress.sweep)}</b> ({state}): {progress.settled} of "
            f"{progress.total} jobs settled"
            + (f", about {format_duration(eta)} left" if eta else "")
            + f" · <code>{html.escape(str(handle.run_dir))}</code>{link}")
        for status in Status:
            count = progress.counts.get(str(status), 0)
            self.bars[status].value = count
            self.counts[status].value = f"{count} {status}"
        running = sorted(progress.running.values(), key=lambda r: r.started_at)
        self.running.value = ("<b>running</b>: " + ", ".join(
            f"{html.escape(r.label)} on worker {html.escape(str(r.worker))}"
            + (f" (attempt {r.attempt})" if r.attempt > 1 else "") for r in running)
            if running else "<b>running</b>: none")
        self.probing.value = "".join(
            f"<b>probing</b> search {html.escape(name)}: {probed} of {cells} cells<br>"
            for name, (probed, cells) in progress.probing.items())
        last = progress.failures[-FAILURES_SHOWN:]
        self.failures.value = ("<b>last failures</b>:<ul>" + "".join(
            f"<li>{html.escape(f.label)} attempt {f.attempt}: {html.escape(f.failure_class)}: "
            f"{html.escape(f.message)}{' (retrying)' if f.retrying else ''}</li>"
            for f in last) + "</ul>" if last else "")


def progress_view(handle: SweepHandle) -> object:
    """What shows ``handle`` in JupyterLab: a new :class:`ProgressWidget`'s box (the view
    ``submit_sweep`` gives its handles)."""
    return ProgressWidget(handle).view
