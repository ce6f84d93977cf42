"""Nothing lost: every failure class on a real LocalCluster, worker chaos, a killed driver."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest
import yaml

import quantdask.backends
from quantdask.backends import Backend
from quantdask.backends.base import UNQUANTIZED
from quantdask.cli.main import main
from quantdask.cluster.local import start_cluster
from quantdask.run.sweep import run_sweep
from quantdask.store.readers import read_attempts, read_results
from quantdask.store.run_store import RunStore
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import REPO, sweep_dict

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def fault_cluster():
    """A cluster of its own: these tests kill and restart workers (each waits for both to be
    back), and the last retires one; the session's cluster stays whole."""
    with start_cluster(workers=2) as handle:
        yield handle

BNB = "bitsandbytes"


def result_files(run_dir) -> list[Path]:
    return sorted((Path(run_dir) / "results").glob("*.parquet"))


@pytest.mark.timeout(240)
def test_each_failure_class_gets_its_treatment(fault_cluster, tmp_path):
    cluster = fault_cluster
    data = sweep_dict(
        backends=[{"backend": BNB, "grid": {"bits": [4, 8]}},
                  {"backend": "torchao", "configs": [{"mode": "int4_weight_only",
                                                     "group_size": 256}]}],
        retries=2, jobs_per_gpu=2,  # half a device each, so a whole one is a change
        # (nf4's out-of-memory retry halves its batch; LLM.int8's would keep it)
        faults=[{"config": "int8 t=6", "attempt": 1, "kind": "raise"},
                {"config": "nf4", "attempt": 1, "kind": "oom"}],
    )
    results = run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client)
    rows = {row["config_label"]: row for row in results.to_dicts()}
    assert {k: v["status"] for k, v in rows.items()} == {
        "baseline": "done", "nf4": "done", "int8 t=6": "done", "ao int4wo g256": "skipped"}
    assert rows["nf4"]["attempts"] == 2 and rows["int8 t=6"]["attempts"] == 2
    assert rows["ao int4wo g256"]["failure_class"] == "unsupported"
    attempts = read_attempts(tmp_path / "run").join(
        results.select("job_id", "config_label"), on="job_id")
    failed = dict(attempts.filter(pl.col("status") == "failed")
                  .select("config_label", "failure_class").iter_rows())
    assert failed["int8 t=6"] == "job_error" and failed["nf4"] == "out_of_memory"
    assert attempts.height == results["attempts"].sum()  # one row per try
    # The out-of-memory retry asks for a whole device (not half), half the eval batch (8 -> 4)
    # and twice the device memory ...
    ran = {a["attempt"]: a for a in attempts.filter(pl.col("config_label") == "nf4")
           .to_dicts()}
    assert (ran[1]["eval_batch_size"], ran[2]["eval_batch_size"]) == (8, 4)
    assert (ran[1]["gpu_share"], ran[2]["gpu_share"]) == (0.5, 1.0)
    memory = (ran[1]["device_memory_request_bytes"], ran[2]["device_memory_request_bytes"])
    assert memory[0] > 1_000_000 and memory[1] == 2 * memory[0]
    oom_log = (tmp_path / "run" / "logs" / "jobs" / f"{rows['nf4']['job_id']}.log")
    oom_log = oom_log.read_text()
    assert re.search(r"out_of_memory: retrying with a whole device, eval batch 4 and [\d,]+ "
                     r"bytes of device memory", oom_log)
    # ... and that is what each attempt ran with: the resources its worker held for the task,
    # as the scheduler granted them, and the batch it evaluated in.
    for number, batch in ((1, 8), (2, 4)):
        assert f"attempt={number} start on worker {ran[number]['worker']} (" in oom_log
        held = re.search(rf"attempt={number} start on .*; eval batch {batch}; holding "
                         rf"GPU=([\d.]+), DEVICE_MEMORY=([\d,]+)\n", oom_log)
        assert held, oom_log
        assert (float(held[1]), int(held[2].replace(",", ""))) == (ran[number]["gpu_share"],
                                                                   memory[number - 1])
    # A retry runs on another worker than the one its attempt failed on.
    for label in ("nf4", "int8 t=6"):
        workers = attempts.filter(pl.col("config_label") == label).sort("attempt")["worker"]
        assert workers[0] != workers[1] and None not in workers.to_list(), label
    assert len(result_files(tmp_path / "run")) == 4  # each job's result written once


