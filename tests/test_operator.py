"""The operator's view: live dashboard during a real sweep, plain lines, status --watch,
priorities that decide the start order, the plan with estimates, and job logs."""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import re
import threading
from pathlib import Path

import polars as pl
import pytest
from rich.console import Console

from quantdask.cli.dashboard import LiveDashboard, PlainLog, render, watch
from quantdask.cli.main import main
from quantdask.cluster.local import start_cluster
from quantdask.demo_model import DEMO_MODEL_DIR
from quantdask.plan.planning import plan_sweep
from quantdask.run.progress import PROGRESS_FILE, FailureLine, SweepProgress, read_progress
from quantdask.run.sweep import run_sweep
from quantdask.store.readers import read_attempts, read_results
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import sweep_dict, with_slow_jobs
from tests.test_placement import NF4_ESTIMATE

pytestmark = pytest.mark.timeout(300)

STAMP = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ "


def text_of(renderable, width: int = 160) -> str:
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


# -- the progress model --------------------------------------------------------------------


def test_progress_counts_queue_failures_eta_and_file_round_trip(tmp_path):
    progress = SweepProgress("s", str(tmp_path), total=4, slots=2, workers=["0", "1"])
    progress.already_finished(["done"])
    for job_id, priority in (("a", 0), ("b", 5), ("c", 0)):
        progress.job_queued(job_id, f"m {job_id}", priority)
    assert progress.queue_order() == [(5, "m b"), (0, "m a"), (0, "m c")]
    progress.job_started("b", "b", "m b", 5, 1, "0")
    progress.telemetry("0", "cuda:3", "b", 1000)
    progress.telemetry("0", "cuda:3", "b", 500)
    progress.telemetry("1", "cuda:4", None, 9999)  # idle: no job's peak
    assert progress.running["b"].peak_memory_bytes == 1000
    assert progress.devices == {"0": "cuda:3", "1": "cuda:4"}
    assert progress.eta_s() is None  # no attempt has ended: no pace yet
    failed = {"status": "failed", "failure_class": "job_error", "error_class": "RuntimeError",
              "error_message": "boom\nsecond line"}
    progress.attempt_ended("b", "b", "m b", 1, failed, final=False)
    assert progress.counts == {"done": 1, "failed": 0, "skipped": 0}
    assert progress.failures[-1].retrying and progress.failures[-1].message == "RuntimeError: boom"
    assert progress.eta_s() is None  # a crash is no measure of a job's time
    for n in range(7):
        progress.attempt_ended(f"x{n}", "a", "m a", n + 1, failed, final=False)
    assert len(progress.failures) == 5  # the last five only
    done = {"status": "done", "perplexity": 1.5, "kl_divergence": 0.001,
            "bits_per_weight": 4.5, "wall_s": 2.0, "worker": "1"}
    progress.job_started("c", "c", "m c", 0, 1, "1")
    ten_ago = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=10)
    progress.running["c"].started_at = ten_ago.isoformat()
    progress.attempt_ended("c", "c", "m c", 1, done, final=True)
    # Two jobs left, 10 s each at this pace, on two slots: about 10 s.
    assert progress.eta_s() == pytest.approx(10, abs=0.5)
    progress.job_started("a", "a", "m a", 0, 8, "0")
    progress.running["a"].started_at = (dt.datetime.now(dt.UTC)
                                        - dt.timedelta(seconds=4)).isoformat()
    assert progress.eta_s() == pytest.approx((20 - 4) / 2, abs=0.5)  # a has done 4 s of 10
    assert progress.events[-2]["text"] == ("done    m c (attempt 1) on worker 1: ppl 1.5, "
                                           "KL 0.001, 4.5 bits/weight, 2.0s")
    assert progress.events[0]["text"] == "start   m b (attempt 1, priority 5) on worker 0"
    assert progress.counts["done"] == 2 and progress.settled == 2
    assert progress.queue_order() == []  # a is running (attempt 8), b and c are settled
    assert progress.snapshot().to_dict() | {"eta_s": 0} == progress.to_dict() | {"eta_s": 0}
    progress.finish(completed=False)
    progress.write(force=True)
    again = read_progress(tmp_path)
    assert again.to_dict() | {"eta_s": None} == progress.to_dict() | {"eta_s": None}
    assert again.finished and not again.completed
    assert read_progress(tmp_path / "nowhere") is None


