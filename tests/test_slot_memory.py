"""Memory that holds under a limit: what a CPU slot offers jobs, a nanny's kill recorded as
``out_of_memory`` from its own event (with the limit, the peak and the fix), its retry alone on
a larger slot, and ``quantdask run --memory-limit`` (on a real LocalCluster on 127.0.0.1)."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time

import dask
import polars as pl
import psutil
import pytest

import quantdask.backends
import quantdask.cluster.local
from quantdask.cli.commands import slot_memory_lines
from quantdask.cli.main import main
from quantdask.cluster.local import start_cluster
from quantdask.errors import SpecError
from quantdask.plan.placement import Placement, slot_memories
from quantdask.plan.retry import with_more_room
from quantdask.process.slot_memory import FIRST_JOB_BYTES, SlotMemory
from quantdask.run.sweep import run_sweep
from quantdask.store.readers import read_attempts
from quantdask.sweepfile.sweep import DEVICE_MEMORY, expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import KeptRunDir, sweep_dict

pytestmark = [pytest.mark.slow]

SMALL = 700 * 2**20
"""The small slot's limit: room for the worker at rest (~460 MiB) and a demo job, and its
nanny restarts it at 665 MiB."""
BIG = 1500 * 2**20
HUNGRY_RSS = 800 * 2**20
"""What the hungry backend brings its worker to: past the small slot's kill line, well
within the big one's."""


@pytest.fixture(scope="module")
def small_slot():
    """One CPU slot with a 700 MiB memory limit (the last test adds a larger one)."""
    with start_cluster(workers=1, memory_limit=SMALL) as handle:
        yield handle


def worker_rss(dask_worker) -> int:
    from quantdask.process.slot_memory import release_memory

    release_memory()
    return psutil.Process().memory_info().rss


@pytest.mark.timeout(60)
def test_a_cpu_slot_offers_the_terminate_fraction_of_its_limit_less_its_resting_memory(
        small_slot):
    client = small_slot.client
    info = next(iter(client.scheduler_info(n_workers=-1)["workers"].values()))
    slot = slot_memories(client)[str(info["name"])]
    terminate = dask.config.get("distributed.worker.memory.terminate")
    assert (slot.limit, slot.terminate) == (SMALL, terminate) == (info["memory_limit"], 0.95)
    assert info["resources"][DEVICE_MEMORY] == slot.offered \
        == int(terminate * SMALL) - slot.resting > 0
    # Resting: the worker's own RSS as it started, and what a first job adds for good.
    rss = next(iter(client.run(worker_rss).values()))
    assert abs(slot.resting - FIRST_JOB_BYTES - rss) < 64 * 2**20, (slot, rss)
    assert slot_memory_lines(client) == [
        f"memory: 1 CPU slot(s), each with memory limit 700.0 MiB (Dask's memory_limit; its "
        f"nanny restarts a slot past 95%, at 665.0 MiB); resting "
        f"{slot.resting / 2**20:.1f} MiB, so jobs are placed against "
        f"{slot.offered / 2**20:.1f} MiB"]


@pytest.mark.timeout(90)
def test_a_nanny_kill_is_out_of_memory_with_the_limit_the_peak_and_the_fix(small_slot,
                                                                            tmp_path):
    """No slot offers more: recorded, not retried (retries left notwithstanding)."""
    data = sweep_dict(retries=1, faults=[{"config": "nf4", "attempt": 1, "kind": "memory"}])
    small_slot.client.wait_for_workers(1, timeout=60)
    results = run_sweep(sweep_from_dict(data), tmp_path / "run", small_slot.client)
    row = results.filter(pl.col("config_label") == "nf4").row(0, named=True)
    assert (row["status"], row["failure_class"], row["error_class"]) == (
        "failed", "out_of_memory", "KilledForMemory")
    assert row["memory_limit_bytes"] == SMALL
    assert row["killed_at_rss_bytes"] > 0.95 * SMALL  # the nanny's own reading
    message = row["error_message"]
    assert "its worker's nanny killed it for memory (Dask's worker-restart-memory event)" \
        in message and "past 95% of its 700.0 MiB memory limit (665.0 MiB)" in message
    assert "fix: CPU slots with a memory limit of at least" in message
    assert "--memory-limit" in message
    attempts = read_attempts(tmp_path / "run").filter(pl.col("job_id") == row["job_id"])
    assert attempts["failure_class"].to_list() == ["out_of_memory"]
    log = (tmp_path / "run" / "logs" / "jobs" / f"{row['job_id']}.log").read_text()
    assert "not retried: no worker offers more than the" in log
    assert results.filter(pl.col("config_label") == "baseline")["status"].to_list() == ["done"]


