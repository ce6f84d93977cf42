"""Sweeps beside the notebook: qd.submit_sweep's handle on real local clusters. It returns at
once and waits for the same results as a blocking run; cancel then rerun finishes exactly the
rest; two handles share one client; an interrupt stops only the waiting; the progress widget's
values after each result; a live chart redrawn as results arrive."""

from __future__ import annotations

import _thread
import signal
import threading
import time

import polars as pl
import pytest
import yaml

import quantdask as qd
from quantdask.sweepfile.sweep_file import sweep_from_dict
from quantdask.words import AttemptEnd, Status
from tests.conftest import sweep_dict, with_slow_jobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

METRICS = ["job_id", "status", "perplexity", "kl_divergence", "top1_agreement", "size_bytes"]


def slow_sweep(name: str = "t", bits=(4, 8), slow: bool = True) -> qd.Sweep:
    """The baseline and a config per bit width, each quantized job 1.5 s slower (no CPU): surely
    still running a moment after it was submitted. ``slow=False``: the same jobs (a fault is
    not part of a job's id) at their own pace."""
    data = sweep_dict(name=name, backends=[{"backend": "bitsandbytes",
                                            "grid": {"bits": list(bits)}}])
    return sweep_from_dict(with_slow_jobs(data) if slow else data)


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def test_submit_returns_at_once_and_waits_for_what_a_blocking_run_gives(cluster, tmp_path):
    started = time.monotonic()
    handle = qd.submit_sweep(slow_sweep(), tmp_path / "handle", cluster.client)
    assert time.monotonic() - started < 5.0
    assert not handle.done() and handle.results.height < 3
    assert "sweep t (running)" in repr(handle)  # the plain-text view outside a notebook
    results = handle.wait()
    assert handle.done() and results["status"].to_list() == ["done"] * 3
    progress = handle.progress
    assert progress.finished and progress.completed and progress.counts["done"] == 3
    blocking = qd.run_sweep(slow_sweep(slow=False), tmp_path / "blocking", cluster.client)
    assert blocking.select(METRICS).sort("job_id").equals(results.select(METRICS).sort("job_id"))
    assert handle.failures().is_empty()
    assert "done in" in handle.logs("nf4") or "done in" in handle.logs(results["job_id"][0])


def test_cancel_then_rerun_finishes_exactly_the_rest_none_twice(cluster, tmp_path):
    run_dir = tmp_path / "run"
    sweep = sweep_from_dict(with_slow_jobs(sweep_dict(backends=[
        {"backend": "bitsandbytes", "grid": {"bits": [4], "quant_type": ["nf4", "fp4"],
                                             "double_quant": [False, True]}}])))
    handle = qd.submit_sweep(sweep, run_dir, cluster.client)
    wait_for(lambda: handle.progress.running)  # a quantized job began (1.5 s of sleep)
    cancelled = handle.cancel()
    assert handle.done() and cancelled
    first = qd.read_results(run_dir)
    attempts = qd.read_attempts(run_dir)
    stopped = attempts.filter(pl.col("status") == AttemptEnd.CANCELLED)["job_id"]
    assert set(stopped) == set(cancelled)
    assert not set(cancelled) & set(first["job_id"])  # a cancelled job has no result
    assert qd.read_sessions(run_dir)["completed"].to_list() == [False]
    rest = {job.id for job in qd.expand_grid(sweep)} - set(first["job_id"])
    assert rest and len(first) + len(rest) == 5

    again = qd.run_sweep(sweep, run_dir, cluster.client)
    assert again.height == 5 and (again["status"] == Status.DONE).all()
    sessions = qd.read_sessions(run_dir).sort("started_at")
    second = qd.read_attempts(run_dir).filter(pl.col("run_id") == sessions["run_id"][1])
    assert sorted(second["job_id"]) == sorted(rest)  # exactly the rest, each once
    assert sessions["jobs_run"].to_list()[1] == len(rest)


def test_two_handles_on_one_client_run_side_by_side(cluster, tmp_path):
    first = qd.submit_sweep(slow_sweep("first", bits=(4,)), tmp_path / "a", cluster.client)
    second = qd.submit_sweep(slow_sweep("second", bits=(8,)), tmp_path / "b", cluster.client)
    assert not first.done() and not second.done()  # both running at once
    for handle, name, run_dir in ((first, "first", "a"), (second, "second", "b")):
        results = handle.wait()
        assert results["status"].to_list() == ["done"] * 2
        [session] = qd.read_sessions(tmp_path / run_dir).to_dicts()
        assert session["sweep"] == name and session["completed"] and session["jobs_run"] == 2
        # Each saw its own jobs start (the job-start events reach both sweeps).
        assert sum("start" in e["text"] for e in handle.progress.events) >= 2
        assert set(qd.read_attempts(tmp_path / run_dir)["job_id"]) == set(results["job_id"])