def test_the_dashboard_shows_rows_progress_queue_and_failures():
    now = dt.datetime(2026, 1, 1, 12, 0, 30, tzinfo=dt.UTC)
    progress = SweepProgress("demo", "runs/demo", total=10, slots=2, workers=["0", "1"],
                             dashboard_link="http://127.0.0.1:8787/status",
                             started_at="2026-01-01T12:00:00+00:00")
    progress.already_finished(["done"] * 3)
    progress.job_queued("q", "m later", 7)
    progress.job_started("k", "j", "m nf4", 2, 2, "1")
    progress.running["k"].started_at = "2026-01-01T12:00:10+00:00"
    progress.running["k"].peak_memory_bytes = 3 * 2**30
    progress.devices["1"] = "cuda:1"
    progress.failures.append(FailureLine("2026-01-01T12:00:05+00:00", "j", "m nf4", 1,
                                         "out_of_memory", "OutOfMemoryError: CUDA", True))
    text = text_of(render(progress, now))
    assert "3/10 jobs · 3 done · 0 failed · 0 skipped · elapsed 0:30 · 1 running" in text
    assert re.search(r"│ 0\s+│ -\s+│ idle", text)
    assert re.search(r"│ 1\s+│ cuda:1 │ m nf4\s+│ 2\s+│ 2\s+│ 0:20\s+│ 3.0 GiB", text)
    assert "next, by priority: [p7] m later" in text
    assert "OutOfMemoryError: CUDA" in text and "retrying" in text
    assert "Dask dashboard: http://127.0.0.1:8787/status" in text


# -- a real sweep, watched -------------------------------------------------------------------


def failing_sweep():
    # nf4 fails its first attempt and is retried; fp4 fails both: a failure line of each kind.
    data = sweep_dict(
        name="watched",
        backends=[{"backend": "bitsandbytes", "grid": {"bits": [4], "quant_type": ["nf4", "fp4"]}},
                  {"backend": "bitsandbytes", "configs": [{"bits": 8}], "priority": 4}],
        retries=1,
        faults=[{"config": "nf4", "attempt": 1, "kind": "raise"},
                {"config": "fp4", "attempt": 1, "kind": "raise"},
                {"config": "fp4", "attempt": 2, "kind": "raise"}])
    # Every quantized attempt 1.5 s or more (a slow fault, then its own): several progress
    # snapshots (4 a second) catch each one running, even on a loaded machine.
    return sweep_from_dict(with_slow_jobs(data, attempts=(1, 2)))


@pytest.fixture(scope="module")
def watched_run(cluster, tmp_path_factory):
    """A real sweep with the live dashboard on a recording terminal, plain lines beside it, and
    a snapshot of the dashboard at every progress update."""
    run_dir = tmp_path_factory.mktemp("watched")
    console = Console(file=io.StringIO(), force_terminal=True, width=160, record=True,
                      color_system=None)
    plain = io.StringIO()
    log = PlainLog(plain)
    snapshots: list[str] = []
    watched: list[str] = []

    # Another terminal follows the same sweep through the run directory, from the moment the
    # driver has written its first progress.json.
    watcher = threading.Thread(target=lambda: watched.append(_watch_plain(run_dir)))

    def on_progress(progress):
        dashboard.update(progress)
        log.update(progress)
        snapshots.append(text_of(render(progress)))
        if not watcher.is_alive() and not watched and (run_dir / PROGRESS_FILE).exists():
            watcher.start()

    with LiveDashboard(console) as dashboard:
        run_sweep(failing_sweep(), run_dir, cluster.client, on_progress=on_progress)
    watcher.join(timeout=60)
    return {"run_dir": run_dir, "live": console.export_text(), "plain": plain.getvalue(),
            "snapshots": snapshots, "watched": watched}


