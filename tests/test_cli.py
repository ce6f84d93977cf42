"""The quantdask command end to end, as a user runs it: real processes, a real cluster."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantdask.cli.main import main
from quantdask.demo_model import DEMO_SWEEP
from quantdask.store.readers import read_results
from quantdask.sweepfile.sweep import expand_grid
from quantdask.sweepfile.sweep_file import load_sweep
from tests.conftest import REPO, sweep_dict

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_run_status_and_plan_on_a_real_cluster(cluster, write_sweep, tmp_path, capsys,
                                                monkeypatch):
    # `quantdask run` on a cluster of its own, to its report at the end, is run end to end by
    # tests/test_install.py (`quantdask demo`, the same path: run, then report, from an
    # installed wheel); as a process of its own on an external scheduler, to its summary and
    # exit 0, by tests/test_multinode.py (over TLS). Here the command runs in this process on
    # the session's cluster, and the program exits with main's status (the quick-exit test).
    sweep = write_sweep(sweep_dict(backends=[{"backend": "bitsandbytes",
                                              "grid": {"bits": [4, 8]}}]))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["run", sweep, "--scheduler", cluster.client.scheduler.address,
                 "--no-report"]) == 0
    out, err = capsys.readouterr()
    assert "2 workers (external); Dask dashboard: http://127.0.0.1:" in out
    assert "3 jobs: 3 done, 0 failed, 0 skipped" in out
    run_dir = tmp_path / "runs" / "t"  # the default: runs/<sweep name>
    assert len(list((run_dir / "results").glob("*.parquet"))) == 3
    assert "report:" not in out and not (run_dir / "report.html").exists()
    assert "WARNING" not in err

    assert main(["status", str(run_dir)]) == 0
    status = capsys.readouterr().out
    assert "3 done" in status and status.count(" done ") == 3

    assert main(["plan", sweep, "--run-dir", str(run_dir)]) == 0
    plan = capsys.readouterr().out
    assert plan.count(" finished ") == 3
    assert "3 jobs: 0 to run, 3 finished, 0 unsupported here" in plan


@pytest.mark.slow
def test_run_with_a_failing_job_exits_1_and_points_at_its_log(cluster, write_sweep, tmp_path,
                                                              capsys, monkeypatch):
    # More eval tokens than the text holds: the model's reference (eval windows) fails on the
    # worker, every attempt, and so does each job that depends on it. The command runs in
    # this process: the program exits with main's status (the quick-exit test below).
    data = sweep_dict(retries=1)
    data["eval"]["samples"] = 100_000
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    status = main(["run", write_sweep(data), "--scheduler", cluster.client.scheduler.address,
                   "--run-dir", "out", "--no-report"])
    out, err = capsys.readouterr()
    assert status == 1, err
    assert not (tmp_path / "out" / "report.html").exists() and "report:" not in out
    assert "2 jobs: 0 done, 2 failed, 0 skipped" in out
    log_line = [line for line in out.splitlines() if line.startswith("failed:")][0]
    log_path = tmp_path / log_line.rsplit("(log: ", 1)[1].rstrip(")")
    assert ("attempt=2 failed outside the job (job_error): ValueError: in its model's "
            "reference: eval text has") in log_path.read_text()


def test_plan_lists_every_job_with_its_id_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", DEMO_SWEEP]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["order", "job_id", "model", "config_label", "priority", "state",
                              "quantized", "est_gpu_memory", "est_cpu_slot", "memory_from",
                              "peak_phase", "est_time"]
    # The baseline goes first, under the id the library gives it (tests/test_spec.py derives
    # ids from the canonical job spec by hand).
    baseline = expand_grid(load_sweep(DEMO_SWEEP))[0]
    assert baseline.is_baseline and baseline.id.startswith("none-")
    assert out[1].split()[:2] == ["1", baseline.id]
    # The header, 7 jobs, how the model's windows begin (eval.bos), its search (whose jobs
    # are made when it has probed) with its price by method and the method it uses, a line on
    # streaming (stream: auto) and the counts.
    assert "baseline" in out[1] and len(out) == 1 + 7 + 1 + 3 + 1 + 1
    assert out[8] == ("eval windows of demo-llama (eval.bos: auto): the text cut as tokenized, "
                      "no BOS per window")
    assert out[9].startswith("search mix: demo-llama, hqq formats b3g128, b3, b4 per linear")
    assert out[10].startswith("search mix: 28 units x 3 formats = 84 cells; by kl about ")
    assert out[11].startswith("search mix: sensitivity ")
    assert out[12].startswith("stream: demo-llama: its jobs stream where")
    # Every config quantizes the demo model's linear layers but the output head: 90% of it.
    at = out[0].index("quantized")
    assert [line[at:].split()[0] for line in out[1:8]] == ["-"] + ["90%"] * 6
    # no history yet: every job priced from its shapes (plan.shape_prices)
    assert out[-1].startswith("7 jobs: 7 to run, 0 finished, 0 unsupported here; about ")
    assert out[-1].endswith("of job time for the 7 with an estimate")
    assert not (tmp_path / "runs").exists()


def test_the_shipped_demo_sweep_has_six_bitsandbytes_configs_and_the_baseline():
    jobs = expand_grid(load_sweep(DEMO_SWEEP))
    assert [j.backend for j in jobs] == ["none"] + ["bitsandbytes"] * 6
    # And a small speed block (issue 39), so its report's speed section has figures; cheap
    # on 2 CPU slots: 3 generations of 8 tokens after 32 per job.
    assert load_sweep(DEMO_SWEEP).speed.identity() == {
        "prompt_length": 32, "new_tokens": 8, "batch_sizes": [1], "warmup": 1, "repeats": 2}


@pytest.mark.slow
def test_run_keeps_the_results_and_exits_1_with_a_hint_when_the_report_fails(cluster, write_sweep,
                                                                              tmp_path, capsys,
                                                                              monkeypatch):
    # A real way for the report to fail: its output path is taken by a directory.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "t" / "report.html").mkdir(parents=True)
    status = main(["run", write_sweep(), "--scheduler", cluster.client.scheduler.address])
    out, err = capsys.readouterr()
    assert status == 1
    assert "2 jobs: 2 done, 0 failed, 0 skipped" in out
    assert "quantdask: error: the report failed (" in err
    assert "the results are kept: `quantdask report runs/t` tries again" in err
    results = read_results(tmp_path / "runs" / "t")
    assert results["status"].to_list() == ["done", "done"]


def plan_json(capsys, path: str) -> dict:
    import json

    capsys.readouterr()
    assert main(["plan", path, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.timeout(120)
def test_plan_shows_the_phase_that_sets_each_jobs_peak(write_sweep, tmp_path, capsys,
                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    plain = plan_json(capsys, write_sweep(sweep_dict()))
    assert [job["peak_phase"] for job in plain["jobs"]] == ["score", "score"]
    speed = {"prompt_length": 96, "new_tokens": 32, "batch_sizes": [1, 512]}
    timed = write_sweep(sweep_dict(speed=speed), name="speed.yaml")
    assert [job["peak_phase"] for job in plan_json(capsys, timed)["jobs"]] == [
        "time_generation", "time_generation"]
    assert main(["plan", timed]) == 0
    out = capsys.readouterr().out.splitlines()
    at = out[0].index("peak_phase")
    assert [line[at:].split()[0] for line in out[1:3]] == ["time_generation"] * 2


def tiny_bloom(directory: Path) -> str:
    """A tiny BLOOM model (ALiBi positions: its family sets no hard limit)."""
    import torch
    from transformers import AutoModelForCausalLM, BloomConfig

    from tests.tiny_families import SMALL_VOCAB, copy_demo_tokenizer

    torch.manual_seed(0)
    config = BloomConfig(vocab_size=SMALL_VOCAB, hidden_size=64, n_layer=2, n_head=4,
                         bos_token_id=1, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    copy_demo_tokenizer(directory)
    return str(directory)


@pytest.mark.timeout(120)
def test_plan_says_when_a_family_sets_no_hard_limit(write_sweep, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    models = [{"name": "demo", "path": sweep_dict()["models"][0]["path"]},
              {"name": "bloom", "path": tiny_bloom(tmp_path / "bloom")}]
    # 200 tokens: within the demo model's 256 positions, and nothing to check BLOOM against.
    data = sweep_dict(models=models, eval={**sweep_dict()["eval"], "seq_len": 200})
    plan = plan_json(capsys, write_sweep(data))
    limits = {job["model"]: (job["max_positions"], job["positions_from"]) for job in plan["jobs"]}
    assert limits["demo"] == (256, "max_position_embeddings in its config.json")
    assert limits["bloom"][0] is None
    assert limits["bloom"][1].startswith("no hard limit: its config (bloom) names no "
                                         "max_position_embeddings / n_positions")
    assert main(["plan", write_sweep(data)]) == 0
    out = capsys.readouterr().out
    assert f"positions: bloom: {limits['bloom'][1]}; its lengths are not checked" in out
    assert "positions: demo" not in out
    # Past the demo model's positions it is refused; BLOOM alone is not.
    assert main(["plan", write_sweep({**data, "eval": {**data["eval"], "seq_len": 300}})]) == 2
    assert "eval.seq_len: 300 tokens, but model 'demo' takes at most 256" in \
        capsys.readouterr().err
    alone = {**data, "models": models[1:], "eval": {**data["eval"], "seq_len": 300}}
    assert main(["plan", write_sweep(alone)]) == 0


def test_the_command_exits_quickly_with_mains_status_and_its_output_flushed(tmp_path):
    # `quantdask` skips the interpreter's teardown (quantdask.cli.main.command); the exit
    # handlers still run (logging's flush), and stdout buffered in a pipe is not lost.
    script = ("import atexit, importlib\n"
              "cli = importlib.import_module('quantdask.cli.main')\n"
              "atexit.register(lambda: print('exit handler ran'))\n"
              "cli.main = lambda: print('the command said this', end='') or 3\n"
              "cli.command()\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 3, run.stderr
    assert run.stdout == "the command said thisexit handler ran\n"


def test_the_fork_server_quick_exit_is_armed_only_in_the_fork_server():
    import quantdask.process.fork_server_exit as fork_server_exit

    # Imported here (not by multiprocessing's fork server): no exit handler of its own.
    assert not fork_server_exit._imported_by_the_fork_server()


def test_the_quick_model_type_table_is_part_of_the_full_one():
    from quantdask.sweepfile.model import _known_model_types

    quick, full = _known_model_types(quick=True), _known_model_types(quick=False)
    assert {"llama", "gpt2", "qwen2", "gemma", "gpt_neox"} <= set(quick) <= set(full)
