"""Export to MLflow, offline, into a local ``file:`` store: a real run directory (a sweep with
tasks and speed on the session's cluster) exported twice gives one run per job under one parent,
with the results' metrics, the config as parameters and the Parquet files as the parent's
artifacts; a resumed sweep adds only its new job; a changed result supersedes; the command."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import sys

import polars as pl
import pytest

import quantdask as qd
from quantdask.cli.main import main
from quantdask.demo_model import DEMO_TASKS_DIR
from quantdask.store.mlflow_export import metric_key
from quantdask.store.run_store import RunStore
from quantdask.store.validation import ALWAYS_REQUIRED
from quantdask.words import FailureClass, Status
from tests.conftest import sweep_dict

pytestmark = pytest.mark.timeout(300)

ALLOW = "MLFLOW_ALLOW_FILE_STORE"


def sweep(bits: list[int]) -> qd.Sweep:
    return qd.sweep_from_dict(sweep_dict(
        backends=[{"backend": "bitsandbytes", "grid": {"bits": bits}}],
        tasks={"names": ["demo_facts"], "include_path": DEMO_TASKS_DIR, "limit": 8},
        speed={"prompt_length": 8, "new_tokens": 2, "batch_sizes": [1], "warmup": 0,
               "repeats": 1}))


@pytest.fixture(scope="module")
def run_dir(cluster, tmp_path_factory):
    """A 2-job run directory (baseline and nf4) with task and speed rows, and a report.html."""
    path = tmp_path_factory.mktemp("mlflow") / "run"
    results = qd.run_sweep(sweep([4]), path, cluster.client)
    assert results["status"].to_list() == ["done"] * 2
    (path / "report.html").write_text("<html>the report</html>")
    return path


def client(uri: str):
    from mlflow.tracking import MlflowClient

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ALLOW, "true")
        return MlflowClient(uri)


def runs(uri: str, experiment: str = "t") -> list:
    """Every active run of ``experiment``, parents and job runs."""
    mlflow = client(uri)
    found = mlflow.get_experiment_by_name(experiment)
    return list(mlflow.search_runs([found.experiment_id], max_results=1000))


def job_runs(uri: str) -> dict[str, list]:
    by_job: dict[str, list] = {}
    for run in runs(uri):
        if "quantdask.job_id" in run.data.tags:
            by_job.setdefault(run.data.tags["quantdask.job_id"], []).append(run)
    return by_job


def copy_of(run_dir, tmp_path):
    return shutil.copytree(run_dir, tmp_path / "copy")


def test_exported_twice_one_run_per_job_with_the_results_metrics(run_dir, tmp_path):
    uri = (tmp_path / "mlruns").as_uri()
    assert ALLOW not in os.environ
    first = qd.export_mlflow(run_dir, uri)
    assert ALLOW not in os.environ  # set only while it ran
    second = qd.export_mlflow(run_dir, uri)
    assert (first.created, first.skipped, second.created, second.skipped) == (2, 0, 0, 2)
    assert first.experiment == "t" and second.parent_run_id == first.parent_run_id
    everything = runs(uri)
    parents = [r for r in everything if r.data.tags.get("quantdask.parent") == "true"]
    assert len(everything) == 3 and [p.info.run_id for p in parents] == [first.parent_run_id]
    assert parents[0].data.tags["quantdask.run_dir"] == str(run_dir.resolve())

    results = qd.read_results(run_dir)
    by_job = job_runs(uri)
    assert sorted(by_job) == sorted(results["job_id"])
    numeric = [c for c, t in results.schema.items() if t in (pl.Int64, pl.Float64)]
    for row in results.to_dicts():
        [run] = by_job[row["job_id"]]
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        assert tags["mlflow.parentRunId"] == first.parent_run_id
        assert {k: tags[k] for k in ("model", "backend", "config_label", "status", "sweep")} == {
            k: row[k] for k in ("model", "backend", "config_label", "status", "sweep")}
        assert run.info.status == "FINISHED"
        expected = {c: float(row[c]) for c in numeric if row[c] is not None}
        assert {"perplexity", "kl_divergence", "top1_agreement", "size_bytes", "wall_s",
                "bits_per_weight"} <= set(expected)
        assert {k: metrics[k] for k in expected} == expected
        assert params["model"] == "demo" and params["config_label"] == row["config_label"]
        if row["backend"] == "bitsandbytes":
            assert params["option.bits"] == "4" and params["option.quant_type"] == "nf4"
    tasks = qd.read_tasks(run_dir)
    assert set(tasks["job_id"]) == set(results["job_id"])
    for row in tasks.to_dicts():
        metrics = by_job[row["job_id"]][0].data.metrics
        assert metrics[f"task.demo_facts.{row['metric']}"] == row["value"]
        assert metrics[f"task.demo_facts.{row['metric']}.recovery"] == row["recovery"]
    speed = qd.read_speed(run_dir)
    assert speed.height == 2
    for row in speed.to_dicts():
        metrics = by_job[row["job_id"]][0].data.metrics
        for column in ("decode_tokens_per_s", "ttft_s", "decode_speedup"):
            assert metrics[f"speed.b1.{column}"] == row[column]

    mlflow = client(uri)
    sent = {f.path for f in mlflow.list_artifacts(first.parent_run_id)}
    assert {"report.html", "results", "layers", "windows", "tasks", "speed", "phases",
            "attempts", "sessions"} <= sent
    sent_results = {f.path for f in mlflow.list_artifacts(first.parent_run_id, "results")}
    assert sent_results == {f"results/{p.name}" for p in (run_dir / "results").glob("*.parquet")}


def test_a_resumed_sweep_adds_only_its_new_job(run_dir, cluster, tmp_path):
    again = copy_of(run_dir, tmp_path)
    uri = (tmp_path / "mlruns").as_uri()
    assert qd.export_mlflow(again, uri).created == 2
    before = job_runs(uri)
    results = qd.run_sweep(sweep([4, 8]), again, cluster.client)
    assert results.height == 3 and set(before) < set(results["job_id"])
    summary = qd.export_mlflow(again, uri)
    assert (summary.created, summary.skipped, summary.superseded) == (1, 2, 0)
    after = job_runs(uri)
    assert sorted(after) == sorted(results["job_id"])
    assert {j: [r.info.run_id for r in rs] for j, rs in before.items()} == {
        j: [r.info.run_id for r in after[j]] for j in before}
    [new] = set(after) - set(before)
    assert after[new][0].data.params["option.bits"] == "8"
    sent = {f.path for f in client(uri).list_artifacts(summary.parent_run_id, "results")}
    assert len(sent) == 3  # the new job's result file was sent too


def test_a_job_failed_then_done_gets_a_new_run_and_the_failed_one_is_superseded(run_dir,
                                                                               tmp_path):
    again = copy_of(run_dir, tmp_path)
    store = RunStore(again)
    done = store.read_results().filter(pl.col("backend") == "bitsandbytes").to_dicts()[0]
    failed = {k: done[k] for k in ALWAYS_REQUIRED} | {
        "status": Status.FAILED, "finished_at": done["finished_at"] - dt.timedelta(minutes=5),
        "failure_class": FailureClass.JOB_ERROR, "error_class": "RuntimeError",
        "error_message": "boom"}
    store.write_result(failed)
    uri = (tmp_path / "mlruns").as_uri()
    assert qd.export_mlflow(again, uri).created == 2
    [first] = job_runs(uri)[done["job_id"]]
    assert first.info.status == "FAILED" and first.data.tags["failure_class"] == "job_error"
    assert "perplexity" not in first.data.metrics and first.data.tags["status"] == "failed"

    store.write_result(done)  # the rerun's result
    summary = qd.export_mlflow(again, uri)
    assert (summary.created, summary.skipped, summary.superseded) == (1, 1, 1)
    runs_of_job = {r.info.run_id: r for r in job_runs(uri)[done["job_id"]]}
    assert runs_of_job[first.info.run_id].data.tags["quantdask.superseded"] == "true"
    [latest] = [r for r in runs_of_job.values() if "quantdask.superseded" not in r.data.tags]
    assert latest.info.status == "FINISHED" and latest.data.tags["status"] == "done"
    assert latest.data.metrics["perplexity"] == done["perplexity"]
    assert qd.export_mlflow(again, uri).created == 0


def test_a_run_an_interrupted_export_left_unfinished_is_exported_again(run_dir, tmp_path):
    uri = (tmp_path / "mlruns").as_uri()
    qd.export_mlflow(run_dir, uri)
    job_id, [cut] = next(iter(job_runs(uri).items()))
    client(uri).update_run(cut.info.run_id, status="RUNNING")
    summary = qd.export_mlflow(run_dir, uri)
    assert (summary.created, summary.skipped) == (1, 1)
    [redone] = job_runs(uri)[job_id]
    assert redone.info.run_id != cut.info.run_id and redone.info.status == "FINISHED"


def test_the_command_exports_and_says_what_it_did(run_dir, tmp_path, capsys, monkeypatch):
    uri = (tmp_path / "mlruns").as_uri()
    assert main(["export", "mlflow", str(run_dir), "--tracking-uri", uri]) == 0
    assert main(["export", "mlflow", str(run_dir), "--tracking-uri", uri,
                 "--experiment", "other"]) == 0
    assert main(["export", "mlflow", str(run_dir), "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("mlflow: 2 job runs created, 0 already exported; experiment 't'")
    assert f"at {uri}, parent run" in out[0]
    assert "experiment 'other'" in out[1] and out[2].startswith("mlflow: 0 job runs created, 2")
    assert len(runs(uri, "other")) == 3
    # Without --tracking-uri nor MLFLOW_TRACKING_URI: ./mlruns.
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["export", "mlflow", str(run_dir)]) == 0
    assert f"at {(tmp_path / 'cwd' / 'mlruns').as_uri()}," in capsys.readouterr().out
    assert len(runs((tmp_path / "cwd" / "mlruns").as_uri())) == 3
    assert main(["export", "mlflow", str(tmp_path / "none"), "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err.strip() == (
        f"quantdask: error: no run directory at {tmp_path / 'none'}")


def test_without_mlflow_the_export_is_refused_with_the_install_command(run_dir, tmp_path,
                                                                        capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    uri = (tmp_path / "mlruns").as_uri()
    assert main(["export", "mlflow", str(run_dir), "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'quantdask[mlflow]'" in err
    assert not (tmp_path / "mlruns").exists()


def test_keys_mlflow_refuses_are_made_safe():
    assert metric_key("task.demo_facts.exact_match,strict") == "task.demo_facts.exact_match_strict"
    assert metric_key("speed.b8.ttft_s") == "speed.b8.ttft_s"
    assert metric_key("a//b") == "a__b" and metric_key("../up") == "_up"
    assert metric_key("/abs") == "_abs" and metric_key(".") == "_"
