"""The benchmark scripts and the GPU smoke script stay runnable (their figures live in
benchmarks/RESULTS.md; timing targets are never asserted here)."""

from __future__ import annotations

import os
import subprocess
import sys

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
    assert [j.options["seconds"] for j in by_priority] == sorted(DURATIONS, reverse=True)


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_gpu_smoke_script_passes_in_dry_mode(tmp_path):
    # Without the report: write_report is tested in tests/test_report.py.
    run = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--dry-run", "--no-report",
                          "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=320,
                         env={**os.environ, "PYTHON": sys.executable})
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("smoke:")]
    assert sum(line.startswith("smoke: ok") for line in lines) == 8
    assert "each worker advertises its device memory for placement (0: " in run.stdout
    assert not [line for line in lines if "FAIL" in line]
    assert "two jobs ran at once on one slot" in run.stdout
    assert "the peaks of jobs that ran at once are flagged shared" in run.stdout
    assert "samples taken while two jobs ran carry both" in run.stdout
    assert "smoke: report skipped (--no-report)" in lines
    assert not (tmp_path / "sweep" / "report.html").exists()
    assert lines[-1].startswith("smoke: passed in")


def test_gpu_smoke_refuses_to_run_without_a_gpu_unless_dry(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = subprocess.run([sys.executable, "scripts/gpu_smoke.py", "--out", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no CUDA GPU visible" in run.stderr
    assert not list(tmp_path.iterdir())
