"""Real sweeps on a real 2-slot LocalCluster: every job done, resume, retries, custom backends."""

from __future__ import annotations

import datetime as dt
import math
import re
import sys
import threading
import time
from pathlib import Path

import polars as pl
import psutil
import pytest
import yaml

import quantdask.backends
from quantdask.backends import Backend
from quantdask.backends.base import UNQUANTIZED
from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR, DEMO_SWEEP, DEMO_TASKS_DIR
from quantdask.measure.reference import REFERENCE_TOPIC, reference_key
from quantdask.process.devices import drain_this_worker
from quantdask.run.sweep import run_sweep
from quantdask.store.readers import (
    read_device_samples,
    read_environment,
    read_layers,
    read_results,
    read_sessions,
)
from quantdask.store.run_store import read_frame
from quantdask.store.summary import device_summary
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import sweep_dict

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def reference_events(cluster, sweep) -> int:
    key = reference_key(sweep.models[0], sweep.eval, tasks=sweep.tasks)
    return sum(msg["key"] == key for _, msg in cluster.client.get_events(REFERENCE_TOPIC))


def demo_data() -> dict:
    """The demo sweep (data/demo_sweep.yaml) as data, its paths made absolute, each job scoring
    16 of its task's questions instead of 160 and without its search: no test here reads the
    task scores or the search (the demo as shipped runs whole in tests/test_install.py; a
    search in tests/test_search.py), and those cost seconds a job."""
    data = yaml.safe_load(Path(DEMO_SWEEP).read_text())
    del data["searches"], data["calibration"]
    data["models"][0]["path"] = DEMO_MODEL_DIR
    data["eval"]["text"] = DEMO_EVAL_TEXT
    data["tasks"].update(include_path=DEMO_TASKS_DIR, limit=16)
    return data