def _watch_plain(run_dir) -> str:
    out = io.StringIO()
    code = watch(str(run_dir), interval_s=0.2, plain=True, stream=out)
    return f"exit {code}\n{out.getvalue()}"


@pytest.mark.slow
def test_the_live_dashboard_showed_workers_progress_and_failures(watched_run):
    snapshots = watched_run["snapshots"]
    running = [s for s in snapshots if re.search(r"│ [01]\s+│ cpu\s+│ demo (nf4|fp4|int8)", s)]
    assert running, "no snapshot showed a worker running a job"
    assert any(re.search(r"[1-4]/4 jobs", s) for s in snapshots)
    assert any("injected fault on attempt 1" in s and "retrying" in s for s in snapshots)
    live = watched_run["live"]  # what the terminal received
    assert "4/4 jobs · 3 done · 1 failed · 0 skipped" in live and "finished" in live
    assert "injected fault on attempt 2" in live and "failed" in live


@pytest.mark.slow
def test_plain_lines_are_timestamped_and_say_what_happened(watched_run):
    lines = watched_run["plain"].splitlines()
    assert lines and all(re.match(STAMP, line) for line in lines)
    starts = [line for line in lines if " start " in line]
    assert len(starts) == 6  # baseline, int8, nf4 x2, fp4 x2
    assert any("failed  demo fp4 (attempt 2) on worker" in line and "no more retries" in line
               for line in lines)
    assert "4/4 jobs · 3 done · 1 failed · 0 skipped" in lines[-1] and "finished" in lines[-1]


@pytest.mark.slow
def test_status_watch_followed_the_sweep_from_the_run_directory(watched_run):
    (watched,) = watched_run["watched"]
    assert watched.startswith("exit 0\n")
    lines = watched.splitlines()[1:]
    assert all(re.match(STAMP, line) for line in lines)
    assert "4/4 jobs" in lines[-1] and "finished" in lines[-1]
    progress = read_progress(watched_run["run_dir"])
    assert progress.finished and progress.completed and progress.settled == 4


@pytest.mark.parametrize("interval", ["0", "-1", "soon"])
def test_status_watch_refuses_a_bad_interval(interval, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["status", str(tmp_path), "--watch", "--interval", interval])
    assert stop.value.code == 2 and "--interval" in capsys.readouterr().err


def test_status_watch_reports_a_driver_that_died(tmp_path, capsys):
    progress = SweepProgress("s", str(tmp_path), total=3)
    progress.write(force=True)  # never finished, and no driver holds the run dir
    (tmp_path / "results").mkdir()
    assert main(["status", str(tmp_path), "--watch", "--interval", "0.1"]) == 1
    assert "driver stopped without finishing" in capsys.readouterr().out
    assert (tmp_path / PROGRESS_FILE).exists()


# -- priorities ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_worker():
    with start_cluster(workers=1) as handle:
        yield handle


def priority_sweep():
    return sweep_from_dict(sweep_dict(
        name="prio",
        backends=[{"backend": "bitsandbytes", "configs": [{"bits": 4, "quant_type": "nf4"}],
                   "priority": 0},
                  {"backend": "bitsandbytes", "configs": [{"bits": 4, "quant_type": "fp4"}],
                   "priority": 2},
                  {"backend": "bitsandbytes", "configs": [{"bits": 8}], "priority": 5}]))


