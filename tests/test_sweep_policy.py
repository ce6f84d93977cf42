"""The driver's time-dependent policy, alone: a fake clock, fake futures, no cluster, no sleeps.

Backoff, attempt and reference deadlines, the grace for jobs no worker has room for and for a
cluster with no worker left, stranded retries, uncounted requeues, what an attempt that ended
without a result counts as, and device health. The
real-cluster tests (test_faults, test_multinode) check that the driver acts on these.
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from quantdask.errors import JobTimeout
from quantdask.job.job import run_job
from quantdask.job.outcome import failure_class_of
from quantdask.measure.reference import compute_reference, shard_rows
from quantdask.plan import policy
from quantdask.plan.health import DeviceHealth
from quantdask.plan.policy import (
    Grace,
    Requeues,
    WorkerWatch,
    outcome_of_error,
    past_deadline,
    requeue_uncounted,
    stranded,
    worker_went_away,
)
from quantdask.plan.references import ModelReferences
from quantdask.plan.retry import (
    MAX_BACKOFF_S,
    RetryQueue,
    after_failure,
    decide,
    with_more_room,
)
from quantdask.sweepfile.sweep import expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from quantdask.words import FailureClass
from tests.conftest import sweep_dict

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeFuture:
    """What ModelReferences reads of a Dask future: its key, status, done(), cancel() and
    release()."""

    def __init__(self, key: str):
        self.key, self.status = key, "pending"

    def done(self) -> bool:
        return self.status in ("finished", "error", "cancelled")

    def cancel(self) -> None:
        self.status = "cancelled"

    def release(self) -> None:
        self.status = "released"


class FakeClient:
    def __init__(self):
        self.submitted: list[tuple[tuple, dict]] = []
        self.futures: dict[str, FakeFuture] = {}
        self.replicated: list[tuple[list, list | None]] = []

    def submit(self, func, *args, key: str, **kwargs) -> FakeFuture:
        self.submitted.append((args, {"key": key, "func": func.__name__, **kwargs}))
        self.futures[key] = FakeFuture(key)
        return self.futures[key]

    def parts(self, whole: FakeFuture) -> list[FakeFuture]:
        """The futures of the parts the reference ``whole`` combines."""
        [combine] = [args for args, kwargs in self.submitted if kwargs["key"] == whole.key]
        return [arg for arg in combine if isinstance(arg, FakeFuture)]

    def replicate(self, futures, workers=None) -> None:
        self.replicated.append((futures, workers))


@pytest.fixture
def jobs():
    """The demo sweep's jobs (baseline, nf4, fp4), retries 3, timeout_s 30."""
    data = sweep_dict(retries=3, timeout_s=30,
                      backends=[{"backend": "bitsandbytes",
                                 "grid": {"bits": [4], "quant_type": ["nf4", "fp4"]}}])
    return {job.config_label: job for job in expand_grid(sweep_from_dict(data))}


# Retry backoff -------------------------------------------------------------------------------

def test_job_errors_back_off_exponentially_up_to_the_cap_then_stop(jobs):
    job = jobs["nf4"]
    delays = [decide(job, n, "job_error", backoff_s=2.0).delay_s for n in (1, 2, 3)]
    assert delays == [2.0, 4.0, 8.0]
    assert decide(job, 1, "job_error", backoff_s=1000.0).delay_s == MAX_BACKOFF_S
    last = decide(job, 4, "job_error", backoff_s=2.0)  # 3 retries allowed: attempt 4 is the end
    assert not last.retry and last.reason == "no retries left (3 allowed)"
    assert not decide(job, 1, "unsupported", 2.0).retry
    for at_once in ("worker_lost", "timeout"):
        assert decide(job, 1, at_once, 2.0).delay_s == 0.0


def test_a_retry_is_submitted_when_its_backoff_is_over_and_not_before(jobs):
    clock, queue = FakeClock(), RetryQueue()
    decision = decide(jobs["nf4"], 2, "job_error", backoff_s=5.0)  # 10 s
    queue.add(clock(), decision.delay_s, decision.job, 3, "tcp://127.0.0.1:1")
    queue.add(clock(), 0.0, jobs["fp4"], 2, None)
    assert [r.job.config_label for r in queue.pop_due(clock())] == ["fp4"]
    clock.advance(9.99)
    assert queue.pop_due(clock()) == [] and len(queue) == 1
    clock.advance(0.01)
    [due] = queue.pop_due(clock())
    assert (due.job, due.attempt, due.failed_on) == (jobs["nf4"], 3, "tcp://127.0.0.1:1")
    assert not queue


