"""quantdask: quantize language models across every GPU of a Dask cluster and compare the results.

>>> import quantdask as qd
>>> sweep = qd.load_sweep("data/demo_sweep.yaml")
>>> with qd.start_cluster(workers=2) as cluster:  # doctest: +SKIP
...     results = qd.run_sweep(sweep, "runs/demo", cluster.client)
"""

from quantdask.backends import (
    Backend,
    BackendOptions,
    Option,
    backend_names,
    get_backend,
    option,
    register_backend,
)
from quantdask.cluster.local import Adapt, ClusterHandle, start_cluster, tls_security
from quantdask.driver.placement import estimate_device_memory, place_jobs
from quantdask.driver.progress import read_progress
from quantdask.driver.scaling import read_scaling, scale_sweep
from quantdask.driver.sweep import run_sweep
from quantdask.errors import (
    PlacementError,
    QuantdaskError,
    SchemaError,
    SpecError,
    UnsupportedHere,
)
from quantdask.report.html import execute_notebook, write_report
from quantdask.spec.gates import Gate
from quantdask.spec.model import ModelSpec
from quantdask.spec.settings import EvalSettings
from quantdask.spec.speed import SpeedSettings
from quantdask.spec.sweep import BackendBlock, Job, Sweep, expand_grid
from quantdask.spec.sweep_file import load_sweep, sweep_from_dict
from quantdask.spec.tasks import TaskSettings
from quantdask.store.frontier import kl_ties, pareto_frontier
from quantdask.store.run_store import (
    read_attempts,
    read_device_samples,
    read_layers,
    read_results,
    read_sessions,
    read_tasks,
    read_windows,
)
from quantdask.store.speed import read_speed
from quantdask.store.summary import device_summary, job_status, sweep_summary

__version__ = "0.1.0"

__all__ = [
    "Adapt", "Backend", "BackendBlock", "BackendOptions", "ClusterHandle", "EvalSettings", "Gate",
    "Job",
    "ModelSpec", "Option", "PlacementError", "QuantdaskError", "SchemaError", "SpecError", "Sweep",
    "UnsupportedHere", "backend_names", "device_summary", "estimate_device_memory",
    "execute_notebook", "expand_grid", "get_backend", "job_status", "kl_ties", "load_sweep",
    "option", "pareto_frontier", "place_jobs", "read_attempts", "read_device_samples",
    "read_layers", "read_progress", "read_results", "read_scaling", "read_sessions", "read_speed",
    "read_tasks",
    "read_windows",
    "register_backend", "run_sweep", "scale_sweep", "start_cluster", "sweep_from_dict",
    "sweep_summary", "SpeedSettings", "TaskSettings", "tls_security", "write_report",
]