@pytest.mark.timeout(120)
def test_a_job_failing_every_attempt_makes_exactly_one_retry_with_retries_1(fault_cluster,
                                                                             tmp_path):
    """Every attempt of nf4 raises (faults on attempts 1 to 3): with ``retries: 1`` it is tried
    twice, recorded failed, and the attempts frame holds exactly those two tries."""
    data = sweep_dict(retries=1, faults=[{"config": "nf4", "attempt": n, "kind": "raise"}
                                         for n in (1, 2, 3)])
    results = run_sweep(sweep_from_dict(data), tmp_path / "run", fault_cluster.client)
    row = results.filter(pl.col("config_label") == "nf4").row(0, named=True)
    assert (row["status"], row["failure_class"], row["attempts"]) == ("failed", "job_error", 2)
    attempts = read_attempts(tmp_path / "run").filter(pl.col("job_id") == row["job_id"])
    assert sorted(attempts["attempt"].to_list()) == [1, 2]
    assert attempts["failure_class"].to_list() == ["job_error"] * 2


def worker_pids(client) -> dict[str, int]:
    """Worker name -> pid of its worker process."""
    names = {a: str(w["name"]) for a, w in
             client.scheduler_info(n_workers=-1)["workers"].items()}
    return {names[a]: pid for a, pid in client.run(os.getpid, on_error="ignore").items()
            if a in names}


def starts_of(client, key: str, since: float) -> int:
    """How many times a worker began the task ``key`` after ``since`` (a ``time.time()``; job
    ids repeat across this module's sweeps)."""
    from quantdask.process.runtime import JOB_START_TOPIC

    return sum(1 for at, event in client.get_events(JOB_START_TOPIC)
               if event["key"] == key and at >= since)


@pytest.mark.timeout(240)
def test_a_job_that_kills_its_worker_is_retried_as_worker_lost(fault_cluster, tmp_path):
    cluster = fault_cluster
    cluster.client.wait_for_workers(2, timeout=120)
    before, since = worker_pids(cluster.client), time.time()
    data = sweep_dict(retries=2, faults=[{"config": "nf4", "attempt": 1, "kind": "kill"}])
    results = run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client)
    row = results.filter(pl.col("config_label") == "nf4").row(0, named=True)
    assert results["status"].to_list() == ["done", "done"] and row["attempts"] == 2
    attempts = read_attempts(tmp_path / "run").filter(pl.col("job_id") == row["job_id"])
    attempts = attempts.sort("attempt")
    assert attempts["failure_class"].to_list() == ["worker_lost", None]
    assert len(result_files(tmp_path / "run")) == 2
    # One death per attempt: Dask did not rerun the killing attempt on its own (it would kill
    # again, once per silent rerun), and only the worker it ran on was replaced.
    assert [starts_of(cluster.client, key, since) for key in attempts["key"]] == [1, 1]
    cluster.client.wait_for_workers(2, timeout=120)
    after = worker_pids(cluster.client)
    assert [name for name in before if after.get(name) != before[name]] == [attempts["worker"][0]]


@pytest.mark.timeout(240)
def test_a_hang_is_cut_at_the_deadline_and_retried_on_a_fresh_worker(fault_cluster, tmp_path):
    cluster = fault_cluster
    cluster.client.wait_for_workers(2, timeout=120)
    before = worker_pids(cluster.client)
    # 6 s: several times what a demo job takes on a loaded machine (under 1.5 s, the retry on
    # the fresh worker included), so only the hang is cut; the hang is waited on to the end.
    data = sweep_dict(retries=1, timeout_s=6,
                      faults=[{"config": "nf4", "attempt": 1, "kind": "hang"}])
    started = time.monotonic()
    results = run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client)
    elapsed = time.monotonic() - started
    row = results.filter(pl.col("config_label") == "nf4").row(0, named=True)
    assert row["status"] == "done" and row["attempts"] == 2
    assert elapsed < 150  # the deadline plus a worker restart, not a hang
    attempts = read_attempts(tmp_path / "run").filter(pl.col("job_id") == row["job_id"])
    attempts = attempts.sort("attempt")
    assert attempts["failure_class"].to_list() == ["timeout", None]
    hung_on = attempts["worker"][0]
    log = (tmp_path / "run" / "logs" / "jobs" / f"{row['job_id']}.log").read_text()
    assert ("failed outside the job (timeout): JobTimeout: no result after timeout_s=6s on "
            f"worker {hung_on}; the worker was restarted") in log
    worker_logs = (tmp_path / "run" / "logs" / "workers").glob("worker-*.log")
    assert any("JobTimeout: no result" in p.read_text() for p in worker_logs)
    # The hung worker was really replaced (a new process under its name), the other was not.
    cluster.client.wait_for_workers(2, timeout=120)
    after = worker_pids(cluster.client)
    assert [name for name in before if after.get(name) != before[name]] == [hung_on]