def hungry_bitsandbytes(source, options, device):
    """bitsandbytes, once the test's big slot has joined and after holding its worker's RSS
    at ``HUNGRY_RSS`` for a second (the nanny reads it every 0.5 s in the tests)."""
    import torch
    from distributed import get_client

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "big" not in {
            str(w["name"]) for w in get_client().scheduler_info(n_workers=-1)["workers"]
            .values()}:
        time.sleep(0.1)
    held = torch.ones(max(0, HUNGRY_RSS - psutil.Process().memory_info().rss) // 4)
    time.sleep(1.0)
    del held
    return quantdask.backends.get_backend("bitsandbytes").quantize(source, options, device)


def add_slot(handle, name: str, memory_limit: int) -> None:
    """One more CPU slot in ``handle``'s LocalCluster, with its own memory limit."""
    cluster = handle.cluster
    spec = copy.deepcopy(cluster.new_spec)
    spec["options"]["memory_limit"] = memory_limit
    cluster.worker_spec[name] = spec
    cluster.sync(cluster._correct_state)


@pytest.mark.timeout(120)
def test_a_job_killed_for_memory_is_retried_alone_on_a_larger_slot(small_slot, tmp_path,
                                                                   monkeypatch):
    """LLM.int8 keeps its eval batch: its figures depend on it."""
    client = small_slot.client
    client.wait_for_workers(1, timeout=60)
    bnb = quantdask.backends.get_backend("bitsandbytes")
    monkeypatch.setitem(quantdask.backends._REGISTRY, "hungry-bnb", dataclasses.replace(
        bnb, name="hungry-bnb", quantize=hungry_bitsandbytes, check=None))
    data = sweep_dict(retries=1, backends=[{"backend": "hungry-bnb", "grid": {"bits": [8]}}])
    started = threading.Event()

    def note(progress) -> None:
        if any(r.job_id.startswith("hungry") for r in progress.running.values()):
            started.set()

    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.setdefault("results", run_sweep(
        sweep_from_dict(data), tmp_path / "run", client, on_progress=note)))
    runner.start()
    assert started.wait(60), "the hungry job started"
    # what the slot the job is killed on offers (its restarted process rests a page or so apart)
    small_offer = slot_memories(client)["0"].offered
    add_slot(small_slot, "big", BIG)  # after placement: its first attempt is the small slot's
    client.wait_for_workers(2, timeout=60)
    runner.join(timeout=90)
    row = outcome["results"].filter(pl.col("backend") == "hungry-bnb").row(0, named=True)
    assert (row["status"], row["worker"], row["attempts"]) == ("done", "big", 2)
    tries = read_attempts(tmp_path / "run").filter(pl.col("job_id") == row["job_id"]) \
        .sort("attempt")
    assert tries["failure_class"].to_list() == ["out_of_memory", None]
    assert tries["worker"].to_list() == ["0", "big"]
    assert tries["eval_batch_size"].to_list() == [8, 8]  # LLM.int8: the batch is kept
    assert tries["gpu_share"].to_list()[1] == 1.0
    assert tries["device_memory_request_bytes"].to_list()[1] > small_offer


@pytest.mark.timeout(30)
def test_a_slot_that_began_a_job_is_known_after_it_left_the_scheduler():
    """A slot restarting when jobs were placed reports its figures as it begins one; killed
    for memory, it is gone from the scheduler, and the retry must still ask for more."""
    placement = Placement(jobs=[])
    offered = SlotMemory.of(2**30, 0.95, 2**28)
    placement.note_slot("0", offered.as_metric())
    placement.note_slot("1", None)  # a slot without a memory limit reports nothing
    assert placement.slot("0", client=None) == offered  # no scheduler asked
    assert "1" not in placement.slots


@pytest.mark.timeout(30)
def test_only_a_method_whose_figures_do_not_depend_on_the_batch_halves_it():
    jobs = {job.config_label: job for job in expand_grid(sweep_from_dict(sweep_dict(
        backends=[{"backend": "bitsandbytes", "grid": {"bits": [4, 8]}}])))}
    assert with_more_room(jobs["nf4"]).eval.batch_size == 4
    assert with_more_room(jobs["int8 t=6"]).eval.batch_size == 8
    zero = dataclasses.replace(jobs["int8 t=6"], options=dataclasses.replace(
        jobs["int8 t=6"].options, int8_threshold=0.0))  # no outlier path: no batch effect
    assert with_more_room(zero).eval.batch_size == 4


