"""A run directory in MLflow: one MLflow run per job, children of a parent run that holds the
run's report and Parquet files (``quantdask export mlflow RUN_DIR``, ``qd.export_mlflow``).

Each job's run (done, failed and skipped jobs alike; a failed job's run ends FAILED in MLflow,
the others FINISHED) holds:

- tags: ``quantdask.job_id``, ``model``, ``backend``, ``config_label``, ``status``, ``sweep``,
  ``failure_class`` (when set), ``quantdask.finished_at`` and ``quantdask.run_dir``;
- parameters: its config's options (``option.<name>``), ``model``, ``backend``, ``config_label``;
- metrics: every numeric figure of its results row, its task scores (``task.<task>.<metric>``
  and ``task.<task>.<metric>.recovery``; ``.<filter>`` after the metric when lm-eval's filter is
  not ``none``) and its speed (``speed.b<batch>.<column>``).

Idempotent by job id, per (experiment, run directory): a job whose run is there with the same
``quantdask.finished_at`` is skipped, so exporting twice adds nothing and exporting a resumed
sweep adds its new jobs only. A job whose result changed since (failed, then done on a rerun)
gets a new run, and its earlier run stays, tagged ``quantdask.superseded`` = true: what was
exported is kept, and the job's latest result is its run without that tag. A job run that an
interrupted export left unfinished (RUNNING) is deleted and exported again. The parent's files
are sent when they are missing there or differ in size.

MLflow is imported only when called (``pip install 'quantdask[mlflow]'``), and only through
``MlflowClient``: a user's active run is left alone. MLflow 3 refuses a ``file:`` store unless
``MLFLOW_ALLOW_FILE_STORE`` is true; an export to one (the default ``./mlruns`` included) sets it
while it runs, unless it is set already.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import polars as pl

from quantdask.errors import RunDirError, SpecError
from quantdask.store.readers import read_speed
from quantdask.store.run_store import RunStore
from quantdask.store.schema import FRAMES
from quantdask.words import NO_FILTER, Status

JOB_TAG = "quantdask.job_id"
RUN_DIR_TAG = "quantdask.run_dir"
PARENT_TAG = "quantdask.parent"
FINISHED_TAG = "quantdask.finished_at"
SUPERSEDED_TAG = "quantdask.superseded"
PARENT_RUN_TAG = "mlflow.parentRunId"
JOB_TAGS = ("model", "backend", "config_label", "status", "sweep", "failure_class")
JOB_PARAMS = ("model", "backend", "config_label")
ARTIFACT_DIRS = tuple(frame.name for frame in FRAMES if frame.exported)
SPEED_METRICS = ("decode_tokens_per_s", "ttft_s", "decode_speedup")
INSTALL = "pip install 'quantdask[mlflow]'"
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"

_NOT_IN_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")  # MLflow's metric and param key characters
_PARAMS_PER_BATCH = 100  # MLflow's limits per log_batch
_METRICS_PER_BATCH = 1000


@dataclass(frozen=True)
class ExportSummary:
    """What one export did: where it went, and how many job runs it created or skipped."""

    experiment_id: str
    experiment: str
    tracking_uri: str
    parent_run_id: str
    created: int  # job runs added (new jobs, and new results of jobs exported before)
    skipped: int  # jobs exported before with the same result
    superseded: int = 0  # earlier runs of jobs whose result changed, tagged superseded


def export_mlflow(run_dir: str | os.PathLike, tracking_uri: str | None = None,
                  experiment: str | None = None) -> ExportSummary:
    """Export ``run_dir`` to MLflow at ``tracking_uri`` (default: ``MLFLOW_TRACKING_URI`` or
    the URI set with ``mlflow.set_tracking_uri``, else ``./mlruns``), into the experiment
    ``experiment`` (default: the sweep's name, created when missing). See the module's
    docstring for what each run holds and how a second export adds only what is new.

    >>> qd.export_mlflow("runs/demo", "file:./mlruns")  # doctest: +SKIP
    ExportSummary(experiment_id='...', experiment='demo', ..., created=7, skipped=0, ...)
    """
    store = _existing_run_dir(run_dir)
    mlflow = _mlflow()
    uri = _tracking_uri(mlflow, tracking_uri)
    with _file_store_allowed(uri):
        client = _client(mlflow.MlflowClient, uri)
        results = store.read_results()
        name = experiment or _sweep_name(results, store.root)
        experiment_id = _experiment_id(client, name)
        root = str(store.root.resolve())
        runs = _runs_of(client, experiment_id, root)
        parent_id = _parent_id(client, experiment_id, root, runs)
        counts = _export_jobs(client, experiment_id, parent_id, root, results,
                              _task_and_speed_metrics(store), runs)
        _send_files(client, parent_id, store)
        client.set_terminated(parent_id, "FINISHED")
    return ExportSummary(experiment_id, name, uri, parent_id, *counts)


def _existing_run_dir(run_dir: str | os.PathLike) -> RunStore:
    if not os.path.isdir(run_dir):
        raise RunDirError(f"no run directory at {run_dir}")
    store = RunStore(run_dir)
    if not store.is_run_dir():
        raise RunDirError(f"{run_dir} is not a run directory (it has no results/); "
                          "give the --run-dir of a sweep")
    return store


def _mlflow():
    try:
        import mlflow
    except ImportError:
        raise SpecError("mlflow", "exporting to MLflow needs mlflow (mlflow-skinny is enough): "
                                  f"{INSTALL}") from None
    return mlflow


def _tracking_uri(mlflow, given: str | None) -> str:
    """``given``, else MLflow's when one is set (environment or ``mlflow.set_tracking_uri``),
    else ``./mlruns``: MLflow's own default is now a SQLite database, which mlflow-skinny
    cannot open (no SQLAlchemy)."""
    if given:
        return given
    if mlflow.is_tracking_uri_set():
        return mlflow.get_tracking_uri()
    return Path("mlruns").resolve().as_uri()


def _is_local(uri: str) -> bool:
    return urlparse(uri).scheme in ("", "file")


@contextlib.contextmanager
def _file_store_allowed(uri: str):
    """MLflow 3 refuses a ``file:`` store unless told it is wanted: a ``file:`` URI given (or
    the default ./mlruns) is that, for this export, unless the environment says otherwise."""
    if not _is_local(uri) or ALLOW_FILE_STORE in os.environ:
        yield
        return
    os.environ[ALLOW_FILE_STORE] = "true"
    try:
        yield
    finally:
        os.environ.pop(ALLOW_FILE_STORE, None)


def _client(client_class, uri: str):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException

    try:
        return client_class(tracking_uri=uri)
    except UnsupportedModelRegistryStoreURIException:
        why = ("this MLflow has no store for that scheme; give a file: directory or an "
               "http(s):// MLflow server (a database URI needs the full mlflow, with SQLAlchemy)")
    except MlflowException as err:
        why = str(err.message).strip().splitlines()[0].split(". ")[0]
        if _is_local(uri) and ALLOW_FILE_STORE in os.environ:
            why += f" ({ALLOW_FILE_STORE}={os.environ[ALLOW_FILE_STORE]} refuses a file store)"
    raise SpecError("tracking_uri", f"MLflow cannot use {uri}: {why}")


def _sweep_name(results: pl.DataFrame, root: Path) -> str:
    """The sweep recorded most often (the first by name when tied); the directory's name for a
    run directory with no job recorded yet."""
    if results.is_empty():
        return root.resolve().name
    counts = results.group_by("sweep").len().sort(["len", "sweep"], descending=[True, False])
    return counts["sweep"][0]


def _experiment_id(client, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is None:
        return client.create_experiment(name)
    if found.lifecycle_stage == "deleted":
        raise SpecError("experiment", f"the MLflow experiment {name!r} is deleted: restore it "
                                      "(mlflow experiments restore) or give another --experiment")
    return found.experiment_id


def _quoted(value: str) -> str:
    """``value`` as a string literal of MLflow's search syntax."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise RunDirError(f"{value} holds both quote characters, which MLflow's search cannot "
                      "match; move the run directory to a path without them")


