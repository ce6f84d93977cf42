"""run_job in this process: real bitsandbytes quantization of the real demo model."""

from __future__ import annotations

import math

import pytest

from quantdask.backends import Backend, get_backend
from quantdask.demo_model import DEMO_EVAL_TEXT
from quantdask.errors import UnsupportedHere
from quantdask.spec import BackendBlock, EvalSettings, ModelSpec, Sweep, expand_grid
from quantdask.worker import run_job

pytestmark = pytest.mark.timeout(120)


def jobs_for(demo_model, samples: int = 8, **grid) -> dict:
    sweep = Sweep(
        name="w", models=[ModelSpec(path=demo_model)],
        backends=[BackendBlock("bitsandbytes", grid=grid or {"bits": [4, 8]})],
        eval=EvalSettings(text=DEMO_EVAL_TEXT, seq_len=64, samples=samples),
    )
    return {job.config_label: job for job in expand_grid(sweep)}


@pytest.fixture(scope="module")
def records(demo_model):
    jobs = jobs_for(demo_model)
    return {label: run_job(job, get_backend(job.backend)) for label, job in jobs.items()}


def test_every_job_is_done_with_plausible_metrics(records):
    assert {label: r["status"] for label, r in records.items()} == {
        "baseline": "done", "nf4": "done", "int8 t=6": "done"}
    base, nf4, int8 = records["baseline"], records["nf4"], records["int8 t=6"]
    assert nf4["size_bytes"] < int8["size_bytes"] < base["size_bytes"]
    assert base["bits_per_weight"] == pytest.approx(32.0)  # the demo model is float32
    assert 4.0 < nf4["bits_per_weight"] < int8["bits_per_weight"] < 32.0
    assert len({r["param_count"] for r in records.values()}) == 1
    for r in records.values():
        assert math.isfinite(r["perplexity"]) and 1.0 < r["perplexity"] < 50.0
        assert r["eval_tokens"] == 8 * 63
        assert r["wall_s"] >= r["load_s"] + r["quantize_s"] + r["eval_s"] - 1e-3
        assert r["quantize_s"] > 0 and r["eval_s"] > 0
        assert r["peak_device_mem_bytes"] > 50_000_000  # a CPU slot's device memory is its RSS
        assert r["device"] == "cpu" and r["worker"] == "local"
        assert r["started_at"] <= r["finished_at"]
    assert nf4["perplexity"] >= base["perplexity"]


def test_the_worker_reuses_the_loaded_model_between_jobs(records):
    # The baseline ran first and loaded the model; the other jobs reused it.
    assert records["baseline"]["source_cached"] is False
    assert records["nf4"]["source_cached"] is True and records["int8 t=6"]["source_cached"]
    assert records["nf4"]["load_s"] < records["baseline"]["load_s"] / 10


def test_the_same_job_twice_gives_the_same_quality(demo_model, records):
    job = jobs_for(demo_model)["nf4"]
    again = run_job(job, get_backend(job.backend))
    assert again["perplexity"] == records["nf4"]["perplexity"]
    assert again["size_bytes"] == records["nf4"]["size_bytes"]


def test_the_job_log_says_what_happened(records):
    log = records["nf4"]["log"]
    assert "attempt=1 start on worker local" in log and "perplexity" in log


def test_a_failing_job_returns_its_class_message_and_traceback(demo_model):
    job = jobs_for(demo_model, samples=100_000)["nf4"]
    record = run_job(job, get_backend(job.backend), attempt=2)
    assert record["status"] == "failed"
    assert record["error_class"] == "ValueError"
    assert "eval.samples x eval.seq_len needs 6400000" in record["error_message"]
    assert "Traceback" in record["traceback"] and "eval_windows" in record["traceback"]
    assert "attempt=2 failed: ValueError" in record["log"]


def test_an_unsupported_job_is_skipped_with_the_reason(demo_model):
    def needs_cuda(source, options, device):
        raise UnsupportedHere("this backend needs CUDA")

    job = jobs_for(demo_model)["nf4"]
    record = run_job(job, Backend("cuda-only", needs_cuda))
    assert record["status"] == "skipped"
    assert record["error_class"] == "unsupported"
    assert record["error_message"] == "this backend needs CUDA"