def slow_bitsandbytes(source, options, device):
    """bitsandbytes after two seconds: a kill within a second of a job's start hits it mid-job,
    however fast the machine, with a second to spare however slow."""
    time.sleep(2.0)
    return quantdask.backends.get_backend(BNB).quantize(source, options, device)


@pytest.mark.timeout(400)
def test_chaos_workers_killed_mid_job_every_job_one_result(fault_cluster, tmp_path,
                                                            monkeypatch):
    """Three workers SIGKILLed, each while it runs a job (the driver's own live view says
    which, and when it began): every job still has exactly one result."""
    client = fault_cluster.client
    client.wait_for_workers(2, timeout=120)
    bnb = quantdask.backends.get_backend(BNB)
    monkeypatch.setitem(quantdask.backends._REGISTRY, "slow-bnb", dataclasses.replace(
        bnb, name="slow-bnb", quantize=slow_bitsandbytes, check=None))
    data = sweep_dict(
        backends=[{"backend": "slow-bnb", "grid": {"bits": [8], "int8_threshold": [0, 2, 4]}},
                  {"backend": "slow-bnb", "grid": {"bits": [4], "quant_type": ["nf4", "fp4"],
                                                   "double_quant": [False, True]}}],
        retries=6)
    sweep, run_dir = sweep_from_dict(data), tmp_path / "run"
    running: dict[str, dt.datetime] = {}  # worker name -> when its current job began

    def note_running(progress) -> None:
        running.clear()
        running.update({r.worker: dt.datetime.fromisoformat(r.started_at)
                        for r in progress.running.values() if not r.job_id.startswith("none")})

    outcome, kills = {}, []
    runner = threading.Thread(target=lambda: outcome.setdefault(
        "results", run_sweep(sweep, run_dir, client, on_progress=note_running)))
    runner.start()
    last_kill = dt.datetime.now(dt.UTC)
    while runner.is_alive() and len(kills) < 3:
        now = dt.datetime.now(dt.UTC)
        # A job that began since the last kill (so on a live process) less than a second ago.
        fresh = [w for w, began in dict(running).items()
                 if last_kill < began and now - began < dt.timedelta(seconds=1)]
        # One kill per result: the next one hits a job of the sweep as it goes on.
        if fresh and len(result_files(run_dir)) > len(kills):
            pid = worker_pids(client).get(fresh[0])
            began = running.get(fresh[0])  # still its first second, after that round trip?
            if pid is not None and began is not None and (
                    dt.datetime.now(dt.UTC) - began < dt.timedelta(seconds=1)):
                os.kill(pid, signal.SIGKILL)
                kills.append(fresh[0])
                # Never kill a worker while its nanny restarts it (a worker that dies during
                # its start is given up on): wait until both are back.
                client.wait_for_workers(2, timeout=120)
                last_kill = dt.datetime.now(dt.UTC)
        time.sleep(0.05)
    runner.join(timeout=300)
    assert not runner.is_alive(), "the sweep did not finish after the kills"
    assert "results" in outcome, "run_sweep raised; see the log above"
    results = outcome["results"]
    assert len(kills) == 3
    assert results.height == 8 and results["status"].to_list() == ["done"] * 8
    assert len(result_files(run_dir)) == 8  # no duplicate, none lost
    attempts = read_attempts(run_dir)
    lost = attempts.filter(pl.col("failure_class") == "worker_lost")
    assert lost.height == 3, "each kill hit a running job, which counted one attempt"
    assert attempts.height == 8 + 3
    client.wait_for_workers(2, timeout=120)
    print(f"chaos: {len(kills)} workers killed mid-job ({', '.join(kills)}), "
          f"{lost.height} attempts lost with them, 8 jobs done, 0 lost, 0 duplicated")


def quantdask_run(sweep: str, run_dir: Path, scheduler: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "quantdask.cli", "run", sweep, "--scheduler", scheduler,
         "--run-dir", str(run_dir), "--no-report"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True)