def _runs_of(client, experiment_id: str, root: str) -> list:
    """Every active run of the experiment exported from the run directory ``root``: its parent
    and its job runs (deleted runs are not seen: a job whose run was deleted is sent again)."""
    query = f"tags.`{RUN_DIR_TAG}` = {_quoted(root)}"
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=query, max_results=1000,
                                  page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _parent_id(client, experiment_id: str, root: str, runs: list) -> str:
    """The run directory's parent run in the experiment (the first made, should two exports
    have raced), made now when there is none."""
    parents = sorted((r for r in runs if r.data.tags.get(PARENT_TAG) == "true"),
                     key=lambda r: r.info.start_time)
    if parents:
        return parents[0].info.run_id
    run = client.create_run(experiment_id, run_name=Path(root).name,
                            tags={RUN_DIR_TAG: root, PARENT_TAG: "true"})
    return run.info.run_id


def _export_jobs(client, experiment_id: str, parent_id: str, root: str, results: pl.DataFrame,
                 extra: dict[str, dict[str, float]], runs: list) -> tuple[int, int, int]:
    """A run for each job of ``results`` not exported with its present result; returns how
    many runs were created, how many jobs skipped, and how many earlier runs superseded."""
    earlier: dict[str, list] = {}
    for run in runs:
        tags = run.data.tags
        if (JOB_TAG in tags and tags.get(PARENT_RUN_TAG) == parent_id
                and tags.get(SUPERSEDED_TAG) != "true"):
            earlier.setdefault(tags[JOB_TAG], []).append(run)
    numeric = [c for c, dtype in results.schema.items() if dtype in (pl.Int64, pl.Float64)]
    created = skipped = superseded = 0
    for row in results.to_dicts():
        finished = row["finished_at"].isoformat()
        kept = []
        for run in earlier.get(row["job_id"], []):
            if run.info.status == "RUNNING":  # an export cut short: its metrics may be partial
                client.delete_run(run.info.run_id)
            else:
                kept.append(run)
        if any(run.data.tags.get(FINISHED_TAG) == finished for run in kept):
            skipped += 1
            continue
        metrics = {**job_metrics(row, numeric), **extra.get(row["job_id"], {})}
        _export_job(client, experiment_id, parent_id, root, row, metrics)
        for run in kept:
            client.set_tag(run.info.run_id, SUPERSEDED_TAG, "true")
        created += 1
        superseded += len(kept)
    return created, skipped, superseded


