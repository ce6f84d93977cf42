"""Reports: interactive Altair charts over the run's frames (``charts``), and the notebooks run
and exported to one self-contained HTML file (``html``, with its kernel and template).

``from quantdask import report`` gives the chart and table functions, as the notebooks use them.
"""

from quantdask.report.charts import (
    artifacts_table,
    device_memory_chart,
    failures_table,
    job_memory_chart,
    jobs_table,
    layer_error_heatmap,
    memory_chart,
    memory_timeline_chart,
    quality_chart,
    scaling_chart,
    time_breakdown_chart,
    timeline_chart,
    with_job_label,
)
from quantdask.store.summary import device_summary, pareto_frontier

__all__ = [
    "artifacts_table", "device_memory_chart", "device_summary", "failures_table",
    "job_memory_chart", "jobs_table", "layer_error_heatmap", "memory_chart",
    "memory_timeline_chart", "pareto_frontier", "quality_chart", "scaling_chart",
    "time_breakdown_chart", "timeline_chart", "with_job_label",
]