@pytest.mark.timeout(600)
def test_killing_the_driver_then_rerunning_finishes_without_rerunning_or_duplicating(
        fault_cluster, tmp_path, capsys):
    # The first driver is a `quantdask run` process on this module's cluster: a driver killed
    # with kill -9 leaves the workers (and whatever they still run for it) behind, as on real
    # nodes.
    scheduler = fault_cluster.client.scheduler.address
    fault_cluster.client.wait_for_workers(2, timeout=120)
    data = sweep_dict(backends=[{"backend": BNB, "grid": {
        "bits": [4], "quant_type": ["nf4", "fp4"], "double_quant": [False, True]}},
        {"backend": BNB, "grid": {"bits": [8]}}], retries=2)
    # Short jobs will do: the first driver is frozen (SIGSTOP) within a poll of its first result,
    # and a frozen driver records nothing, whatever its workers go on to finish.
    data["eval"].update(seq_len=64, samples=16)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    first = quantdask_run(str(sweep), run_dir, scheduler)
    try:
        deadline = time.monotonic() + 240

        def wait_for_results(n: int) -> None:
            while len(result_files(run_dir)) < n and time.monotonic() < deadline:
                assert first.poll() is None, first.communicate()
                time.sleep(0.2)

        wait_for_results(1)
        # Frozen mid-sweep (jobs still to go; results are polled every 0.2 s), it
        # still holds its run directory: a second driver there (the command, in this process:
        # the lock is the other process's all the same) is refused, before any cluster.
        os.kill(first.pid, signal.SIGSTOP)
        capsys.readouterr()
        assert main(["run", str(sweep), "--run-dir", str(run_dir), "--scheduler",
                     scheduler]) == 2
        assert "is in use by another quantdask run" in capsys.readouterr().err
        os.kill(first.pid, signal.SIGKILL)  # kill -9 of the driver alone, still mid-sweep
        first.wait(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):  # anything it started, if any is left
            os.killpg(first.pid, signal.SIGKILL)
    before = {p.name: p.stat().st_mtime_ns for p in result_files(run_dir)}
    assert 1 <= len(before) < 6
    # (A run id is its start to the second and random digits: a rerun within the same second
    # need not sort last, so the first driver's ids are taken before the rerun.)
    first_runs = set(read_attempts(run_dir)["run_id"])
    # The same command again (in this process: the dead driver's lock is another process's
    # all the same).
    assert main(["run", str(sweep), "--run-dir", str(run_dir), "--scheduler", scheduler,
                 "--no-report"]) == 0, capsys.readouterr().err
    after = {p.name: p.stat().st_mtime_ns for p in result_files(run_dir)}
    assert len(after) == 6 and all(after[name] == stamp for name, stamp in before.items())
    results = read_results(run_dir)
    assert results["job_id"].n_unique() == 6 and results["status"].to_list() == ["done"] * 6
    # The rerun's attempts touched only the jobs without a result.
    attempts = read_attempts(run_dir)
    rerun_jobs = set(attempts.filter(~pl.col("run_id").is_in(list(first_runs)))["job_id"])
    assert len(rerun_jobs) == 6 - len(before)
    assert rerun_jobs.isdisjoint(name.removesuffix(".parquet") for name in before)
    print(f"driver kill: {len(before)} results before the kill, {6 - len(before)} run after, "
          "0 rerun, 0 duplicated")


def hang_references_here() -> None:
    """(Run on a worker by ``client.run``.) Make this worker process's reference parts hang
    until it is restarted: a restarted worker is a fresh process, without this."""
    import quantdask.measure.reference

    def hang(*args, **kwargs):
        while True:
            time.sleep(60)

    quantdask.measure.reference._compute_shard = hang


