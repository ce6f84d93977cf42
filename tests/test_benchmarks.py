"""The benchmark scripts and the GPU smoke script stay runnable (their figures live in
benchmarks/RESULTS.md; timing targets are never asserted here)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from tests.conftest import REPO


def test_the_benchmark_sweeps_are_valid():
    from benchmarks.scheduling import DURATIONS
    from benchmarks.sweeps import register_synthetic_backends, synthetic, twelve_configs
    from quantdask import expand_grid, sweep_from_dict

    jobs = expand_grid(sweep_from_dict(twelve_configs()))
    assert len([j for j in jobs if j.backend != "none"]) == 12
    assert len({j.id for j in jobs}) == 13
    register_synthetic_backends()
    sleepy = expand_grid(sweep_from_dict(synthetic(
        "s", "sleep", [{"seconds": s, "n": i} for i, s in enumerate(DURATIONS)],
        priority_by=lambda c: int(c["seconds"] * 10))))
    by_priority = sorted((j for j in sleepy if j.backend == "sleep"), key=lambda j: -j.priority)
    assert [j.options.seconds for j in by_priority] == sorted(DURATIONS, reverse=True)


STAGES = ("imports", "cluster start", "bitsandbytes sweep", "torchao sweep", "speed sweep",
          "cluster close", "packed sweep (its own cluster)")
"""The smoke's stages before its last (tests/test_gpu.py), in order."""


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_gpu_smoke_in_dry_mode_with_only_what_the_lent_machine_has_then_cut_by_its_time_limit(
        tmp_path):
    # Every installed package that is neither in the lent machine's image nor in the GPU bundle
    # is hidden from the script and every process it starts (the report stack among them).
    # One run checks every stage and the time limit's cut: gpu_smoke.sh runs `timeout
    # --kill-after=30 $QUANTDASK_SMOKE_TIMEOUT_S`, whose expiry is a SIGALRM to itself that
    # sends SIGTERM to the smoke's process group; the test sends that SIGALRM as the last
    # stage (tests/test_gpu.py) begins. (That stage alone:
    # test_the_smoke_s_last_stage_runs_tests_gpu_py_which_skip_without_a_gpu; the smoke's
    # "passed": test_a_smoke_whose_checks_pass_says_passed_and_exits_0.)
    from tests import lent_machine

    out, tarball = tmp_path / "smoke", tmp_path / "smoke.tar.gz"
    env = {**lent_machine.environment(tmp_path / "lent"), "PYTHON": sys.executable,
           "QUANTDASK_SMOKE_TIMEOUT_S": "300"}
    smoke = subprocess.Popen(["bash", "scripts/gpu_smoke.sh", "--dry-run", "--out", str(out),
                              "--tar", str(tarball)], cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    try:
        for line in smoke.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith(f"smoke: stage {STAGES[-1]}:"):
                smoke.send_signal(signal.SIGALRM)  # `exec timeout`: this pid is timeout's
                break
        lines += smoke.stdout.read().splitlines()
        rc = smoke.wait(60)
    finally:
        smoke.kill()
    log = "\n".join(lines)
    checks = [line for line in lines if line.startswith("smoke: ok") or "FAIL " in line]
    assert sum(line.startswith("smoke: ok") for line in checks) == 14, log
    assert not [line for line in checks if "FAIL " in line], log
    assert "each worker advertises its device memory for placement (0: " in log
    assert "two jobs ran at once on one slot" in log
    assert "the peaks of jobs that ran at once are flagged shared" in log
    # lm-eval (the bundle's) scored the demo's task on every job, with only the lent machine's
    # packages besides.
    assert "smoke: ok   task rows (demo_facts acc, acc_norm) for all 5 jobs, each a value in " \
           "[0, 1] over 8 questions: 10 rows" in log
    assert "smoke: ok   the baseline's task recovery is 1 ([1.0, 1.0])" in log
    assert "samples taken while two jobs ran carry both" in log
    assert "torchao int8 and int4 on a bfloat16 model: ['done', 'done', 'done']" in log
    assert "torchao int4's size counts no layout padding" in log
    # bf16 (the baseline), int8 and nf4 timed: the dry run's tiny speed block, the frame printed.
    assert "smoke: ok   speed rows for ['baseline', 'int8 t=6', 'nf4'] at batch sizes [1]: 3 " \
           "rows, 4 new tokens each, every device held alone" in log
    assert "smoke: ok   every speed row has prefill and decode tokens/s above zero" in log
    assert "decode_speedup" in log and "shape: (3, 17)" in log
    assert f"quantdask report {out / 'sweep'}" in log
    assert not (out / "sweep" / "report.html").exists()

    # The cut: timeout's own status, what the smoke says, what it packed.
    assert rc == 124, log
    assert lines[0] == "smoke: cuda-core missing, cuda-bindings missing" or \
        lines[0].startswith("smoke: cuda-core "), log
    assert "smoke: host memory " in log and " GiB available" in log
    assert "smoke: backends the bundle leaves out: hqq, gptq (source-only releases" in log
    for stage in STAGES:
        assert re.search(rf"^smoke: stage {re.escape(stage)}: \d+\.\ds \(at \d+s\)$", log,
                         re.MULTILINE), stage
    assert "smoke: SIGTERM (the time limit): packing what finished" in log
    assert re.search(r"^smoke: stage tests/test_gpu.py stopped after \d+\.\ds by Terminated$",
                     log, re.MULTILINE), log
    # The smoke's last word (multiprocessing's resource tracker may warn after it, at exit,
    # of the semaphores of a cluster cut short).
    last = [line for line in lines if line.startswith("smoke:")][-1]
    assert last.startswith("smoke: FAILED: stopped in stage tests/test_gpu.py by Terminated")
    with tarfile.open(tarball) as packed:
        names = set(packed.getnames())
    for run_dir in ("sweep", "torchao", "speed", "shared"):  # what finished is there
        assert any(n.startswith(f"smoke/{run_dir}/results/") for n in names), run_dir
    assert len([n for n in names if n.startswith("smoke/sweep/results/")]) == 5
    assert "smoke/test_gpu.log" not in names  # the last stage never ran
    on_disk = {f"smoke/{p.relative_to(out)}" for p in out.rglob("*")} | {"smoke"}
    assert {n for n in names if "/results/" in n} == {n for n in on_disk if "/results/" in n}
    assert not list(tmp_path.glob("*.partial"))

    # A rerun into the same directory would resume and check stale results: refused.
    again = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--dry-run", "--out", str(out)],
                           cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert again.returncode != 0 and "is not empty" in again.stderr
    # The limit is read from QUANTDASK_SMOKE_TIMEOUT_S: 1 s stops it in its imports.
    started = time.monotonic()
    cut = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--dry-run", "--out",
                          str(tmp_path / "cut")], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={**env, "QUANTDASK_SMOKE_TIMEOUT_S": "1"})
    assert cut.returncode == 124 and time.monotonic() - started < 15