@pytest.mark.slow
def test_priorities_decide_the_start_order_on_one_worker(watched_run, one_worker, tmp_path,
                                                         caplog):
    # After another sweep with the same baseline job ran on another cluster of this process
    # (``watched_run``): the driver once read a finished future's status after releasing it,
    # saw "cancelled", and ran the job again; it must be taken as finished, first time.
    sweep = priority_sweep()
    planned = plan_sweep(sweep, tmp_path / "run")
    assert planned["config_label"].to_list() == ["int8 t=6", "fp4", "baseline", "nf4"]
    assert planned["priority"].to_list() == [5, 2, 1, 0]
    run_sweep(sweep, tmp_path / "run", one_worker.client)
    attempts = read_attempts(tmp_path / "run").join(
        read_results(tmp_path / "run").select("job_id", "config_label"), on="job_id")
    started = attempts.sort("started_at")["config_label"].to_list()
    assert started == ["int8 t=6", "fp4", "baseline", "nf4"]
    assert "dropped before it started" not in caplog.text
    results = read_results(tmp_path / "run")
    # None was resubmitted: a rerun is queued only after a finish is seen. (Queued before the
    # first *start* is a race: a lone worker may begin the first job while the driver still
    # submits the last one.)
    assert results["queued_at"].max() < results["finished_at"].min()
    assert results["attempts"].to_list() == [1, 1, 1, 1]


# -- plan --------------------------------------------------------------------------------------


def plan_json(capsys, *args) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_before_anything_ran(write_sweep, tmp_path, capsys):
    path = write_sweep(sweep_dict(backends=[
        {"backend": "bitsandbytes", "grid": {"bits": [4]}},
        {"backend": "torchao", "priority": 3,
         "configs": [{"mode": "int4_weight_only", "group_size": 256}]}]))
    plan = plan_json(capsys, path, "--run-dir", str(tmp_path / "fresh"))
    jobs = plan["jobs"]
    assert [j["config_label"] for j in jobs] == ["ao int4wo g256", "baseline", "nf4"]
    assert [j["order"] for j in jobs] == [1, 2, 3]
    ao = jobs[0]
    assert ao["state"] == "unsupported"
    assert "group_size=256 does not divide model.layers.0.self_attn.q_proj.in_features=128" \
        in ao["reason"]
    memory = {j["config_label"]: j["est_device_mem_bytes"] for j in jobs}
    for job in jobs:
        assert job["memory_from"] == "checkpoint size and config"
        # no history: priced from the model's shapes at this machine's rate (plan.shape_prices)
        assert job["est_duration_s"] > 0 and job["duration_from"].startswith("shapes: ")
        assert re.fullmatch(r"(none|bitsandbytes|torchao)-[0-9a-f]{16}", job["job_id"])
    # By hand: the 3,482,128-byte float32 checkpoint, the eval's logits 8 x 32 x 320 vocab x
    # 4 bytes x 3 copies = 983,040, and 20% headroom.
    assert memory["baseline"] == int((3_482_128 + 983_040) * 1.2)
    assert memory["nf4"] == NF4_ESTIMATE  # its linears at 4 bits + absmax/64, the rest as loaded
    # torchao loads the whole model onto the device and then quantizes it: the baseline's peak.
    assert memory["ao int4wo g256"] == memory["baseline"]
    assert plan["counts"] == {"to run": 2, "finished": 0, "unsupported": 1}
    assert not (tmp_path / "fresh").exists()  # a plan writes nothing