@pytest.mark.timeout(240)
def test_a_hung_reference_is_cut_at_the_deadline_its_jobs_fail_as_timeout_then_retry(
        fault_cluster, tmp_path):
    """The driver's own cut, deterministically: every reference part hangs (not merely runs
    late) until its worker is restarted. (A part that ends late is failed by its worker: see
    tests/test_sweep_policy.py.) No job of the model can be done on that reference; each fails
    one attempt as ``timeout``, and the retries' new reference runs on the fresh workers."""
    from quantdask.process.runtime import JOB_START_TOPIC

    cluster = fault_cluster
    cluster.client.wait_for_workers(2, timeout=120)
    before, since = worker_pids(cluster.client), time.time()
    cluster.client.run(hang_references_here)
    # Two batches of windows: a part for each worker. 6 s: several times what the retries' real
    # reference and jobs need on a loaded machine, so only the hang is cut (and waited on).
    data = sweep_dict(retries=1, timeout_s=6, eval={**sweep_dict()["eval"], "batch_size": 4})
    results = run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client)
    assert results["status"].to_list() == ["done", "done"]
    assert results["attempts"].to_list() == [2, 2]
    attempts = read_attempts(tmp_path / "run").sort("job_id", "attempt")
    assert attempts["failure_class"].to_list() == ["timeout", None, "timeout", None]
    first = attempts.filter(pl.col("attempt") == 1)
    assert first["error_message"].to_list() == [
        "its model's reference (eval windows and baseline log-probs) ran past timeout_s=6s; "
        "its worker was restarted"] * 2
    # Exactly the workers that began a part of the first reference were replaced.
    hung = {event["name"] for at, event in cluster.client.get_events(JOB_START_TOPIC)
            if at >= since and re.search(r"-1-windows-\d+-\d+$", event["key"])}
    assert hung
    cluster.client.wait_for_workers(2, timeout=120)
    after = worker_pids(cluster.client)
    assert {name for name in before if after.get(name) != before[name]} == hung


def failing_on_worker_1(source, options, device):
    from distributed import get_worker

    if str(get_worker().name) == "1":
        raise RuntimeError("this device is broken")
    time.sleep(0.5)  # healthy work takes a while, so jobs are spread over both workers
    return source.build(device)


# Last in this module: it retires a worker of the module's cluster for good.
@pytest.mark.timeout(300)
def test_a_device_failing_different_jobs_is_taken_out_of_rotation(fault_cluster, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setitem(quantdask.backends._REGISTRY, "fragile",
                        Backend("fragile", failing_on_worker_1, sizing=UNQUANTIZED,
                                options={"n": quantdask.backends.Option(int)}))
    # 8 jobs: worker 1 fails them as fast as it takes them, and is out once 2 of its failures
    # ran fine on worker 0 (a second in), long before worker 0 is through them.
    data = sweep_dict(backends=[{"backend": "fragile", "grid": {"n": list(range(8))}}],
                      retries=4, exclude_device_after=2)
    cluster = fault_cluster
    cluster.client.wait_for_workers(2, timeout=120)
    results = run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client)
    remaining = {str(w["name"]) for w in
                 cluster.client.scheduler_info(n_workers=-1)["workers"].values()}
    assert results["status"].to_list() == ["done"] * 9
    excluded = RunStore(tmp_path / "run").read_excluded_workers()
    assert [e["worker"] for e in excluded] == ["1"]
    assert re.search(r"failed \d+ different jobs in a row, 2 of which then ran fine elsewhere",
                     excluded[0]["reason"])
    assert remaining == {"0"}


def _part_fails() -> None:
    raise ValueError("a reference part failed")


def _part_runs_on(seconds: float) -> int:
    time.sleep(seconds)
    return 1


def _joined(*parts) -> int:
    return sum(parts)


def _attempt_on(reference) -> object:
    return reference


@pytest.mark.timeout(60)
def test_letting_go_of_a_failed_references_parts_leaves_its_attempts_failing_with_its_error(
        cluster):
    """A failed reference's unfinished parts are let go of (``ModelReferences._settle``)
    while attempts already wait on it: those fail with the reference's error. (Cancelled,
    the parts took the reference and its attempts with them: each attempt came back
    cancelled, was requeued on a cancelled dependency and ended as worker_lost.)"""
    from quantdask.plan.references import ModelReferences

    client = cluster.client
    failing = client.submit(_part_fails, pure=False)
    running = client.submit(_part_runs_on, 3.0, pure=False)
    whole = client.submit(_joined, failing, running, pure=False)
    while not whole.done():
        time.sleep(0.05)
    attempt = client.submit(_attempt_on, whole, pure=False)
    references = ModelReferences(client, "run", lambda job: {})
    references.futures["model"] = whole
    references._parts[str(whole.key)] = [failing, running]
    references._settle()
    while not attempt.done():
        time.sleep(0.05)
    assert (whole.status, attempt.status) == ("error", "error")
    assert "a reference part failed" in str(attempt.exception())
