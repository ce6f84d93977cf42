"""Reports: interactive Altair charts over the run's frames (``charts``; task accuracy and gates:
``tasks``; generation speed: ``speed``), and the notebooks run
and exported to one self-contained HTML file (``html``, with its kernel and template).

``from quantdask import report`` gives the chart and table functions, as the notebooks use them.
They load on first use, so ``import quantdask`` (and the HTML export) never needs Altair.
"""

import importlib

_CHARTS = (
    "artifacts_table", "device_memory_chart", "failures_table", "job_memory_chart", "jobs_table",
    "layer_error_heatmap", "memory_chart", "memory_timeline_chart", "quality_chart",
    "scaling_chart", "time_breakdown_chart", "timeline_chart", "with_job_label",
)
_TASKS = ("gates_banner", "recovery_table", "task_chart")
_SPEED = ("speed_chart", "speedup_table")
_LIVE = ("live",)
_TABLES = ("table",)
_SUMMARIES = ("device_summary", "sweep_summary")
_FRONTIER = ("kl_ties", "pareto_frontier")

__all__ = [*_CHARTS, *_TASKS, *_SPEED, *_LIVE, *_TABLES, *_SUMMARIES, *_FRONTIER]


def __getattr__(name: str):
    if name in _CHARTS:
        return getattr(importlib.import_module("quantdask.report.charts"), name)
    if name in _TASKS:
        return getattr(importlib.import_module("quantdask.report.tasks"), name)
    if name in _TABLES:
        return getattr(importlib.import_module("quantdask.report.tables"), name)
    if name in _LIVE:
        return getattr(importlib.import_module("quantdask.report.live_charts"), name)
    if name in _SPEED:
        return getattr(importlib.import_module("quantdask.report.speed"), name)
    if name in _SUMMARIES:
        return getattr(importlib.import_module("quantdask.store.summary"), name)
    if name in _FRONTIER:
        return getattr(importlib.import_module("quantdask.store.frontier"), name)
    raise AttributeError(f"module 'quantdask.report' has no attribute {name!r}")