@pytest.mark.slow
def test_plan_estimates_from_earlier_runs(one_worker, write_sweep, tmp_path, capsys):
    first = sweep_dict(name="est")
    run_dir = tmp_path / "run"
    run_sweep(sweep_from_dict(first), run_dir, one_worker.client)
    measured = {r["config_label"]: r for r in read_results(run_dir).to_dicts()}
    grown = sweep_dict(name="est", backends=[{"backend": "bitsandbytes",
                                              "grid": {"bits": [4],
                                                       "quant_type": ["nf4", "fp4"]}}])
    plan = plan_json(capsys, write_sweep(grown), "--run-dir", str(run_dir))
    jobs = {j["config_label"]: j for j in plan["jobs"]}
    for label in ("baseline", "nf4"):
        assert jobs[label]["state"] == "finished" and jobs[label]["duration_from"] == "this job"
        assert jobs[label]["memory_from"] == "its measured peak"
        assert jobs[label]["est_device_mem_bytes"] == int(
            measured[label]["peak_device_mem_bytes"] * 1.2)
        assert jobs[label]["est_duration_s"] == measured[label]["wall_s"]
    assert jobs["fp4"]["state"] == "to run"
    assert jobs["fp4"]["duration_from"] == "same model and backend"
    # fp4's own figure by config (as nf4's), scaled as the two measured peaks compare with theirs.
    assert jobs["fp4"]["memory_from"] == "config, scaled by 2 measured peaks of this model"
    # The rule (README, "Placement by device memory"), by hand: a config's figure is its weights
    # at its bits (the float32 checkpoint's bytes x bits / 32 for the decoder layers; 4-bit: 4
    # bits + a float32 absmax per 64 weights; the rest as loaded) plus the eval's logits (batch
    # x seq_len x vocab float32, 3 copies alive); scaled by the median of (measured peak / own
    # figure) of the jobs that ran; plus 20%.
    config = json.loads(Path(DEMO_MODEL_DIR, "config.json").read_text())
    checkpoint = os.path.getsize(os.path.join(DEMO_MODEL_DIR, "model.safetensors"))
    # the embedding and the untied head, float32, stay as loaded
    quantized = 1 - 2 * config["vocab_size"] * config["hidden_size"] * 4 / checkpoint
    vocab = json.loads(Path(DEMO_MODEL_DIR, "config.json").read_text())["vocab_size"]
    logits = first["eval"]["batch_size"] * first["eval"]["seq_len"] * vocab * 4 * 3
    figure = {"baseline": int(checkpoint + logits),
              "nf4": int(checkpoint * (quantized * (4 + 32 / 64) / 32 + 1 - quantized)
                         + logits)}
    figure["fp4"] = figure["nf4"]
    ratios = [measured[label]["peak_device_mem_bytes"] / figure[label]
              for label in ("baseline", "nf4")]
    expected = figure["fp4"] * (sum(ratios) / 2) * 1.2  # the median of two: their mean
    assert jobs["fp4"]["est_device_mem_bytes"] == pytest.approx(expected, abs=1.0)
    assert jobs["fp4"]["est_duration_s"] == measured["nf4"]["wall_s"]
    assert plan["est_work_s"] == pytest.approx(measured["nf4"]["wall_s"])
    table = main(["plan", write_sweep(grown), "--run-dir", str(run_dir)])
    out = capsys.readouterr().out
    assert table == 0 and "3 jobs: 1 to run, 2 finished, 0 unsupported here" in out


# -- logs --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_logs_prints_every_attempt_of_a_job(watched_run, capsys):
    run_dir = str(watched_run["run_dir"])
    fp4 = read_results(run_dir).filter(pl.col("config_label") == "fp4")["job_id"][0]
    assert main(["logs", run_dir, fp4]) == 0
    log = capsys.readouterr().out
    assert "attempt=1" in log and "attempt=2" in log
    assert "RuntimeError: injected fault on attempt 1" in log
    assert "RuntimeError: injected fault on attempt 2" in log
    assert main(["logs", run_dir, fp4[:20]]) == 0  # a unique beginning is enough
    assert capsys.readouterr().out == log
    assert main(["logs", run_dir, "nope"]) == 2
    assert "matches no job" in capsys.readouterr().err
    assert main(["logs", run_dir, "bitsandbytes-"]) == 2
    assert "matches several jobs" in capsys.readouterr().err
    plan = json.loads((watched_run["run_dir"] / "jobs.json").read_text())
    unstarted = {**plan[0], "job_id": "bitsandbytes-0000000000000000"}
    (watched_run["run_dir"] / "jobs.json").write_text(json.dumps(plan + [unstarted]))
    assert main(["logs", run_dir, unstarted["job_id"]]) == 2
    assert "has no log yet" in capsys.readouterr().err
    (watched_run["run_dir"] / "jobs.json").write_text(json.dumps(plan))
