"""Jobs packed on one worker share nothing by accident: two attempts running at once in two
threads of one process (as ``jobs_per_gpu`` packs them) each keep their own log lines and draw
their own random numbers, the same as each draws alone; the process-global generators are held
by one drawing library at a time."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

import quantdask as qd
import quantdask.backends
from quantdask.backends import Backend, Option, get_backend
from quantdask.backends.base import UNQUANTIZED
from quantdask.job.job import run_job
from quantdask.measure.reference import compute_reference
from quantdask.randomness import global_generators, job_generator, job_random
from quantdask.sweepfile.sweep import expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import sweep_dict

STEPS = 4
LOG = logging.getLogger("quantdask.job")  # the attempt's own log

_together: list[threading.Barrier] = []  # set while two jobs must run in lockstep


def draws_and_logs_then_builds(source, options, device):
    """Per step: a line naming its job (``n``) with a number drawn from the job's generator;
    in lockstep with the other job while both run at once."""
    import torch

    for step in range(STEPS):
        if _together:
            _together[0].wait(timeout=60)
        value = torch.rand(1, generator=qd.job_generator()).item()
        LOG.info("job n=%d step %d draw %.12f", options.n, step, value)
    return source.build(device)


def _draws(log: str, n: int) -> list[str]:
    return re.findall(rf"job n={n} step \d draw (\S+)", log)


@pytest.mark.timeout(240)
def test_two_jobs_at_once_in_one_process_keep_their_own_lines_and_draws(monkeypatch):
    monkeypatch.setitem(quantdask.backends._REGISTRY, "packed", Backend(
        "packed", draws_and_logs_then_builds, options={"n": Option(int)}, sizing=UNQUANTIZED))
    sweep = sweep_from_dict(sweep_dict(
        backends=[{"backend": "packed", "grid": {"n": [1, 2]}}], layer_stats=False))
    jobs = [job for job in expand_grid(sweep) if job.backend == "packed"]
    first = jobs[0]
    reference = compute_reference(first.model, first.eval, first.eval.read_text())
    backend = get_backend("packed")
    alone = [run_job(job, backend, reference=reference) for job in jobs]

    outcomes: dict[int, object] = {}
    _together.append(threading.Barrier(2))
    try:
        threads = [threading.Thread(target=lambda i=i, job=job: outcomes.__setitem__(
            i, run_job(job, backend, reference=reference))) for i, job in enumerate(jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=180)
    finally:
        _together.clear()
    packed = [outcomes[0], outcomes[1]]
    for i, (job, other) in enumerate(((jobs[0], jobs[1]), (jobs[1], jobs[0]))):
        log, n, other_n = packed[i].log, i + 1, 2 - i
        assert packed[i].record["status"] == "done", log
        # Its own lines only: the other job's id and lines are in the other's log.
        assert job.id in log and other.id not in log
        assert _draws(log, n) and not _draws(log, other_n)
        assert log.count("start on worker") == 1
        # The same numbers as alone: a neighbour neither re-seeded nor advanced its generator.
        assert _draws(log, n) == _draws(alone[i].log, n)
        assert len(set(_draws(log, n))) == STEPS


@pytest.mark.timeout(30)
def test_a_jobs_generator_is_its_own_and_seeded_by_the_job():
    import torch

    with job_random(5):
        first = torch.rand(3, generator=job_generator())
        torch.rand(100)  # the process-global generator: not the job's
        assert job_generator("cpu") is job_generator()  # one per device, kept
    with job_random(5):
        again = torch.rand(3, generator=job_generator())
    with job_random(6):
        other = torch.rand(3, generator=job_generator())
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert job_generator() is torch.default_generator  # outside a job: torch's own


def _enters_within(section, seconds: float) -> bool:
    entered = threading.Event()

    def enter():
        with section():
            entered.set()

    threading.Thread(target=enter, daemon=True).start()
    return entered.wait(seconds)


@pytest.mark.timeout(30)
def test_a_drawing_library_holds_the_global_generators_alone():
    # Seeding sections (lm-eval) run side by side...
    with global_generators():
        assert _enters_within(global_generators, 2.0)
    # ...but never while a drawing one (AutoRound's tuning) runs, nor another drawing one.
    release = threading.Event()
    inside = threading.Event()

    def tune():
        with global_generators(draws=True):
            inside.set()
            release.wait(10)

    tuner = threading.Thread(target=tune, daemon=True)
    tuner.start()
    assert inside.wait(5)
    assert not _enters_within(global_generators, 0.3)
    assert not _enters_within(lambda: global_generators(draws=True), 0.3)
    release.set()
    tuner.join(5)
    started = time.monotonic()
    assert _enters_within(lambda: global_generators(draws=True), 2.0)
    assert time.monotonic() - started < 2.0