def smoke_module():
    """scripts/gpu_smoke.py, imported here."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_smoke
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return gpu_smoke


def test_the_smoke_s_last_stage_runs_tests_gpu_py_which_skip_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    ok, summary = smoke_module().run_gpu_tests(tmp_path, dry_run=True)
    assert ok and re.fullmatch(r"1 skipped in [\d.]+s", summary), summary
    assert "1 skipped" in (tmp_path / "test_gpu.log").read_text()


def test_a_smoke_whose_checks_pass_says_passed_and_exits_0(tmp_path, monkeypatch, capsys):
    from quantdask.util import import_offline

    import_offline("bitsandbytes")  # as the smoke imports it, in a process of its own
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # as when it runs: its gpu_bundle
    gpu_smoke = smoke_module()
    monkeypatch.setattr(gpu_smoke, "run_checks",
                        lambda args, out, check, stages: check(True, "every check"))
    out, tarball = tmp_path / "smoke", tmp_path / "smoke.tar.gz"
    monkeypatch.setattr(sys, "argv", ["gpu_smoke.py", "--dry-run", "--out", str(out),
                                      "--tar", str(tarball)])
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert gpu_smoke.main() == 0
    finally:
        signal.signal(signal.SIGTERM, before)
    lines = capsys.readouterr().out.splitlines()
    assert "smoke: ok   every check" in lines
    assert re.fullmatch(r"smoke: passed in \d+s", lines[-1]), lines[-1]
    assert f"smoke: {out} packed as {tarball}" in lines
    with tarfile.open(tarball) as packed:
        assert packed.getnames() == ["smoke"]


def test_gpu_smoke_judges_sharing_by_what_surely_ran_at_once_not_by_the_clock(tmp_path):
    # The dry run failed once on "the peaks of jobs that ran at once are flagged shared": it
    # took jobs whose attempts overlapped by their start and end times, and the packed
    # baseline's attempt overlapped nf4's while its measured span (a tenth of a second: the
    # reference spares it its work) had ended before nf4's began: its peak was rightly not
    # shared. Now the two configs meet inside their quantize phases (held_backend), and the
    # attempts' times only say which jobs surely ran alone.
    import dataclasses
    import datetime as dt
    import threading

    import polars as pl

    gpu_smoke = smoke_module()
    held_backend, ran_alone = gpu_smoke.held_backend, gpu_smoke.ran_alone

    t0 = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)

    def job(job_id, worker, began, ended, status="done"):
        return {"job_id": job_id, "worker": worker, "status": status,
                "started_at": t0 + dt.timedelta(seconds=began),
                "finished_at": t0 + dt.timedelta(seconds=ended)}

    packed = pl.DataFrame([job("baseline", "w0", 0.00, 0.12), job("nf4", "w0", 0.00, 0.73),
                           job("fp4", "w0", 0.12, 0.80), job("elsewhere", "w1", 0.1, 0.7),
                           job("later", "w0", 1.00, 1.50), job("failed", "w0", 2.0, 2.5, "failed")])
    assert ran_alone(packed) == {"elsewhere", "later"}  # the baseline is not judged

    @dataclasses.dataclass(frozen=True)
    class Fake:  # the Backend fields held_backend uses
        name: str
        quantize: object

    calls = []
    held = held_backend(Fake("fake", lambda s, o, d: calls.append(o) or f"q{o}"),
                        tmp_path / "meet", patience=20)
    assert held.name == "fake-held"
    got = {}
    first = threading.Thread(target=lambda: got.setdefault("a", held.quantize(None, 1, "cpu")))
    first.start()
    first.join(0.3)
    assert first.is_alive() and calls == []  # waiting for the other, inside its quantize
    assert held.quantize(None, 2, "cpu") == "q2"
    first.join(10)
    assert got == {"a": "q1"} and sorted(calls) == [1, 2]
    alone = held_backend(Fake("fake", lambda s, o, d: o), tmp_path / "alone", patience=0.2)
    with pytest.raises(RuntimeError, match="no other packed job reached quantize within 0.2s"):
        alone.quantize(None, 1, "cpu")


def test_gpu_smoke_names_the_import_that_fails(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path)}
    # The first of its imports (the others would cost seconds before it)
    (tmp_path / "bitsandbytes.py").write_text("raise ImportError('bitsandbytes is broken here')\n")
    run = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 2
    assert "ImportError: bitsandbytes is broken here" in run.stderr  # the real error, not hidden
    assert "make gpu-bundle" in run.stderr


def test_gpu_smoke_refuses_to_run_without_a_gpu_unless_dry(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = subprocess.run([sys.executable, "scripts/gpu_smoke.py", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no CUDA GPU visible" in run.stderr
    assert not list(tmp_path.iterdir())


def test_a_sigterm_between_two_smoke_stages_stops_the_next_as_it_starts(tmp_path, capsys):
    # The dry run above sends its signal as the last stage begins: it may land between two
    # stages or inside the last. Either way the smoke names the stage it stopped.
    gpu_smoke = smoke_module()
    stages = gpu_smoke.Stages()
    packer = gpu_smoke.Packer(tmp_path, None, stages)
    with stages("first"):
        pass
    packer.on_sigterm(15, None)  # between stages: nothing raised here
    assert stages.interrupted and stages.stopped is None
    with pytest.raises(gpu_smoke.Terminated):
        with stages("second"):
            raise AssertionError("the stage must not run")
    assert stages.stopped == "second"
    stages = gpu_smoke.Stages()  # a fresh run: inside a stage, the SIGTERM stops it at once
    packer = gpu_smoke.Packer(tmp_path, None, stages)
    with pytest.raises(gpu_smoke.Terminated), stages("third"):
        packer.on_sigterm(15, None)
    assert stages.stopped == "third" and not stages.interrupted
    out = capsys.readouterr().out
    assert "smoke: stage second stopped after 0.0s by Terminated" in out
    assert "smoke: stage third stopped after 0.0s by Terminated" in out


def test_gpu_smoke_unsets_bnb_cuda_version(tmp_path):
    # Set, bitsandbytes would look for libbitsandbytes_cuda<version>.so: the bundle keeps 130 only.
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\necho "BNB_CUDA_VERSION=${BNB_CUDA_VERSION-unset}"\n')
    python.chmod(0o755)
    run = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHON": str(python), "BNB_CUDA_VERSION": "118"})
    assert run.returncode == 0 and run.stdout.strip() == "BNB_CUDA_VERSION=unset", run
