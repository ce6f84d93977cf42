"""Task accuracy and gates in sweeps on a real local cluster: every job's task rows beside its
model's baseline, the baseline's tasks scored once per model, gates recorded and re-checked,
exit 3 from `quantdask run` and `quantdask status`, truncation flagged in the report."""

from __future__ import annotations

import polars as pl
import pytest

import quantdask as qd
from quantdask.cli import main
from quantdask.demo_model import DEMO_TASKS_DIR
from quantdask.spec.sweep_file import sweep_from_dict
from quantdask.worker.reference import BASELINE_TASKS_TOPIC
from tests.conftest import sweep_dict
from tests.kl_models import REALISTIC_EVAL_TEXT, REALISTIC_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TASKS = {"names": ["demo_facts"], "include_path": DEMO_TASKS_DIR, "limit": 24}
NO_KL = {"gate": "kl_divergence <= 1e-12", "model": "demo"}  # every quantized demo job fails


def two_model_sweep(gates: list) -> dict:
    data = sweep_dict(tasks=TASKS, gates=gates,
                      backends=[{"backend": "bitsandbytes", "grid": {"bits": [4, 8]}}])
    data["models"].append({"name": "realistic", "path": REALISTIC_MODEL})
    data["eval"]["text"] = REALISTIC_EVAL_TEXT  # both tokenizers read it (the demo's: bytes)
    return data


def scored(cluster, model: str) -> int:
    """How many times a worker scored ``model``'s baseline tasks in this session."""
    return sum(msg["key"] == model for _, msg in cluster.client.get_events(BASELINE_TASKS_TOPIC))


def test_every_job_gets_task_rows_beside_its_baseline_scored_once_per_model(
        cluster, tmp_path, capsys):
    run_dir = tmp_path / "run"
    before = {m: scored(cluster, m) for m in ("demo", "realistic")}
    sweep = sweep_from_dict(two_model_sweep([NO_KL, "task_value >= 0"]))
    results = qd.run_sweep(sweep, run_dir, cluster.client)
    assert results["status"].to_list() == ["done"] * 6
    # Three jobs per model, one baseline scoring per model.
    assert {m: scored(cluster, m) - before[m] for m in before} == {"demo": 1, "realistic": 1}

    tasks = qd.read_tasks(run_dir).join(results.select("job_id", "model", "backend"),
                                        on="job_id")
    assert tasks.height == 6 * 2  # acc and acc_norm of demo_facts, every job
    assert set(tasks["samples"]) == {24} and set(tasks["truncated_samples"]) == {0}
    baselines = tasks.filter(pl.col("backend") == "none").select(
        "model", "metric", pl.col("value").alias("own"))
    joined = tasks.join(baselines, on=["model", "metric"])
    assert (joined["baseline_value"] == joined["own"]).all()
    assert joined["recovery"].to_list() == pytest.approx(
        (joined["value"] / joined["baseline_value"]).to_list())

    quantized = results.filter(pl.col("backend") != "none")
    assert (quantized["tasks_s"] > 0).all() and (quantized["tasks_peak_host_rss_bytes"] > 0).all()
    assert (quantized["eval_s"] < quantized["wall_s"]).all()
    gates = sorted((r["model"], r["config_label"], r["gates_passed"]) for r in results.to_dicts())
    assert gates == [("demo", "baseline", None), ("demo", "int8 t=6", False),
                     ("demo", "nf4", False), ("realistic", "baseline", None),
                     ("realistic", "int8 t=6", True), ("realistic", "nf4", True)]
    failed = results.filter(pl.col("gates_passed").eq(False))["gates_failed"].to_list()
    assert all(reason.startswith("kl_divergence <= 1e-12 (model demo): kl_divergence is ")
               for reason in failed)

    capsys.readouterr()
    assert main(["status", str(run_dir)]) == 3
    out = capsys.readouterr().out
    assert out.count("gate failed: ") == 2 and "2 done jobs failed a gate (exit 3)" in out

    # Other gates: nothing runs again (no baseline scored again), the verdicts are re-checked.
    again = qd.run_sweep(sweep_from_dict(two_model_sweep(["task_value >= 0"])), run_dir,
                         cluster.client)
    assert {m: scored(cluster, m) - before[m] for m in before} == {"demo": 1, "realistic": 1}
    assert again.filter(pl.col("backend") != "none")["gates_passed"].to_list() == [True] * 4
    assert main(["status", str(run_dir)]) == 0


def test_quantdask_run_exits_3_when_a_done_job_fails_a_gate(cluster, write_sweep, tmp_path,
                                                            capsys):
    data = sweep_dict(tasks=TASKS, gates=["kl_divergence <= 1e-12"])
    status = main(["run", write_sweep(data), "--scheduler", cluster.client.scheduler.address,
                   "--run-dir", str(tmp_path / "run"), "--no-report"])
    out = capsys.readouterr().out
    assert status == 3, out
    assert "2 jobs: 2 done" in out and "gate failed: " in out and "nf4" in out


def test_truncated_prompts_are_flagged_in_the_frame_and_the_report(cluster, tmp_path):
    run_dir = tmp_path / "run"
    data = sweep_dict(tasks={**TASKS, "max_length": 12})
    results = qd.run_sweep(sweep_from_dict(data), run_dir, cluster.client)
    tasks = qd.read_tasks(run_dir)
    assert (tasks["truncated_samples"] > 0).all()
    per_job = dict(tasks.filter(pl.col("metric") == "acc")
                   .select("job_id", "truncated_samples").iter_rows())
    assert dict(results.select("job_id", "tasks_truncated_samples").iter_rows()) == per_job
    table = qd.report.recovery_table(results, tasks)
    assert table["truncation"].str.starts_with("TRUNCATED:").all()
    html = qd.write_report(run_dir).read_text()
    assert "TRUNCATED PROMPTS" in html  # the task chart's title, in red
    assert "Gates:</b> none set" in html
