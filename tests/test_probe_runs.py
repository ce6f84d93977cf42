"""A search's tasks fail as a sweep's jobs do (search.probe_runs), on the session's real
cluster: each failure class gets the table's answer (a backoff, more room, a restart at the
deadline, no retry at all), and past the retries the search stops naming the task."""

from __future__ import annotations

import threading
import uuid

import pytest

from quantdask.cluster import operations
from quantdask.search.probe_runs import ProbeFailed, ProbeRules, ProbeTask, Room, run_probe_tasks
from quantdask.words import FailureClass

pytestmark = pytest.mark.timeout(120)

RULES = ProbeRules(retries=2, timeout_s=3600.0, backoff_s=0.05)
ROOM = Room({"GPU": 0.5}, batch_size=8)


def failing_first(counter: str, first: str, then_sleep: float = 0.0, hold_until: str = ""):
    """A task that raises ``first`` (an exception's name, "" for none) on its first attempt
    (or sleeps ``then_sleep`` seconds, or until the file ``hold_until`` exists, announcing its
    start) and then returns (its attempt, the batch it was given, the resources Dask held for
    it). Made by value for the workers."""
    def task(batch_size: int):
        import builtins
        import pathlib
        import time

        from quantdask.errors import UnsupportedHere
        from quantdask.process.runtime import announce_start, held_resources

        path = pathlib.Path(counter)
        number = int(path.read_text() or 0) + 1 if path.exists() else 1
        path.write_text(str(number))
        announce_start()
        if number == 1 and hold_until:
            deadline = time.monotonic() + 60.0
            while not pathlib.Path(hold_until).exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        elif number == 1 and then_sleep:
            time.sleep(then_sleep)
        elif number == 1 and first:
            raise (UnsupportedHere if first == "UnsupportedHere"
                   else getattr(builtins, first))(f"{first} on purpose")
        return number, batch_size, held_resources()
    return task


def tasks_of(client, functions: dict[str, object]) -> list[ProbeTask]:
    return [ProbeTask(what, lambda room, key, _, f=function: client.submit(
        f, room.batch_size, resources=room.resources, key=key, pure=False))
        for what, function in functions.items()]


def run_all(client, functions, rules=RULES, **kwargs) -> dict[str, tuple]:
    tasks = tasks_of(client, functions)
    tag = f"t-{uuid.uuid4().hex[:8]}"  # a Dask key is global: never an earlier test's task
    return {tasks[i].what: future.result()
            for i, future in run_probe_tasks(client, tasks, ROOM, rules, tag, **kwargs)}


def test_each_failure_class_gets_the_tables_answer(cluster, tmp_path):
    got = run_all(cluster.client, {
        "error": failing_first(str(tmp_path / "error"), "ValueError"),
        "oom": failing_first(str(tmp_path / "oom"), "MemoryError"),
        "fine": failing_first(str(tmp_path / "fine"), "")})
    assert got["fine"] == (1, 8, {"GPU": 0.5})
    assert got["error"] == (2, 8, {"GPU": 0.5})  # after the backoff, in the same room
    assert got["oom"] == (2, 4, {"GPU": 1.0})  # a whole device, half the batch


def test_a_task_past_its_retries_or_unsupported_stops_the_search_naming_it(cluster, tmp_path):
    def always(path: str):
        inner = failing_first(path, "RuntimeError")

        def task(batch_size: int):
            import pathlib
            pathlib.Path(path).unlink(missing_ok=True)  # every attempt is a first
            return inner(batch_size)
        return task

    with pytest.raises(ProbeFailed, match="probe chunk 1 failed 3 times, last as job_error: "
                                          "RuntimeError: RuntimeError on purpose") as failed:
        run_all(cluster.client, {"probe chunk 1": always(str(tmp_path / "always"))})
    assert failed.value.failure_class == FailureClass.JOB_ERROR
    with pytest.raises(ProbeFailed, match="failed 1 time, last as unsupported"):
        run_all(cluster.client, {"units": failing_first(str(tmp_path / "u"), "UnsupportedHere")})
    assert (tmp_path / "u").read_text() == "1"  # never retried


def test_a_task_past_its_deadline_is_cut_its_worker_restarted_and_it_runs_again(
        cluster, tmp_path, monkeypatch):
    restarted: list[str | None] = []
    released = tmp_path / "restarted"  # the first attempt holds until its worker "restarts":
    # it cannot end before its cut, however slow the polls (a fixed sleep raced them in CI)

    def restart(client, address, wait=True) -> None:
        restarted.append(address)
        released.touch()

    monkeypatch.setattr(operations, "restart_worker", restart)
    now = [0.0]  # the driver's clock: each poll moves it on 10 s

    def tick() -> None:
        now[0] += 10.0

    rules = ProbeRules(retries=2, timeout_s=30.0, backoff_s=0.05)
    slow = failing_first(str(tmp_path / "slow"), "", hold_until=str(released))
    got = run_all(cluster.client, {"slow": slow}, rules, tick=tick, clock=lambda: now[0])
    assert got["slow"][0] == 2
    assert len(restarted) == 1 and restarted[0] in cluster.client.scheduler_info()["workers"]


def test_a_stop_cancels_what_runs_and_returns(cluster, tmp_path):
    stop = threading.Event()
    stop.set()
    assert run_all(cluster.client, {"slow": failing_first(str(tmp_path / "s"), "", 2.0)},
                   stop=stop) == {}
