"""Charts that keep up with a running sweep: redrawn in JupyterLab after each result.

>>> handle = qd.submit_sweep(sweep, "runs/demo", cluster.client)  # doctest: +SKIP
>>> report.live(handle, report.quality_chart)  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import altair as alt
    import polars as pl

    from quantdask.run.handle import SweepHandle


def live(handle: SweepHandle, chart: Callable[[pl.DataFrame], alt.TopLevelMixin]):
    """An output widget showing ``chart(handle.results)``, drawn now and again after each
    result the sweep records. ``chart`` is any function of the results frame: a report chart
    (``report.quality_chart``), or a lambda that reads more of the run directory
    (``lambda results: report.timeline_chart(qd.read_attempts(run_dir), results)``)."""
    import ipywidgets as widgets

    out = widgets.Output()
    one_at_a_time = threading.Lock()  # the last draw reads the latest results

    def draw(_record: dict | None = None) -> None:
        with one_at_a_time:
            # Setting the outputs (not `with out:`) works from the sweep's thread too.
            out.outputs = ({"output_type": "display_data", "metadata": {},
                            "data": _mime_data(chart(handle.results))},)

    handle.on_result(draw)  # before the first draw: no result falls between the two
    draw()
    return out


def _mime_data(chart: Any) -> dict[str, Any]:
    """The chart's display data as the active Altair renderer makes it."""
    bundle = chart._repr_mimebundle_()
    return bundle[0] if isinstance(bundle, tuple) else bundle