def _export_job(client, experiment_id: str, parent_id: str, root: str, row: dict[str, Any],
                metrics: dict[str, float]) -> str:
    """One job's run, under ``parent_id``, ended last (an unended one is an export cut short)."""
    from mlflow.entities import Metric, Param

    tags = {JOB_TAG: row["job_id"], RUN_DIR_TAG: root, PARENT_RUN_TAG: parent_id,
            FINISHED_TAG: row["finished_at"].isoformat(),
            **{k: str(row[k]) for k in JOB_TAGS if row.get(k) is not None}}
    run = client.create_run(experiment_id, start_time=_ms(row["started_at"] or row["queued_at"]),
                            tags=tags, run_name=f"{row['model']} {row['config_label']}")
    run_id = run.info.run_id
    at = _ms(row["finished_at"])
    params = [Param(k, v) for k, v in job_params(row).items()]
    for i in range(0, len(params), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[i:i + _PARAMS_PER_BATCH])
    entries = [Metric(k, v, at, 0) for k, v in metrics.items()]
    for i in range(0, len(entries), _METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=entries[i:i + _METRICS_PER_BATCH])
    ended = "FAILED" if row["status"] == Status.FAILED else "FINISHED"
    client.set_terminated(run_id, ended, end_time=at)
    return run_id


def _ms(when) -> int:
    return int(when.timestamp() * 1000)


def metric_key(name: str) -> str:
    """``name`` with the characters MLflow refuses in a metric or parameter key replaced by
    ``_`` (and no ``/`` where it would make the key a path out of the run)."""
    key = _NOT_IN_KEY.sub("_", name)
    if posixpath.normpath(key) != key or key.startswith(("/", ".")):
        key = key.replace("/", "_").lstrip(".")
    return key or "_"


def job_params(row: dict[str, Any]) -> dict[str, str]:
    """A results row's config as MLflow parameters: ``option.<name>`` for each option (a
    string as it is, anything else as JSON), and the model, backend and config label."""
    options = json.loads(row["config"] or "{}")
    params = {metric_key(f"option.{name}"): value if isinstance(value, str)
              else json.dumps(value) for name, value in options.items()}
    params.update({k: str(row[k]) for k in JOB_PARAMS})
    return params


def job_metrics(row: dict[str, Any], numeric: list[str]) -> dict[str, float]:
    """The ``numeric`` columns of a results row that hold a value, as MLflow metrics."""
    return {metric_key(c): float(row[c]) for c in numeric if row[c] is not None}


def _task_and_speed_metrics(store: RunStore) -> dict[str, dict[str, float]]:
    """Each done job's task scores and speed as metrics, by job id."""
    extra: dict[str, dict[str, float]] = {}
    for row in store.read("tasks").to_dicts():
        name = f"task.{row['task']}.{row['metric']}"
        name += "" if row["filter"] in (None, NO_FILTER) else f".{row['filter']}"
        mine = extra.setdefault(row["job_id"], {})
        for key, value in ((name, row["value"]), (f"{name}.recovery", row["recovery"])):
            if value is not None:
                mine[metric_key(key)] = float(value)
    for row in read_speed(store.root).to_dicts():
        mine = extra.setdefault(row["job_id"], {})
        for column in SPEED_METRICS:
            if row[column] is not None:
                mine[metric_key(f"speed.b{row['batch_size']}.{column}")] = float(row[column])
    return extra


def _send_files(client, run_id: str, store: RunStore) -> None:
    """The run directory's report.html and Parquet files into the parent run's artifacts
    (``results/``, ``layers/``, ...), each one not there yet or there with another size."""
    groups = [("", [store.report_path])]
    groups += [(d, sorted((store.root / d).glob("*.parquet"))) for d in ARTIFACT_DIRS]
    for folder, paths in groups:
        paths = [p for p in paths if p.is_file()]
        if not paths:
            continue
        there = {posixpath.basename(f.path): f.file_size
                 for f in client.list_artifacts(run_id, folder or None) if not f.is_dir}
        for path in paths:
            if there.get(path.name) != path.stat().st_size:
                client.log_artifact(run_id, str(path), folder or None)
