"""What else a machine was doing while a run went on, so a reader can see why one run was slow:
the 1-minute load average as the run ended, and the CPU share of every process outside this one
and its children (the cluster this process started) over the run.

>>> with LoadMeter() as load:  # doctest: +SKIP
...     run_sweep(...)
>>> load.figures()  # doctest: +SKIP
{'load_average': 2.1, 'other_cpu_share': 0.43}
"""

from __future__ import annotations

import os
import time
from typing import Any


class LoadMeter:
    """The machine's load over a block (see the module); read :meth:`figures` after it, while
    the children it counts as this run's own are still alive at its end (a child that died
    during the block counts as another process's time: the share is then an upper bound)."""

    def __enter__(self) -> LoadMeter:
        self._began = time.monotonic()
        self._busy = _busy_seconds()
        self._ours = _own_seconds()
        self._figures: dict[str, Any] = {}
        return self

    def __exit__(self, *exc) -> None:
        wall = time.monotonic() - self._began
        others = (_busy_seconds() - self._busy) - (_own_seconds() - self._ours)
        cores = os.cpu_count() or 1
        self._figures = {"load_average": float(os.getloadavg()[0]),
                         "other_cpu_share": (min(1.0, max(0.0, others / (wall * cores)))
                                             if wall > 0 else None)}

    def figures(self) -> dict[str, Any]:
        """``load_average`` (1-minute, at the end) and ``other_cpu_share`` (0-1 of all cores)."""
        return dict(self._figures)


def _busy_seconds() -> float:
    import psutil

    times = psutil.cpu_times()
    return float(sum(times) - times.idle - getattr(times, "iowait", 0.0))


def _own_seconds() -> float:
    import psutil

    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:  # gone meanwhile
            continue
        total += times.user + times.system + getattr(times, "children_user", 0.0) \
            + getattr(times, "children_system", 0.0)
    return total
