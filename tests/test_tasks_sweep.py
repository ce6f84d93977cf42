"""Task accuracy and gates in sweeps on a real local cluster: every job's task rows beside its
model's baseline, the baseline's tasks scored once per model, gates recorded and re-checked,
exit 3 from `quantdask run` and `quantdask status`, truncation flagged in the report, the
closing summary's task scores and gate verdict, a failed baseline scoring kept to the baseline."""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import pytest

import quantdask as qd
from quantdask.cli import main
from quantdask.demo_model import DEMO_TASKS_DIR
from quantdask.measure.reference import BASELINE_TASKS_TOPIC
from quantdask.sweepfile.sweep_file import sweep_from_dict
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
    data = sweep_dict(tasks=TASKS, gates=["kl_divergence <= 1e-12", "task_value >= 0"])
    status = main(["run", write_sweep(data), "--scheduler", cluster.client.scheduler.address,
                   "--run-dir", str(tmp_path / "run"), "--no-report"])
    out = capsys.readouterr().out
    assert status == 3, out
    assert "2 jobs: 2 done" in out and "gate failed: " in out and "nf4" in out
    # Issue 39 item 4: the terminal says what the report says. Each config's task scores, as
    # the report's recovery table has them: score ± standard error, the baseline's, recovery.
    lines = out.splitlines()
    start = lines.index("task accuracy (score ± standard error; recovery = the share of the "
                        "baseline's score kept):")
    assert lines[start + 1].split() == ["model", "config", "task", "metric", "score",
                                        "baseline", "recovery", "samples", "note"]
    shown = [line.split() for line in lines[start + 2:start + 6]]
    results = qd.read_results(tmp_path / "run")
    labels = dict(results.select("job_id", "config_label").iter_rows())
    tasks = qd.read_tasks(tmp_path / "run")
    assert tasks.height == 4
    for row in tasks.to_dicts():
        score = f"{round(row['value'], 4)} ± {round(row['stderr'], 4)}".split()
        expected = ["demo", labels[row["job_id"]], "demo_facts", row["metric"], *score,
                    str(round(row["baseline_value"], 4)),
                    f"{round(row['recovery'] * 100, 2):.1f}%", "24", "-"]
        assert expected in shown, (expected, shown)
    # The gates' verdict: which passed, which failed and why.
    at = lines.index("gates: FAILED: 1 of 1 quantized configs fail a gate (0 pass them all)")
    assert [line.split() for line in lines[at + 1:at + 4]] == [
        ["gate", "met_by", "failed_by"],
        ["kl_divergence", "<=", "1e-12", "0", "of", "1", "1", "of", "1"],
        ["task_value", ">=", "0", "1", "of", "1", "-"]]
    nf4 = results.filter(pl.col("config_label") == "nf4").row(0, named=True)
    assert (f"gate failed: {nf4['job_id']} demo nf4: kl_divergence <= 1e-12: kl_divergence "
            f"is {nf4['kl_divergence']:.4g}") in lines


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


def broken_on_the_baseline(folder: Path, marker: Path) -> str:
    """The demo task in ``folder``, whose docs' preparation raises whenever it runs in the
    reference's part that scores the unquantized model (Dask key ``...-tasks``), every time,
    and touches ``marker`` when it does. Returns the include_path."""
    shutil.copytree(Path(DEMO_TASKS_DIR) / "demo_facts", folder / "demo_facts")
    with (folder / "demo_facts" / "demo_facts.yaml").open("a") as yaml_file:
        yaml_file.write("process_docs: !function broken.on_the_baseline\n")
    (folder / "demo_facts" / "broken.py").write_text(
        "from pathlib import Path\n\nfrom distributed import get_worker\n\n\n"
        "def on_the_baseline(dataset):\n"
        "    if str(get_worker().get_current_task()).endswith('-tasks'):\n"
        f"        Path({str(marker)!r}).touch()\n"
        "        raise RuntimeError('the task broke on the unquantized model')\n"
        "    return dataset\n")
    return str(folder)


def test_a_failed_baseline_scoring_leaves_the_reference_and_the_quantized_jobs_standing(
        cluster, write_sweep, tmp_path, capsys):
    # Issue 39 item 5. Before: the reference failed with the baseline's tasks, and every job
    # of the model with it (status 1, both jobs failed).
    marker, run_dir = tmp_path / "broke", tmp_path / "run"
    tasks = {**TASKS, "include_path": broken_on_the_baseline(tmp_path / "tasks", marker)}
    data = sweep_dict(tasks=tasks, gates=[{"gate": "recovery >= 0.95", "task_metric": "acc"}])
    status = main(["run", write_sweep(data), "--scheduler", cluster.client.scheduler.address,
                   "--run-dir", str(run_dir), "--no-report"])
    out = capsys.readouterr().out
    assert marker.exists() and status == 3, out  # no job failed; nf4 fails its recovery gate
    error = "RuntimeError: the task broke on the unquantized model"
    results = qd.read_results(run_dir)
    assert results["status"].to_list() == ["done", "done"]
    baseline, nf4 = (results.filter(pl.col("backend") == b).row(0, named=True)
                     for b in ("none", "bitsandbytes"))
    assert baseline["tasks_error"] == error and baseline["perplexity"] > 0
    assert nf4["tasks_error"] is None and nf4["tasks_s"] > 0 and nf4["kl_divergence"] > 0
    rows = qd.read_tasks(run_dir)
    assert rows["job_id"].to_list() == [nf4["job_id"]] * 2  # the baseline has none
    assert rows["value"].is_not_null().all() and rows["recovery"].is_null().all()
    reason = f"the baseline's task scoring failed: {error}"
    assert set(rows["recovery_reason"]) == {reason}
    # The report's recovery table and the terminal say it; so does the failing gate.
    table = qd.report.recovery_table(results, rows)
    assert table["note"].to_list() == [f"no task scores: {error}", reason, reason]
    assert "no task scores" in qd.report.table(table).as_raw_html()
    lines = out.splitlines()
    start = lines.index("task accuracy (score ± standard error; recovery = the share of the "
                        "baseline's score kept):")
    assert lines[start + 2].split() == ["demo", "baseline", *"-" * 6, "no", "task",
                                        "scores:", *error.split()]
    assert all(line.endswith(f"  {reason}") for line in lines[start + 3:start + 5])
    assert (f"gate failed: {nf4['job_id']} demo nf4: recovery [acc] >= 0.95: demo_facts acc "
            f"was not measured ({reason})") in lines