def test_an_out_of_memory_retry_gets_a_whole_device_half_the_batch_and_twice_the_memory(jobs):
    job = dataclasses.replace(jobs["nf4"], gpu_share=0.5, device_memory_bytes=1_000_000)
    decision = decide(job, 1, "out_of_memory", backoff_s=5.0)
    assert decision.retry and decision.delay_s == 0.0
    assert (decision.job.gpu_share, decision.job.eval.batch_size,
            decision.job.device_memory_bytes) == (1.0, job.eval.batch_size // 2, 2_000_000)
    assert decision.job.id == job.id  # the same job, with more room
    one = dataclasses.replace(job, eval=dataclasses.replace(job.eval, batch_size=1))
    assert with_more_room(one).eval.batch_size == 1


# Deadlines -----------------------------------------------------------------------------------

def test_an_attempt_is_past_its_deadline_only_after_timeout_s():
    running = {"a": (100.0, 30.0), "b": (110.0, 30.0), "c": (0.0, 3600.0)}
    assert past_deadline(running, now=130.0) == []  # exactly at the deadline: not yet
    assert past_deadline(running, now=130.5) == ["a"]
    assert past_deadline(running, now=141.0) == ["a", "b"]


def test_a_reference_is_cut_at_its_deadline_and_only_a_running_one(jobs):
    clock, client = FakeClock(), FakeClient()
    references = ModelReferences(client, "run", lambda job: {"GPU": 1.0}, clock)
    job = jobs["nf4"]
    future = references.future_for(job)
    assert references.future_for(jobs["fp4"]) is future  # one per model
    [part] = client.parts(future)  # one slot: one part, all the windows
    args, kwargs = client.submitted[0]
    # Its windows, its deadline, and whether its model streams (it does not).
    assert kwargs["key"] == part.key and args[-3:] == ((0, job.eval.samples), 30.0, False)
    assert kwargs["priority"] == job.priority + 10  # the worker knows its deadline
    assert kwargs["resources"] == {"GPU": 1.0}
    clock.advance(1000)  # queued, not started: no deadline runs yet
    assert references.overdue() == []
    assert references.started(part.key, "tcp://127.0.0.1:7")
    assert not references.started("some-other-task", "tcp://127.0.0.1:7")
    clock.advance(30)
    assert references.overdue() == [] and not references.was_cut(future.key)
    clock.advance(0.5)
    assert references.overdue() == [(part.key, "tcp://127.0.0.1:7")]
    assert part.status == future.status == "cancelled" and references.was_cut(future.key)
    assert references.overdue() == []  # cut once
    # The next attempt gets a fresh reference under a new key, with its own deadline.
    again = references.future_for(job)
    assert again is not future and again.key != future.key and len(client.submitted) == 4


def test_a_reference_is_computed_in_one_part_per_slot_and_a_late_part_cuts_them_all(jobs):
    clock, client = FakeClock(), FakeClient()
    references = ModelReferences(client, "run", lambda job: {}, clock, slots=lambda: 3)
    # 8 windows in batches of 4: two parts at most, whatever the slots.
    job = dataclasses.replace(jobs["nf4"], eval=dataclasses.replace(jobs["nf4"].eval,
                                                                    batch_size=4))
    future = references.future_for(job)
    first, second = client.parts(future)
    assert [args[-3] for args, kw in client.submitted if kw["func"] == "compute_reference_shard"
            ] == [(0, 4), (4, 8)]
    references.started(first.key, "tcp://127.0.0.1:7")
    clock.advance(10)
    references.started(second.key, "tcp://127.0.0.1:8")
    assert sorted(references.all_futures(), key=lambda f: f.key) == sorted(
        [future, first, second], key=lambda f: f.key)
    clock.advance(20.5)
    # The first part is late: the reference is cut, and the workers of both its running parts
    # restart (cancelling a running task leaves its thread busy; a hung one, for good).
    assert references.overdue() == [(first.key, "tcp://127.0.0.1:7"),
                                    (second.key, "tcp://127.0.0.1:8")]
    assert first.status == second.status == future.status == "cancelled"
    assert references.was_cut(future.key) and references.overdue() == []
    assert references.all_futures() == [future]  # its parts let go
    references.release()
    assert references.all_futures() == []


def test_a_done_reference_lets_go_of_its_parts_and_a_failed_ones_running_parts_stop(jobs):
    client = FakeClient()
    references = ModelReferences(client, "run", lambda job: {}, FakeClock(), slots=lambda: 2)
    job = dataclasses.replace(jobs["nf4"], eval=dataclasses.replace(jobs["nf4"].eval,
                                                                    batch_size=4))
    future = references.future_for(job)
    first, second = client.parts(future)
    first.status = second.status = future.status = "finished"
    assert references.overdue() == [] and references.all_futures() == [future]
    future.status = "error"  # say its data was lost for good: a new one is submitted
    again = references.future_for(job)
    third, fourth = client.parts(again)
    third.status = again.status = "error"  # one part failed, so did the whole
    # Released, not cancelled: a cancel would take the reference's dependents with it.
    assert references.overdue() == [] and fourth.status == "released"
    assert references.all_futures() == [again]


def test_a_reference_splits_into_contiguous_parts_of_whole_batches():
    assert shard_rows(8, 4, slots=1) == [(0, 8)]
    assert shard_rows(8, 4, slots=2) == [(0, 4), (4, 8)]
    assert shard_rows(8, 4, slots=16) == [(0, 4), (4, 8)]
    assert shard_rows(3, 4, slots=2) == [(0, 3)]  # less than a batch: one part
    assert shard_rows(140, 8, slots=3) == [(0, 48), (48, 96), (96, 140)]
    assert shard_rows(20, 8, slots=2) == [(0, 16), (16, 20)]  # the eval's own short batch last
    # Every part starts on a batch boundary of the one-pass eval: the same batches run.
    for samples, batch, slots in [(140, 8, 3), (33, 8, 2), (7, 3, 5), (64, 4, 7)]:
        parts = shard_rows(samples, batch, slots)
        assert parts[0][0] == 0 and parts[-1][1] == samples and len(parts) <= slots
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert all(start % batch == 0 and stop > start for start, stop in parts)
    assert shard_rows(5, 1, slots=0) == [(0, 5)]  # no worker yet (adaptive): one part


def test_a_reference_that_finished_in_time_is_never_cut(jobs):
    clock, client = FakeClock(), FakeClient()
    references = ModelReferences(client, "run", lambda job: {}, clock)
    future = references.future_for(jobs["nf4"])
    [part] = client.parts(future)
    references.started(part.key, "tcp://127.0.0.1:7")
    clock.advance(10)
    part.status = future.status = "finished"
    clock.advance(100)
    assert references.overdue() == [] and future.status == "finished"


def test_parked_attempts_are_released_when_their_reference_is_done_highest_priority_first(jobs):
    client = FakeClient()
    references = ModelReferences(client, "run", lambda job: {}, FakeClock())
    future = references.future_for(jobs["nf4"])
    low = dataclasses.replace(jobs["fp4"], priority=-5)
    references.park(low, 1, None, future)
    references.park(jobs["nf4"], 2, "w1", future)
    assert references.unpark_done(lambda js: ["tcp://a"]) == []
    future.status = "finished"
    released = references.unpark_done(lambda js: ["tcp://a"])
    assert [(e[0].config_label, e[1]) for e in released] == [("nf4", 2), ("fp4", 1)]
    assert client.replicated == [([future], ["tcp://a"])] and not references.parked


def test_the_worker_discards_a_result_that_came_after_the_deadline(demo_model, jobs):
    """Enforced, not best-effort: a real job of the demo model takes far more than 1 ms."""
    from quantdask.backends import get_backend

    job = dataclasses.replace(jobs["nf4"], timeout_s=0.001,
                              eval=dataclasses.replace(jobs["nf4"].eval, samples=2))
    outcome = run_job(job, get_backend(job.backend))
    record = outcome.record
    assert (record["status"], record["failure_class"], record["error_class"]) == (
        "failed", "timeout", "JobTimeout")
    assert "past timeout_s=0.001s" in record["error_message"]
    assert "perplexity" not in record and outcome.rows.get("layers", []) == []
    assert "past timeout_s=0.001s" in outcome.log


def test_a_reference_that_ends_after_its_deadline_fails_as_timeout(demo_model, jobs):
    job = jobs["nf4"]
    with open(job.eval.text_path) as f:
        text = f.read()
    with pytest.raises(JobTimeout, match="its model's reference .* past timeout_s=0.001s") as e:
        compute_reference(job.model, dataclasses.replace(job.eval, samples=2), text, 0.001)
    assert failure_class_of(e.value) == "timeout"


# Graces --------------------------------------------------------------------------------------

def test_no_room_fails_only_after_the_grace_and_a_key_that_recovers_starts_afresh():
    clock, grace = FakeClock(0.0), Grace(grace_s=120)
    assert grace.overdue({"job-a", "job-b"}, clock()) == set()
    clock.advance(60)
    assert grace.overdue({"job-a"}, clock()) == set()  # job-b found room
    clock.advance(40)
    assert grace.overdue({"job-a", "job-b"}, clock()) == set()  # job-b lacks it again at 100
    clock.advance(19)
    assert grace.overdue({"job-a", "job-b"}, clock()) == set()
    clock.advance(1)
    assert grace.overdue({"job-a", "job-b"}, clock()) == {"job-a"}
    clock.advance(99)
    assert grace.overdue({"job-a", "job-b"}, clock()) == {"job-a"}
    clock.advance(1)
    assert grace.overdue({"job-a", "job-b"}, clock()) == {"job-a", "job-b"}


def test_the_references_no_worker_has_room_for_are_the_unstarted_ones_asking_too_much(jobs):
    requests = {"nf4": 3e9, "fp4": 1e9}
    client = FakeClient()
    references = ModelReferences(
        client, "run", lambda job: {"DEVICE_MEMORY": requests[job.config_label]},
        FakeClock(), slots=lambda: 2)
    nf4 = dataclasses.replace(jobs["nf4"], eval=dataclasses.replace(jobs["nf4"].eval,
                                                                    batch_size=4))
    big = references.future_for(nf4)
    first, second = client.parts(big)
    assert references.unfit(room=2e9) == {first.key: 3e9, second.key: 3e9}
    assert references.unfit(room=4e9) == {}
    references.started(first.key, "tcp://127.0.0.1:7")
    assert references.unfit(room=2e9) == {second.key: 3e9}  # the other part still waits
    references.park(nf4, 1, None, big)
    [(job, _, _, _)] = references.abandon(second.key)  # failing it fails the whole reference
    assert job is nf4 and big.status == first.status == "cancelled"
    assert references.unfit(room=2e9) == {}


def test_a_cluster_is_gone_only_after_it_had_workers_and_lost_them_for_the_grace():
    clock, watch = FakeClock(), WorkerWatch(grace_s=120)
    watch.observe(0, clock())  # still starting (a SLURM queue): waited for, however long
    clock.advance(1000)
    watch.observe(0, clock())
    assert not watch.gone(clock())
    watch.observe(2, clock())
    clock.advance(5)
    watch.observe(0, clock())
    clock.advance(119)
    watch.observe(0, clock())
    assert not watch.gone(clock())
    clock.advance(1)
    assert watch.gone(clock())
    watch.observe(1, clock())  # one came back: the grace starts again next time
    assert not watch.gone(clock())


# Stranded retries and uncounted requeues -----------------------------------------------------

def test_a_retry_whose_allowed_workers_all_left_is_stranded():
    waiting = {"only-w1": ["tcp://w1"], "anywhere": [], "w1-or-w2": ["tcp://w1", "tcp://w2"]}
    assert stranded(waiting, {"tcp://w1", "tcp://w2"}) == []
    assert stranded(waiting, {"tcp://w2"}) == ["only-w1"]
    assert stranded(waiting, set()) == ["only-w1", "w1-or-w2"]


@pytest.mark.parametrize(("lost", "cut", "started", "cancelled", "requeues", "expected"), [
    (True, False, False, False, 0, True),  # queued on a worker that died: not an attempt
    (True, False, True, True, 0, True),  # the scheduler dropped it (quantdask did not cancel)
    (True, False, True, False, 0, False),  # it was running when its worker died: counted
    (False, False, False, False, 0, False),  # an error of its own
    (True, True, False, True, 0, False),  # its reference was cut at the deadline: a timeout
    (True, False, False, False, 10, False),  # requeued too often already
])
def test_which_endings_are_requeued_without_counting_an_attempt(lost, cut, started, cancelled,
                                                                 requeues, expected):
    assert requeue_uncounted(lost, cut, started, cancelled, requeues, max_requeues=10) is expected


def test_an_attempt_that_ended_without_a_result_gets_the_outcome_of_its_cause(jobs):
    from concurrent.futures import CancelledError

    from distributed.scheduler import KilledWorker

    from quantdask.errors import UnsupportedHere

    job = jobs["nf4"]
    died = KilledWorker("key", types.SimpleNamespace(address="tcp://w1"), 0)  # as Dask raises it
    assert worker_went_away(died)
    assert worker_went_away(CancelledError("key"))
    assert not worker_went_away(RuntimeError("the backend broke"))

    def outcome(error, **how):
        made = outcome_of_error(error, job, **{"lost": False, "cut": False,
                                               "in_reference": False, "worker": "w1", **how})
        return made.record

    lost = outcome(died, lost=True)
    assert (lost["status"], lost["failure_class"], lost["error_class"], lost["worker"]) == (
        "failed", "worker_lost", "KilledWorker", "w1")
    cut = outcome(died, lost=True, cut=True)
    assert (cut["failure_class"], cut["error_class"]) == ("timeout", "JobTimeout")
    assert f"ran past timeout_s={job.timeout_s:g}s" in cut["error_message"]
    skipped = outcome(UnsupportedHere("no kernel for this layer"))
    assert (skipped["status"], skipped["failure_class"]) == ("skipped", "unsupported")
    try:
        raise MemoryError("cannot allocate 2 GiB")
    except MemoryError as raised:
        oom = outcome(raised, in_reference=True)
    assert (oom["failure_class"], oom["error_class"]) == ("out_of_memory", "MemoryError")
    assert oom["error_message"] == "in its model's reference: cannot allocate 2 GiB"
    assert oom["traceback"].startswith("Traceback") and "raise MemoryError" in oom["traceback"]
    assert outcome(ValueError())["error_message"] == "ValueError"  # never an empty message


@pytest.mark.timeout(10)
@pytest.mark.parametrize("retries", [0, 1, 3])
@pytest.mark.parametrize("failure_class", list(FailureClass))
def test_no_class_of_failure_gets_an_attempt_beyond_the_retries(jobs, retries, failure_class):
    """Every attempt fails the same way: the policy stops after exactly ``retries`` retries
    (unsupported: after the first attempt), whatever job the retry would run (out of memory
    asks for more room each time)."""
    job = dataclasses.replace(jobs["nf4"], retries=retries)
    made, limit = 1, retries + 10  # a policy that never stopped would run past the limit
    while made < limit:
        decision = after_failure(job, made, failure_class, backoff_s=0.1, final=False)
        assert decision == decide(job, made, failure_class, backoff_s=0.1)
        if not decision.retry:
            break
        job, made = decision.job, made + 1
        assert job.retries == retries  # a roomier retry keeps the job's limit
    expected = 1 if failure_class == FailureClass.UNSUPPORTED else retries + 1
    assert made == expected


def test_a_failure_settled_as_final_is_never_retried(jobs):
    job = jobs["nf4"]
    assert after_failure(job, 1, "worker_lost", 1.0, final=False).retry
    final = after_failure(job, 1, "worker_lost", 1.0, final=True)
    assert not final.retry and final.reason == "not retried: no worker left"
    assert after_failure(job, 1, "job_error", 1.0, final=False) == decide(job, 1, "job_error", 1.0)


def test_the_policys_examples_hold():
    import doctest

    failed, attempted = doctest.testmod(policy)
    assert attempted >= 4 and failed == 0


# Device health -------------------------------------------------------------------------------

def test_a_device_is_excluded_once_its_failed_jobs_ran_fine_elsewhere():
    health = DeviceHealth(limit=2)
    for job in ("j1", "j2", "j3"):
        health.failed("w1", job, "job_error")
    health.failed("w1", "j4", "out_of_memory")  # does not count against the device
    assert health.succeeded("w2", "j1") == []
    assert health.succeeded("w2", "j4") == []
    assert health.succeeded("w2", "j2") == ["w1"]
    assert "failed 3 different jobs in a row, 2 of which then ran fine elsewhere: j1, j2" \
        == health.excluded["w1"]
    assert health.succeeded("w2", "j3") == []  # excluded once


def test_a_config_that_fails_everywhere_excludes_no_device():
    health = DeviceHealth(limit=2)
    for worker in ("w1", "w2"):
        for job in ("j1", "j2"):
            health.failed(worker, job, "job_error")
    assert health.excluded == {}


def test_a_done_job_clears_the_devices_streak():
    health = DeviceHealth(limit=2)
    health.failed("w1", "j1", "job_error")
    assert health.succeeded("w1", "j9") == []  # w1 works after all
    health.failed("w1", "j2", "job_error")
    assert health.succeeded("w2", "j1") == [] and health.succeeded("w2", "j2") == []
    assert health.excluded == {}


# The attempt table and the recorder ---------------------------------------------------------

def test_the_attempt_table_settles_each_attempt_once(jobs):
    from quantdask.run.attempts import Attempt, AttemptTable
    from quantdask.util import utcnow

    table = AttemptTable()
    for number, (config, key) in enumerate([("nf4", "a"), ("fp4", "b"), ("baseline", "c")], 1):
        table.add(Attempt(jobs[config], number, utcnow(), key))
    started = table.note_start("b", 5.0, "tcp://w1", "w1")
    assert (started.key, started.started, started.worker_name) == ("b", 5.0, "w1")
    assert table.note_start("not-an-attempt", 5.0, "tcp://w1", "w1") is None
    assert set(table.waiting()) == {"a", "c"}
    # A selection sees the table as it is and takes only what it picks.
    taken = table.take(lambda t: [k for k, a in t.items() if a.started is None and k != "c"])
    assert [key for key, _ in taken] == ["a"]
    assert table.pop("a") is None and table.take(lambda t: ["a"]) == []  # never twice
    assert sorted(key for key, _ in table.take_all()) == ["b", "c"]
    assert table.take_all() == []


def test_each_attempt_of_a_job_gets_a_dask_key_of_its_own():
    from quantdask.run.attempts import AttemptTable

    table, other = AttemptTable(tag="run1"), AttemptTable(tag="run2")
    keys = [table.new_key("job-a"), table.new_key("job-b"), table.new_key("job-a"),
            table.new_key("job-a")]
    assert keys[:2] == ["job-a-run1-1", "job-b-run1-2"]  # the job id first (the dashboard's)
    assert len(set(keys)) == 4 and all(k.startswith("job-a-") for k in keys[2:])
    # Another session's first attempt of the same job: a key of its own, never the earlier
    # session's (the scheduler may still hold that one, and would hand back its result).
    assert other.new_key("job-a") not in keys


def test_uncounted_requeues_are_counted_per_job_up_to_the_limit():
    requeues = Requeues(max_requeues=2)
    dropped = {"lost": True, "cut": False, "started": False, "cancelled": False}
    assert [requeues.take("a", **dropped) for _ in range(3)] == [True, True, False]
    assert requeues.take("b", **dropped)  # another job has its own count
    assert not requeues.take("b", **{**dropped, "started": True})  # a real attempt: counted
    assert requeues.counts == {"a": 2, "b": 1}


def test_the_driver_logs_on_quantdask_driver_and_its_old_name_still_hears_it():
    import io
    import logging

    from quantdask.run import LOG_CHANNEL, OLD_LOG_CHANNEL
    from quantdask.run.loop import log

    assert log.name == LOG_CHANNEL == "quantdask.driver"
    heard = io.StringIO()
    handler = logging.StreamHandler(heard)
    old = logging.getLogger(OLD_LOG_CHANNEL)
    old.addHandler(handler)
    old.setLevel(logging.INFO)
    try:
        log.warning("a line for the old channel")
        log.debug("below the old channel's level")
    finally:
        old.removeHandler(handler)
        old.setLevel(logging.NOTSET)
    assert heard.getvalue() == "a line for the old channel\n"


def test_the_recorder_writes_the_attempt_the_decision_and_the_result(jobs, tmp_path):
    from quantdask.job.outcome import JobOutcome
    from quantdask.run.attempts import Attempt
    from quantdask.run.recorder import Recorder
    from quantdask.store.run_store import RunStore
    from quantdask.util import utcnow

    store = RunStore(tmp_path / "run").create()
    recorder = Recorder(store, "run-1")
    attempt = Attempt(jobs["nf4"], 2, utcnow(), "key-2")
    outcome = JobOutcome.outside("timeout", "JobTimeout", "no result after 30s", worker="w1")
    recorder.attempt(attempt, outcome)
    recorder.decision(attempt, "timeout", "not retried: no attempts left")
    recorder.result(attempt, outcome)
    row = store.read("attempts").row(0, named=True)
    assert (row["run_id"], row["job_id"], row["attempt"], row["key"], row["worker"]) == \
        ("run-1", jobs["nf4"].id, 2, "key-2", "w1")
    assert (row["failure_class"], row["eval_batch_size"]) == ("timeout",
                                                              jobs["nf4"].eval.batch_size)
    result = store.read_results().row(0, named=True)
    assert (result["status"], result["attempts"], result["config_label"]) == ("failed", 2, "nf4")
    log = (store.job_logs_dir / f"{jobs['nf4'].id}.log").read_text()
    assert "attempt=2 timeout: not retried: no attempts left" in log