@pytest.fixture(scope="module")
def demo_run(cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("demo-run")
    arrived = []
    sweep = sweep_from_dict(demo_data())
    before = reference_events(cluster, sweep)
    results = run_sweep(sweep, run_dir, cluster.client, on_result=arrived.append)
    run_dir.joinpath("references-computed").write_text(
        str(reference_events(cluster, sweep) - before))
    return run_dir, results, arrived


def test_every_demo_job_is_done_with_plausible_metrics(demo_run):
    run_dir, results, arrived = demo_run
    assert results.height == 7 and len(arrived) == 7
    assert results["status"].to_list() == ["done"] * 7
    assert results["attempts"].to_list() == [1] * 7
    by_label = {row["config_label"]: row for row in results.to_dicts()}
    base = by_label["baseline"]
    four_bit = [by_label[k] for k in ("nf4", "nf4 dq", "fp4", "fp4 dq")]
    eight_bit = [by_label[k] for k in ("int8 t=6", "int8 t=0")]
    for row in four_bit:
        assert all(row["size_bytes"] < e["size_bytes"] for e in eight_bit)
        assert row["perplexity"] >= base["perplexity"]
    assert all(e["size_bytes"] < base["size_bytes"] for e in eight_bit)
    # Double quantization stores its constants in 8 bits: smaller than plain 4-bit.
    assert by_label["nf4 dq"]["size_bytes"] < by_label["nf4"]["size_bytes"]
    samples, phases = read_device_samples(run_dir), read_frame(run_dir, "phases")
    for row in results.to_dicts():
        assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1.0
        assert row["queued_at"] <= row["started_at"] <= row["finished_at"]
        # The timed sections lie inside the job's wall time, and that inside its recorded run
        # (10 ms for the two clocks: perf_counter and the wall clock).
        run_s = (row["finished_at"] - row["started_at"]).total_seconds()
        sections_s = row["load_s"] + row["quantize_s"] + row["eval_s"]
        assert sections_s - 1e-3 <= row["wall_s"] <= run_s + 0.01
        # A CPU slot's device memory is its RSS, which the device sampler read during the job:
        # the most it saw is close to the peak of the job's own phases (a few MB of model in
        # ~0.5 GB of process; the slack allows for readings just outside the peak's window on
        # a loaded machine). The baseline's peak also counts its reference's, a task of its own
        # that may have run on the other worker: the sampler's view of the job bounds only that
        # from below.
        assert row["peak_device_mem_bytes"] == row["peak_host_rss_bytes"]
        seen = samples.filter(pl.col("job_id") == row["job_id"])["memory_used_bytes"].max()
        own = phases.filter(pl.col("job_id") == row["job_id"])["peak_host_rss_bytes"].max()
        assert own <= row["peak_host_rss_bytes"]
        assert 0.8 * own <= seen <= 1.1 * row["peak_host_rss_bytes"], (row["config_label"], own)


def test_quality_is_measured_against_the_baseline(demo_run):
    _, results, _ = demo_run
    by_label = {row["config_label"]: row for row in results.to_dicts()}
    assert by_label["baseline"]["kl_divergence"] == pytest.approx(0.0, abs=1e-9)
    assert by_label["baseline"]["top1_agreement"] == 1.0
    kl = {label: row["kl_divergence"] for label, row in by_label.items()}
    # As measured on the demo model: 8-bit < nf4 < fp4 (figures in the closing note).
    assert 0 < max(kl["int8 t=6"], kl["int8 t=0"]) < min(kl["nf4"], kl["nf4 dq"])
    assert max(kl["nf4"], kl["nf4 dq"]) < min(kl["fp4"], kl["fp4 dq"])
    assert by_label["fp4"]["top1_agreement"] < by_label["nf4"]["top1_agreement"] < 1.0


def test_the_demo_times_generation_for_its_reports_speed_section(demo_run):
    # Issue 39 item 4: the demo sweep's small speed block, so the showcase report's speed
    # section has figures: one row per job at batch size 1, each with its baseline speed-up.
    from quantdask import report
    from quantdask.store.readers import read_speed

    run_dir, results, _ = demo_run
    speed = read_speed(run_dir)
    assert sorted(speed["job_id"]) == sorted(results["job_id"])
    assert speed.select("batch_size", "prompt_tokens", "new_tokens", "repeats").unique().rows() \
        == [(1, 32, 8, 2)]
    assert (speed["decode_tokens_per_s"] > 0).all() and speed["decode_speedup"].is_not_null().all()
    assert (results["speed_s"] > 0).all()
    assert report.speedup_table(results, speed).height == 7


def test_the_reference_ran_once_for_the_model(demo_run):
    run_dir, results, _ = demo_run
    assert results.height == 7
    assert (run_dir / "references-computed").read_text() == "1"  # 7 jobs, one reference


def test_one_layer_row_per_quantized_linear_per_job(demo_run):
    run_dir, results, _ = demo_run
    layers = read_layers(run_dir)
    per_job = dict(layers.group_by("job_id").len().iter_rows())
    quantized = results.filter(pl.col("backend") == "bitsandbytes")["job_id"]
    assert per_job == {job_id: 28 for job_id in quantized}  # 4 blocks x 7 linears; no lm_head
    assert layers["position"].max() == 27
    # Layer by layer, 8-bit output error is below every 4-bit config's (as KL is, above).
    by_config = layers.join(results.select("job_id", "config_label"), on="job_id")
    for _, layer in by_config.group_by("layer"):
        error = dict(zip(layer["config_label"], layer["output_rel_error"]))
        assert len(error) == 6
        assert 0 < max(error["int8 t=6"], error["int8 t=0"]) < min(
            error[k] for k in ("nf4", "nf4 dq", "fp4", "fp4 dq")), error


def test_a_fresh_run_reproduces_the_metrics(demo_run, cluster, tmp_path):
    _, results, _ = demo_run
    # Three of the demo's jobs, one of each kind (the same job ids), in a new run directory.
    data = demo_data()
    data["backends"] = [{"backend": "bitsandbytes", "configs": [
        {"bits": 4, "quant_type": "nf4", "double_quant": True},
        {"bits": 8, "int8_threshold": 0.0}]}]
    again = run_sweep(sweep_from_dict(data), tmp_path / "again", cluster.client)
    metrics = ["job_id", "perplexity", "kl_divergence", "top1_agreement", "size_bytes"]
    assert again.height == 3 and set(again["job_id"]) < set(results["job_id"])
    first = results.select(metrics).join(again.select("job_id"), on="job_id").sort("job_id")
    assert again.select(metrics).sort("job_id").to_dicts() == first.to_dicts()


def test_device_samples_and_per_device_summary(demo_run, cluster):
    run_dir, results, _ = demo_run
    samples = read_device_samples(run_dir)
    assert set(samples["worker"]) == set(results["worker"]) and set(samples["device"]) == {"cpu"}
    sampled_jobs = set(samples["job_id"].drop_nulls())
    assert set(results["job_id"]) <= sampled_jobs  # every job was sampled while it ran
    assert any(j.startswith("reference-") for j in sampled_jobs)
    # A sample tagged with a job was taken while that job ran (half a second of slack: the
    # sampler's thread may read the tag just before the job's last moment, stamp just after).
    ran = samples.join(results.select("job_id", "started_at", "finished_at"), on="job_id")
    slack = dt.timedelta(seconds=0.5)
    assert ran.filter((pl.col("time") < pl.col("started_at") - slack)
                      | (pl.col("time") > pl.col("finished_at") + slack)).is_empty()
    # Samples read this host's memory; a slot computing uses more CPU than one waiting.
    total = psutil.virtual_memory().total
    assert set(samples["memory_total_bytes"]) == {total}
    assert samples["memory_used_bytes"].is_between(1, total).all()
    # (The median busy reading, without each worker's first: it covers only the moment since
    # its probe started.)
    later = samples.sort("time").filter(pl.int_range(pl.len()).over("worker") > 0)
    busy = later.filter(pl.col("job_id").is_not_null())["utilization_pct"].median()
    # Waiting: what the samplers read now, with no job. (Within the sweep the untagged moments
    # are few, between jobs, and busy moving results: a median of two or three of them said
    # 51% once, with the suite's other process on the other core.)
    waiting: list[float] = []
    deadline = time.monotonic() + 20
    while len(waiting) < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
        for drained in cluster.client.run(drain_this_worker).values():
            waiting += [s["utilization_pct"] for s in drained if s.get("job_id") is None]
    assert len(waiting) >= 4, "the samplers took no reading while the workers waited"
    idle = sorted(waiting)[len(waiting) // 2]
    assert busy > idle + 10, (busy, waiting)
    summary = device_summary(results, samples)
    assert summary["jobs"].sum() == 7 and summary.height == 2
    # Recomputed here: one job at a time per slot, so busy time is the sum of its jobs' runs,
    # and the window is the sweep's first start to its last finish.
    window_s = (results["finished_at"].max() - results["started_at"].min()).total_seconds()
    for row in summary.to_dicts():
        mine = results.filter(pl.col("worker") == row["worker"])
        busy_s = sum((end - start).total_seconds()
                     for start, end in mine.select("started_at", "finished_at").iter_rows())
        assert row["jobs"] == row["attempts"] == mine.height
        assert row["busy_s"] == pytest.approx(busy_s)
        assert row["idle_s"] == pytest.approx(window_s - busy_s)
        assert row["utilization"] == pytest.approx(busy_s / window_s)
        assert row["peak_device_mem_bytes"] == mine["peak_device_mem_bytes"].max()
        sampled = samples.filter(pl.col("worker") == row["worker"])
        assert row["samples"] == sampled.height
        assert row["sampled_peak_memory_bytes"] == sampled["memory_used_bytes"].max()
        assert row["sampled_utilization_pct"] == pytest.approx(sampled["utilization_pct"].mean())


def test_workers_keep_glibc_malloc_defaults(cluster):
    # Dask's MALLOC_TRIM_THRESHOLD_ made every large tensor a fresh mapping: torch 1.3x slower.
    import os

    assert set(cluster.client.run(os.environ.get, "MALLOC_TRIM_THRESHOLD_").values()) == {None}


def test_both_workers_ran_jobs(demo_run, cluster):
    _, results, _ = demo_run
    # The cluster's own list of its slots, not the scheduler's of the moment: another test
    # file on this session's cluster may have a worker restarting right now.
    names = {str(name) for name in cluster.cluster.worker_spec}
    assert set(results["worker"]) == names and len(names) == 2


def test_one_log_per_job_and_per_worker(demo_run):
    run_dir, results, _ = demo_run
    job_logs = {p.stem for p in (Path(run_dir) / "logs" / "jobs").glob("*.log")}
    assert job_logs == set(results["job_id"])
    worker_logs = sorted(p.name for p in (Path(run_dir) / "logs" / "workers").glob("*.log"))
    assert worker_logs == [f"worker-{w}.log" for w in sorted(set(results["worker"]))]
    for row in results.to_dicts():
        text = (Path(run_dir) / "logs" / "workers" / f"worker-{row['worker']}.log").read_text()
        assert f"{row['job_id']} attempt=1 done" in text


def test_rerun_executes_no_job_and_changes_nothing(demo_run, cluster):
    run_dir, results, _ = demo_run
    files = sorted((Path(run_dir) / "results").glob("*.parquet"))
    stamps = [(f.name, f.stat().st_mtime_ns) for f in files]
    arrived = []
    again = run_sweep(sweep_from_dict(demo_data()), run_dir, cluster.client,
                      on_result=arrived.append)
    assert arrived == []
    assert [(f.name, f.stat().st_mtime_ns) for f in files] == stamps
    assert again.sort("job_id").equals(results.sort("job_id"))
    assert read_results(run_dir).height == 7


def test_a_failed_attempt_is_retried_under_a_new_key(cluster, tmp_path, monkeypatch):
    marker = tmp_path / "failed-once"

    def flaky(source, options, device):
        if not marker.exists():
            marker.write_text("x")
            raise RuntimeError("transient failure")
        return source.build(device)

    monkeypatch.setitem(quantdask.backends._REGISTRY, "flaky",
                        Backend("flaky", flaky, sizing=UNQUANTIZED))
    sweep = sweep_from_dict(sweep_dict(backends=[{"backend": "flaky", "configs": [{}]}],
                                       retries=1))
    results = run_sweep(sweep, tmp_path / "run", cluster.client)
    row = results.filter(pl.col("backend") == "flaky").row(0, named=True)
    assert row["status"] == "done" and row["attempts"] == 2
    log = (tmp_path / "run" / "logs" / "jobs" / f"{row['job_id']}.log").read_text()
    assert "attempt=1 failed (job_error): RuntimeError: transient failure" in log
    assert "attempt=2 done" in log


def test_a_job_failing_every_attempt_is_recorded_failed_once(cluster, tmp_path, monkeypatch):
    def broken(source, options, device):
        raise RuntimeError(f"broken backend, options {options}")

    monkeypatch.setitem(quantdask.backends._REGISTRY, "broken",
                        Backend("broken", broken, sizing=UNQUANTIZED))
    sweep = sweep_from_dict(sweep_dict(backends=[{"backend": "broken", "configs": [{}]}],
                                       retries=2))
    results = run_sweep(sweep, tmp_path / "run", cluster.client)
    assert sorted(results["status"]) == ["done", "failed"]
    row = results.filter(pl.col("status") == "failed").row(0, named=True)
    assert row["attempts"] == 3 and row["error_class"] == "RuntimeError"
    assert "broken backend" in row["error_message"] and "Traceback" in row["traceback"]
    assert len(list((tmp_path / "run" / "results").glob("*.parquet"))) == 2
    # A rerun tries the failed job again, and only that one.
    arrived = []
    run_sweep(sweep, tmp_path / "run", cluster.client, on_result=arrived.append)
    assert [r["job_id"] for r in arrived] == [row["job_id"]]


def test_servers_bind_to_loopback_only(cluster):
    assert cluster.client.scheduler.address.startswith("tcp://127.0.0.1:")
    assert cluster.dashboard_link.startswith("http://127.0.0.1:")
    for address in cluster.client.scheduler_info(n_workers=-1)["workers"]:
        assert address.startswith("tcp://127.0.0.1:")
    me = psutil.Process()
    listening = [c.laddr.ip for p in [me, *me.children(recursive=True)]
                 for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and set(listening) <= {"127.0.0.1"}


def test_a_local_cluster_never_hard_closes_a_slot_it_once_lost(cluster):
    """Dask's local clusters close a nanny for good when, ``lost-worker-timeout`` after its
    worker left, no worker of that name is back. That timer outlived the loss it was set for: a
    worker killed by a job (back within a second) and restarted for a hung job 15 s later lost
    its nanny in the middle of the restart, and the cluster stayed a slot short. quantdask's
    local clusters (CPU and CUDA) keep their nannies, which bring their workers back."""
    import dask
    from dask.utils import parse_timedelta

    timeout_s = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
    assert timeout_s >= 24 * 3600


# In the worker process that imports this module: both packed jobs must be in it at once.
BOTH_PACKED_JOBS = threading.Barrier(2)


def waits_for_its_neighbour_then_builds(source, options, device):
    """Returns only once the other packed job is running too (in another of the worker's
    threads): a worker that ran them one after the other fails both (BrokenBarrierError)."""
    BOTH_PACKED_JOBS.wait(timeout=60)
    return source.build(device)


def test_jobs_per_gpu_packs_jobs_on_one_worker(tmp_path, monkeypatch):
    from quantdask.cluster.local import start_cluster

    monkeypatch.setitem(quantdask.backends._REGISTRY, "packed", Backend(
        "packed", waits_for_its_neighbour_then_builds,
        options={"n": quantdask.backends.Option(int)}, sizing=UNQUANTIZED))
    sweep = sweep_from_dict(sweep_dict(backends=[{"backend": "packed", "grid": {"n": [1, 2]}}],
                                       jobs_per_gpu=2))
    with start_cluster(workers=1, jobs_per_worker=2) as cluster:
        results = run_sweep(sweep, tmp_path / "run", cluster.client)
    rows = results.filter(pl.col("backend") == "packed").sort("started_at").to_dicts()
    assert [r["status"] for r in rows] == ["done", "done"]
    assert rows[0]["worker"] == rows[1]["worker"]
    assert rows[1]["started_at"] < rows[0]["finished_at"]  # they ran at the same time
    logs = [(tmp_path / "run" / "logs" / "jobs" / f"{r['job_id']}.log").read_text() for r in rows]
    assert rows[1]["job_id"] not in logs[0] and rows[0]["job_id"] not in logs[1]


def test_every_frame_reads_back_and_each_done_job_has_its_phases(demo_run):
    import quantdask as qd
    from quantdask.store.schema import FRAMES

    run_dir, results, _ = demo_run
    frames = qd.read_frames(run_dir)
    assert list(frames) == [frame.name for frame in FRAMES]
    for frame in FRAMES:  # each in its declared schema, read by name as by its own reader
        assert frames[frame.name].schema == pl.Schema(frame.schema), frame.name
    assert frames["results"].equals(read_results(run_dir))
    phases = frames["phases"]
    done = results.filter(pl.col("status") == "done")
    assert set(phases["job_id"]) == set(done["job_id"])
    table = qd.report.phases_table(results, phases)
    assert table.height == done.height and "score" in table.columns
    # The job's peak is at least its largest phase's, which the table names.
    joined = table.join(done.select("config_label", pl.col("peak_device_mem_bytes")
                                    .alias("job_peak")), on="config_label")
    assert (joined["peak_device_mem_bytes"] <= joined["job_peak"]).all()
    assert set(table["peak_phase"]) <= set(phases["phase"])
    with pytest.raises(qd.SchemaError, match="the frames are results, layers"):
        qd.read_frame(run_dir, "phase")


def llama_cpp_features() -> str | None:
    """The CPU features llama.cpp was built with, asked of llama-cpp-python's own bindings
    (imported here, as the environment record does not), or None where it is absent."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    return " ".join(part.split("=")[0].strip().split(" : ")[-1] for part in
                    llama_cpp.llama_print_system_info().decode().split("|")
                    if part.strip().endswith("= 1"))


def test_each_session_records_the_environment_of_the_driver_and_every_worker(demo_run, cluster,
                                                                            capsys):
    from importlib.metadata import version

    from quantdask.cli.main import main
    from quantdask.store.environment import latest_environment

    run_dir, _, _ = demo_run
    env = read_environment(run_dir)
    workers = set(cluster.client.scheduler_info()["workers"])
    sessions = read_sessions(run_dir)
    assert set(env["run_id"]) == set(sessions["run_id"])  # every session (the rerun's too)
    first = env.filter(pl.col("run_id") == sessions["run_id"][0])
    assert set(first["process"]) == {"driver", *workers}
    by_process = {p: dict(first.filter(pl.col("process") == p)
                          .select("component", "value").iter_rows()) for p in workers}
    for values in by_process.values():  # each worker's, as its own process reads it
        assert values["torch"] == version("torch")
        assert values["bitsandbytes"] == version("bitsandbytes")
        assert values["transformers"] == version("transformers")
        assert values["cuda"].startswith("none") and values["gpu"] == "no GPU visible"
        features = llama_cpp_features()  # the build GGUF jobs run in: version, commit, flags
        assert (values["llama.cpp"] == "not installed" if features is None else re.fullmatch(
            rf"ggml \d+\.\d+\.\d+ \(\w+(-dirty)?\); {features}", values["llama.cpp"]))
    latest = latest_environment(env)
    assert latest["python"] == ".".join(map(str, sys.version_info[:3]))
    main(["status", str(run_dir)])
    shown = capsys.readouterr().out
    assert f"torch {version('torch')}" in shown and "environment: " in shown


def test_a_closing_cluster_drops_only_the_heartbeats_shutdown_race(caplog):
    """Once quantdask closes its cluster, a worker's heartbeat that meets the closed scheduler
    logs nothing (it once put a traceback on the demo's stderr); its other lines stay."""
    import asyncio
    import logging

    from quantdask.cluster.local import _not_a_shutdown_race, quiet_shutdown_races

    worker_log = logging.getLogger("distributed.worker")
    try:
        asyncio.run(quiet_shutdown_races())
        with caplog.at_level(logging.INFO, logger="distributed.worker"):
            worker_log.error("Failed to communicate with scheduler during heartbeat.")
            worker_log.warning("Scheduler was unaware of this worker; shutting down.")
            worker_log.warning("Worker is at 85% memory usage.")
        assert [r.getMessage() for r in caplog.records] == ["Worker is at 85% memory usage."]
    finally:
        worker_log.removeFilter(_not_a_shutdown_race)
