"""quantdask: quantize language models across every GPU of a Dask cluster and compare the results.

>>> import quantdask as qd
>>> sweep = qd.load_sweep("data/demo_sweep.yaml")
>>> with qd.start_cluster(workers=2) as cluster:  # doctest: +SKIP
...     handle = qd.submit_sweep(sweep, "runs/demo", cluster.client)  # returns at once
...     results = handle.wait()             # or qd.run_sweep(...): the same, blocking
"""

# The capabilities register themselves with the core as they are imported (``run.stages``,
# ``job.phases``, ``measure.logits``): importing quantdask, as every worker does before it
# unpickles a task, makes them all available.
import quantdask.gguf  # noqa: F401  (registers the gguf backend)
import quantdask.search  # noqa: F401  (registers its stage)
import quantdask.stream  # noqa: F401  (registers its phases)
from quantdask.backends import (
    Backend,
    BackendOptions,
    Option,
    backend_names,
    get_backend,
    option,
    register_backend,
)
from quantdask.cluster.adapt import Adapt
from quantdask.cluster.local import ClusterHandle, start_cluster, tls_security
from quantdask.comparison.compare import Comparison, compare
from quantdask.errors import (
    PlacementError,
    QuantdaskError,
    SchemaError,
    SpecError,
    UnsupportedHere,
)
from quantdask.plan.placement import estimate_device_memory, place_jobs
from quantdask.randomness import job_generator
from quantdask.report.html import execute_notebook, write_report
from quantdask.run.handle import SweepHandle
from quantdask.run.progress import read_progress
from quantdask.run.scaling import read_scaling, scale_sweep
from quantdask.run.sweep import run_sweep
from quantdask.run.sweep import submit_sweep as _submit_sweep
from quantdask.search.agreement import read_allocation
from quantdask.search.export import Exported, export_allocation
from quantdask.store.frontier import kl_ties, pareto_frontier
from quantdask.store.mlflow_export import ExportSummary, export_mlflow
from quantdask.store.readers import (
    read_attempts,
    read_device_samples,
    read_environment,
    read_layers,
    read_results,
    read_sessions,
    read_speed,
    read_tasks,
    read_windows,
    read_worker_tasks,
)
from quantdask.store.run_store import read_frame, read_frames
from quantdask.store.summary import device_summary, job_status, sweep_summary
from quantdask.sweepfile.gates import Gate
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.settings import EvalSettings
from quantdask.sweepfile.speed import SpeedSettings
from quantdask.sweepfile.sweep import BackendBlock, Job, Sweep, expand_grid
from quantdask.sweepfile.sweep_file import load_sweep, sweep_from_dict
from quantdask.sweepfile.tasks import TaskSettings

__version__ = "0.1.0"


def submit_sweep(sweep: Sweep, run_dir, client, on_result=None,
                 on_progress=None) -> SweepHandle:
    """Start ``sweep`` in the background of this process and return its
    :class:`SweepHandle` at once (see :func:`quantdask.run.sweep.submit_sweep`); the
    handle's ``report()`` writes the run's HTML report."""
    return _submit_sweep(sweep, run_dir, client, on_result, on_progress, reporter=write_report)

__all__ = [
    "Adapt", "Backend", "BackendBlock", "BackendOptions", "ClusterHandle", "Comparison",
    "EvalSettings", "Gate", "compare",
    "Job",
    "ModelSpec", "Option", "PlacementError", "QuantdaskError", "SchemaError", "SpecError", "Sweep",
    "UnsupportedHere", "backend_names", "device_summary", "estimate_device_memory",
    "execute_notebook", "expand_grid", "export_allocation", "export_mlflow", "Exported",
    "ExportSummary", "get_backend",
    "job_generator", "job_status", "kl_ties", "load_sweep",
    "option", "pareto_frontier", "place_jobs", "read_attempts", "read_device_samples",
    "read_allocation", "read_environment", "read_frame", "read_frames",
    "read_layers", "read_progress", "read_results", "read_scaling", "read_sessions", "read_speed",
    "read_tasks",
    "read_windows", "read_worker_tasks",
    "register_backend", "run_sweep", "submit_sweep", "SweepHandle", "scale_sweep",
    "start_cluster", "sweep_from_dict",
    "sweep_summary", "SpeedSettings", "TaskSettings", "tls_security", "write_report",
]
