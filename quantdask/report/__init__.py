"""Reports: interactive Altair charts over the run's frames (``charts``; the time account:
``time_charts``; task accuracy and gates:
``tasks``; generation speed: ``speed``; mixed-precision searches: ``search``; charts that
follow a running sweep: ``live_charts``),
tables for people (``tables``), and the notebooks run and exported to one self-contained HTML
file (``html``, with its kernel and template).

``from quantdask import report`` gives the chart and table functions, as the notebooks use them.
They load on first use, so ``import quantdask`` (and the HTML export) never needs Altair.
"""

import importlib

_MODULES = {
    "quantdask.report.charts": (
        "artifacts_table", "device_memory_chart", "job_memory_chart",
        "jobs_table", "layer_error_heatmap", "memory_chart", "memory_timeline_chart",
        "quality_chart"),
    "quantdask.report.time_charts": ("scaling_chart", "time_breakdown_chart", "timeline_chart"),
    "quantdask.report.tasks": ("gates_banner", "recovery_table", "task_chart"),
    "quantdask.report.speed": ("speed_chart", "speedup_table"),
    "quantdask.report.search": ("agreement_table", "answer_markdown", "prediction_chart",
                                "refinement_chart", "search_frontier_chart", "search_table",
                                "sensitivity_chart"),
    "quantdask.search.answer": ("answer_lines", "search_answers"),
    "quantdask.run.scaling": ("scaling_summary",),
    "quantdask.report.live_charts": ("live",),
    "quantdask.report.tables": ("table",),
    "quantdask.store.summary": ("device_summary", "failures_table", "phases_table",
                                "sweep_summary"),
    "quantdask.store.frontier": ("kl_ties", "pareto_frontier"),
    "quantdask.store.figures": ("window_protocol", "with_job_label"),
    "quantdask.store.environment": ("environment_table",),
}
"""Where each function of ``quantdask.report`` lives."""
_HOME = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'quantdask.report' has no attribute {name!r}")
