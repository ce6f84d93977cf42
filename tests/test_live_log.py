"""A running job's log is readable while it runs: the worker sends the attempt's lines in
batches (Dask events), the driver appends them to the job's log, and the attempt's whole log
takes their place when it ends, so the job's log holds each line once. On a real cluster, with
a job held in its quantize phase until the test releases it."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

import quantdask as qd
import quantdask.backends
from quantdask.backends import Backend, Option
from quantdask.backends.base import UNQUANTIZED
from quantdask.cli.main import main
from quantdask.process.live_log import LiveLog
from quantdask.run.attempts import Attempt
from quantdask.run.live_logs import LiveLogs
from quantdask.store.run_store import RunStore
from quantdask.sweepfile.sweep import expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from quantdask.util import utcnow
from tests.conftest import sweep_dict

LOG = logging.getLogger("quantdask.job")  # the attempt's own log


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def _logger_with(handler: logging.Handler) -> logging.Logger:
    logger = logging.getLogger(f"quantdask.test.live.{id(handler)}")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return logger


@pytest.mark.timeout(30)
def test_lines_go_out_in_batches_bounded_in_size_and_pending_ones_are_dropped_at_the_end():
    sent: list[str] = []
    handler = LiveLog(sent.append, flush_s=0.2, max_chars=100)
    logger = _logger_with(handler)
    for i in range(3):
        logger.info("line %d", i)
    assert sent == []  # batched, not one event per line
    wait_for(lambda: sent, 5)
    assert sent == ["line 0\nline 1\nline 2\n"]
    for i in range(40):  # a chatty burst: one bounded event, the rest counted
        logger.info("chatty line %02d", i)
    wait_for(lambda: len(sent) == 2, 5)
    assert len(sent[1]) < 100 + 120 and sent[1].startswith("chatty line 00\n")
    assert "more lines not shown while the attempt runs" in sent[1]
    logger.info("the last line")
    handler.close()  # the attempt ended: its whole log has this line
    time.sleep(0.4)
    assert len(sent) == 2


def _attempt(job, number: int, key: str) -> Attempt:
    return Attempt(job, number, utcnow(), key, worker_name="slot-0")


@pytest.mark.timeout(30)
def test_the_job_log_holds_each_line_once_whatever_the_attempt_ended_by(tmp_path):
    store = RunStore(tmp_path / "run").create()
    job = expand_grid(sweep_from_dict(sweep_dict()))[1]
    live, running = LiveLogs(store), {}
    log = store.job_log_path(job.id)

    def sends(key: str, text: str) -> None:
        live.on_event((time.time(), {"key": key, "text": text}))
        live.write(running.get)

    # Attempt 1 runs: its lines appear under a running line; its whole log replaces them.
    running["k1"] = _attempt(job, 1, "k1")
    sends("k1", "a1 start\n")
    sends("k1", "a1 quantize\n")
    assert "attempt=1 (running on worker slot-0)" in log.read_text()
    assert log.read_text().endswith("a1 start\na1 quantize\n")
    del running["k1"]
    live.settle("k1", job.id, "a1 start\na1 quantize\na1 failed\n", whole=True)
    sends("k1", "a1 late\n")  # sent before it ended, arrived after: the whole log has it
    assert log.read_text() == "a1 start\na1 quantize\na1 failed\n"

    # Attempt 2 runs past its deadline: no whole log comes, its lines stay, and why after them.
    running["k2"] = _attempt(job, 2, "k2")
    sends("k2", "a2 start\n")
    del running["k2"]
    live.settle("k2", job.id, "a2 timed out\n", whole=False)
    assert log.read_text() == "a1 start\na1 quantize\na1 failed\na2 start\na2 timed out\n"

    # Attempt 3's worker dies and it is requeued: its section is closed, its lines kept.
    running["k3"] = _attempt(job, 3, "k3")
    sends("k3", "a3 start\n")
    del running["k3"]
    live.write(running.get)
    text = log.read_text()
    assert text.startswith("a1 start\na1 quantize\na1 failed\na2 start\na2 timed out\na3 start\n")
    assert "attempt=3 ended without an outcome" in text and "(running" not in text
    # A job with no live lines gets its attempt's log appended, as before.
    live.settle("k4", job.id, "a4 done", whole=True)
    assert log.read_text().endswith("a4 done\n")


HELD = "held in quantize until the test releases it"


def held_until_released(source, options, device):
    """Logs, then waits (no CPU) until the file ``options.release`` exists."""
    LOG.info(HELD)
    release = Path(options.release)
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    LOG.info("released")
    return source.build(device)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_running_jobs_log_shows_its_lines_so_far_then_each_line_once(cluster, tmp_path,
                                                                        monkeypatch, capsys):
    monkeypatch.setitem(quantdask.backends._REGISTRY, "held", Backend(
        "held", held_until_released, options={"release": Option(str)}, sizing=UNQUANTIZED))
    release, run_dir = tmp_path / "release", tmp_path / "run"
    sweep = sweep_from_dict(sweep_dict(
        backends=[{"backend": "held", "grid": {"release": [str(release)]}}], layer_stats=False))
    [job] = [j for j in expand_grid(sweep) if j.backend == "held"]
    handle = qd.submit_sweep(sweep, run_dir, cluster.client)
    try:
        wait_for(lambda: HELD in handle.logs(job.id), 90)
        so_far = handle.logs(job.id)
        assert "start on worker" in so_far and "attempt=1 (running on worker" in so_far
        assert "released" not in so_far and not handle.done()
        # From the run directory alone (another process, or a worker on another machine).
        capsys.readouterr()
        assert main(["logs", str(run_dir), job.id[:8]]) == 0
        printed = capsys.readouterr().out
        assert HELD in printed and "start on worker" in printed and "released" not in printed
    finally:
        release.touch()
    results = handle.wait(120)
    assert results.filter(results["job_id"] == job.id)["status"].to_list() == ["done"]
    final = handle.logs(job.id)
    for line in ("start on worker", HELD, "released", "done in"):
        assert final.count(line) == 1, (line, final)
    assert "(running" not in final
    # The job's log is the attempt's whole log, as its worker's log has it too.
    workers = "".join(p.read_text() for p in (run_dir / "logs" / "workers").glob("*.log"))
    assert final in workers


@pytest.mark.timeout(30)
def test_live_lines_are_the_attempts_own_in_a_packed_worker():
    """The live handler takes the same thread filter as the attempt's buffer."""
    from quantdask.process.attempt import captured_log

    sent: dict[str, list[str]] = {"a": [], "b": []}
    both = threading.Barrier(2)

    def attempt(name: str) -> None:
        with captured_log(LOG, name, live=sent[name].append) as buffer:
            both.wait(5)
            for i in range(3):
                LOG.info("%s says %d", name, i)
                both.wait(5)
            # Until the batch went out (its timer, past the batching window; a loaded
            # machine may take longer than the window): closing drops what is pending.
            deadline = time.monotonic() + 5
            while "".join(sent[name]).count(" says ") < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert buffer.getvalue().count(" says ") == 3

    threads = [threading.Thread(target=attempt, args=(n,)) for n in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    for name, other in (("a", "b"), ("b", "a")):
        text = "".join(sent[name])
        assert text.count(f"{name} says") == 3 and f"{other} says" not in text