def test_an_interrupt_while_waiting_stops_only_the_waiting(cluster, tmp_path):
    # Python's own SIGINT handler, as in a Jupyter kernel (dask_jobqueue.runner, imported by
    # another test in this process, replaces it with one that exits).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupted_while_waiting(cluster, tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupted_while_waiting(cluster, tmp_path) -> None:
    handle = qd.submit_sweep(slow_sweep(), tmp_path / "run", cluster.client)
    threading.Timer(0.3, _thread.interrupt_main).start()  # what a kernel interrupt does
    with pytest.raises(KeyboardInterrupt):
        handle.wait()
    assert not handle.done()  # the sweep goes on
    assert handle.wait()["status"].to_list() == ["done"] * 3
    assert qd.read_sessions(tmp_path / "run")["completed"].to_list() == [True]


def test_the_progress_widget_after_each_result(cluster, tmp_path):
    from quantdask.run.widget import ProgressWidget

    handle = qd.submit_sweep(slow_sweep(), tmp_path / "run", cluster.client)
    widget = ProgressWidget(handle)
    seen = []
    handle.on_result(lambda record: seen.append(
        (record["status"], widget.bars[Status.DONE].value, widget.counts[Status.DONE].value,
         widget.bars[Status.DONE].max)))
    handle.wait()
    assert [s[1] for s in seen] == [1, 2, 3]
    assert [s[2] for s in seen] == ["1 done", "2 done", "3 done"] and {s[3] for s in seen} == {3}
    assert "(finished): 3 of 3 jobs settled" in widget.title.value
    assert widget.running.value == "<b>running</b>: none" and widget.failures.value == ""
    assert "Dask dashboard" in widget.title.value


def test_a_live_chart_is_redrawn_after_each_result(cluster, tmp_path):
    handle = qd.submit_sweep(slow_sweep(), tmp_path / "run", cluster.client)
    drawn = []
    out = qd.report.live(handle, lambda results: (drawn.append(results.height),
                                                  qd.report.quality_chart(results))[1])
    handle.wait()
    # Drawn now, and again after each result that came after (sorted: never an older frame).
    assert drawn[-1] == 3 and drawn == sorted(drawn)
    assert set(range(drawn[0], 4)) <= set(drawn)
    [output] = out.outputs
    assert "nf4" in str(output["data"]) and "int8" in str(output["data"])


def test_await_handle_in_async_code(cluster, tmp_path):
    import asyncio

    async def main():
        handle = qd.submit_sweep(slow_sweep(), tmp_path / "run", cluster.client)
        return await handle

    assert asyncio.run(main())["status"].to_list() == ["done"] * 3


def test_a_kernel_killed_mid_sweep_is_a_killed_driver_the_next_run_resumes(cluster, tmp_path):
    """A real Jupyter kernel submits a sweep to this cluster and is shut down mid-sweep (the
    kernel's process killed): the run directory is released and the next run finishes every
    job, each with one result."""
    from jupyter_client.manager import start_new_kernel

    run_dir = tmp_path / "run"
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(with_slow_jobs(sweep_dict(backends=[
        {"backend": "bitsandbytes", "grid": {"bits": [4, 8]}}]))))
    manager, kernel = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        kernel.execute_interactive(
            "import quantdask as qd\nfrom distributed import Client\n"
            f"client = Client({cluster.client.scheduler.address!r})\n"
            f"handle = qd.submit_sweep(qd.load_sweep({str(sweep_file)!r}), {str(run_dir)!r}, "
            "client)\n", timeout=120)
        wait_for(lambda: (progress := qd.read_progress(run_dir)) is not None
                 and bool(progress.running))  # a job is running in the kernel's sweep
    finally:
        manager.shutdown_kernel(now=True)  # killed, as a restart or a crash does
    assert qd.read_sessions(run_dir)["finished_at"].to_list() == [None]
    results = qd.run_sweep(qd.load_sweep(sweep_file), run_dir, cluster.client)
    assert results.height == 3 and (results["status"] == Status.DONE).all()
    assert len(list((run_dir / "results").glob("*.parquet"))) == 3
    assert len(qd.read_sessions(run_dir)) == 2