@pytest.mark.timeout(30)
def test_memory_limit_reaches_the_cpu_slots_and_is_refused_where_it_cannot_apply(
        write_sweep, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = write_sweep()
    given = {}

    def no_cluster(**kwargs):
        given.update(kwargs)
        raise SpecError("test", "stopped before any cluster starts")

    monkeypatch.setattr(quantdask.cluster.local, "start_cluster", no_cluster)
    assert main(["run", sweep, "--workers", "2", "--memory-limit", "1600MiB"]) == 2
    assert given["memory_limit"] == "1600MiB" and given["workers"] == 2
    monkeypatch.undo()
    # GPUs here (faked) and no --workers: GPU workers, which a host memory limit cannot cap.
    monkeypatch.setattr(quantdask.cluster.local, "cuda_device_count", lambda: 2)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["run", sweep, "--memory-limit", "1600MiB"]) == 2
    err = capsys.readouterr().err
    assert "memory_limit: --memory-limit (start_cluster(memory_limit=...)) is a CPU slot's " \
           "Dask memory limit, and this machine's 2 GPU(s) make GPU workers" in err
    assert "drop --memory-limit, or give --workers N for CPU slots" in err
    with pytest.raises(SpecError, match="workers of a scheduler reached by address were "
                                        "started elsewhere: give each `dask worker"):
        start_cluster(address="tcp://127.0.0.1:1", memory_limit="1600MiB")
    with pytest.raises(SpecError, match="must be a size such as 1600MiB"):
        start_cluster(workers=1, memory_limit="lots")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("given, said", [
    ("1600", "memory_limit: give a unit: 1600MiB or 1600MB (a bare number would be bytes"),
    ("200MiB", "memory_limit: 200.0 MiB is less than a CPU slot holds at rest"),
])
def test_a_memory_limit_no_slot_can_start_in_is_refused_before_any_cluster(
        given, said, write_sweep, tmp_path, capsys, monkeypatch):
    """A bare number (read as bytes) and a limit below a slot's resting memory: exit 2 naming
    the field and the fix, before any worker starts (the nanny would kill it at once: an
    uncaught CommClosedError), and a run directory already there left as it was."""
    monkeypatch.chdir(tmp_path)
    kept = KeptRunDir(tmp_path / "kept")
    run_dir = kept.path
    began = time.monotonic()
    assert main(["run", write_sweep(), "--workers", "1", "--memory-limit", given,
                 "--run-dir", str(run_dir)]) == 2
    assert time.monotonic() - began < 20
    err = capsys.readouterr().err
    assert err.startswith(f"quantdask: error: {said}"), err
    assert kept.unchanged()


def test_slots_that_leave_jobs_nothing_are_refused_not_waited_on():
    """Placement with nothing to place against says so (the limit, the slots' resting memory,
    the least limit that leaves a job room) instead of waiting for room that never comes."""
    from quantdask.process.slot_memory import check_offers as _check_offers

    starved = SlotMemory.of(limit=600 * 2**20, terminate=0.95, resting=640 * 2**20)
    with pytest.raises(SpecError, match=r"memory_limit: every CPU slot leaves jobs 0 B .*give "
                                        r"--memory-limit at least 943\.\d MiB"):
        _check_offers({"w0": starved, "w1": starved})
    _check_offers({"w0": starved, "w1": SlotMemory.of(2**31, 0.95, 640 * 2**20)})  # one has room
    _check_offers({})  # GPU workers: no CPU slot


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_estimate_covers_the_peak_on_a_bf16_checkpoint_with_a_large_vocabulary(tmp_path):
    """Issue 70: a bfloat16 checkpoint with Qwen2's 151,936-token vocabulary, tied (its
    embedding most of its weights, which no backend quantizes): on a fresh CPU slot, each
    job's estimate for each phase, as placement makes it with no earlier run, is at least
    what the phase added to the worker (its peak RSS less the slot's resting memory).
    benchmarks/slot_memory.py runs every backend on a larger one (RESULTS.md section 18.1)."""
    import json

    from benchmarks.slot_memory import estimates, measured, sweep_of
    from quantdask.process.slot_memory import METRIC
    from tests.gguf_models import large_vocab_model

    folder = large_vocab_model(tmp_path / "vocab", hidden=256, ffn=512, layers=2)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    sweep = sweep_of("vocab", str(folder), "never",
                     [("bitsandbytes", {"bits": 4}), ("hqq", {"bits": 4})])
    with start_cluster(workers=1, memory_limit="3GiB") as cluster:
        info = cluster.client.scheduler_info(n_workers=-1)["workers"]
        slot = SlotMemory.from_metric(next(iter(info.values()))["metrics"][METRIC])
        results = run_sweep(sweep, tmp_path / "run", cluster.client)
    assert set(results["status"]) == {"done"}, results["error_message"].to_list()
    peaks, figures = measured(tmp_path / "run", slot.resting), estimates(sweep)
    labels = dict(zip(results["job_id"], results["config_label"], strict=True))
    short = [(labels[job], phase, figure, peaks[job][phase])
             for job, phases in figures.items() for phase, figure in phases.items()
             if figure < peaks[job][phase]]
    assert short == [], short
    assert len(figures) == 3 and all(len(phases) == 2 for phases in figures.values())
