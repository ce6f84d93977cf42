"""Placement by device memory: the estimates, the up-front refusal, resume, and the requests
jobs and references make (against a real, in-process Dask scheduler whose workers advertise
chosen memory sizes)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import polars as pl
import psutil
import pytest
from conftest import sweep_dict
from distributed import Client, LocalCluster

import quantdask.plan.placement
from quantdask.demo_model import DEMO_MODEL_DIR, DEMO_TASKS_DIR
from quantdask.errors import PlacementError
from quantdask.plan.model_facts import model_facts
from quantdask.plan.placement import (
    advertised_memory,
    estimate_device_memory,
    place_jobs,
    workers_with_room,
)
from quantdask.plan.retry import with_more_room
from quantdask.sweepfile.sweep import DEVICE_MEMORY, expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from quantdask.util import format_bytes

BASELINE_ESTIMATE = int((3_482_128 + 983_040) * 1.2)  # see test_operator's plan test
# nf4's figure: the decoder layers at 4.5 bits (an absmax per 64), the embedding and the
# untied head (2 x 320 x 128 float32 weights, 327,680 bytes) as loaded
NF4_SHARE = 1 - 327_680 / 3_482_128
NF4_WEIGHTS = 3_482_128 * (NF4_SHARE * 4.5 / 32 + 1 - NF4_SHARE)
NF4_ESTIMATE = int(int(NF4_WEIGHTS + 983_040) * 1.2)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def advertising():
    """Factory: a client of a scheduler whose in-process workers advertise ``sizes`` bytes
    (None: a worker with GPU=1 and no DEVICE_MEMORY)."""
    made = []

    def make(*sizes) -> Client:
        # In-process (inproc://): no socket is opened at all.
        cluster = LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0")
        for i, size in enumerate(sizes):
            resources = {"GPU": 1} if size is None else {"GPU": 1, DEVICE_MEMORY: size}
            cluster.worker_spec[f"w{i}"] = {"cls": "distributed.Worker", "options": {
                "nthreads": 1, "resources": resources,
                # A worker's HTTP server (health, metrics) would otherwise listen on 0.0.0.0.
                "dashboard_address": "127.0.0.1:0"}}
        cluster.scale(len(sizes))
        client = Client(cluster)
        client.wait_for_workers(len(sizes), timeout=60)
        listening = {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        # At least the dashboards listen (an empty reading would prove nothing), and only there.
        assert listening == {"127.0.0.1"}, listening
        made.append((client, cluster))
        return client

    yield make
    for client, cluster in made:
        client.close()
        cluster.close()


def demo_jobs():
    return expand_grid(sweep_from_dict(sweep_dict()))  # the baseline and nf4


def test_jobs_ask_for_their_estimates_and_the_reference_for_the_baseline_s(advertising):
    client = advertising(4e6, 1e9)
    placement = place_jobs(demo_jobs(), client)
    baseline, nf4 = placement.jobs
    assert placement.largest == 1e9
    assert baseline.resources == {"GPU": 1.0, DEVICE_MEMORY: float(BASELINE_ESTIMATE)}
    assert nf4.resources == {"GPU": 1.0, DEVICE_MEMORY: float(NF4_ESTIMATE)}
    assert placement.reference_resources(nf4) == baseline.resources
    # An out-of-memory retry asks for twice as much, and its reference at least as much.
    roomier = placement.capped(with_more_room(with_more_room(with_more_room(baseline))))
    assert roomier.device_memory_bytes == 8 * BASELINE_ESTIMATE
    assert placement.reference_resources(roomier)[DEVICE_MEMORY] == 8 * BASELINE_ESTIMATE
    big = dataclasses.replace(baseline, device_memory_bytes=900_000_000)
    assert placement.capped(with_more_room(big)).device_memory_bytes == 1_000_000_000
    names = {name for name in workers_with_room(client, BASELINE_ESTIMATE).values()}
    assert len(names) == 1 and advertised_memory(client)[names.pop()] == 1e9
    assert len(workers_with_room(client, 0)) == 2


def test_a_job_that_fits_nowhere_is_refused_with_the_numbers(advertising):
    client = advertising(3e6, 3e6)
    with pytest.raises(PlacementError) as refused:
        place_jobs(demo_jobs(), client)
    assert [job_id for job_id, *_ in refused.value.too_big] == [demo_jobs()[0].id]
    assert refused.value.largest == 3e6
    assert f"needs ~5.1 MiB = {BASELINE_ESTIMATE:,} bytes (checkpoint size and config)" \
        in str(refused.value)
    # Finished already: it will not run, so it is not checked.
    placement = place_jobs(demo_jobs(), client, finished={demo_jobs()[0].id})
    assert placement.jobs[0].device_memory_bytes == 3_000_000


def test_a_job_that_ran_within_a_worker_is_not_refused_for_the_headroom(advertising,
                                                                         monkeypatch):
    baseline, nf4 = demo_jobs()
    peak = 2_900_000  # ran fine within 3 MB; its estimate with 20% headroom is 3.48 MB
    done = pl.DataFrame([{"job_id": baseline.id, "model": "demo", "backend": "none",
                          "config": json.dumps({}), "peak_device_mem_bytes": peak}])
    monkeypatch.setattr(quantdask.plan.placement, "done_results", lambda run_dir: done)
    placement = place_jobs([baseline, nf4], advertising(3e6), run_dir="anywhere")
    assert placement.jobs[0].device_memory_bytes == 3_000_000
    # nf4 never ran: its config's figure, scaled as the baseline's peak compares with its own.
    scaled = estimate_device_memory(nf4, quantdask.plan.placement.ModelFacts(
        {}, 3_482_128, False, 32, 32, 320, hidden_size=128), done)
    assert scaled.basis == "config, scaled by 1 measured peaks of this model"
    assert placement.jobs[1].device_memory_bytes == scaled.bytes
    assert scaled.bytes == int(int(NF4_WEIGHTS + 983_040) * (peak / 4_465_168) * 1.2)


def test_without_advertised_memory_jobs_ask_for_a_gpu_share_only(advertising, caplog):
    placement = place_jobs(demo_jobs(), advertising(None))
    assert placement.largest == 0 and all(j.resources == {"GPU": 1.0} for j in placement.jobs)
    assert "placement by device memory is off for this sweep: no worker advertises" \
        in caplog.text


def test_a_peak_measured_while_packed_jobs_ran_is_not_learned_from():
    # With jobs_per_gpu > 1 the peak is the worker's, shared with its neighbours: a job's own
    # estimate must not come from it, nor must its neighbours'.
    baseline, nf4 = demo_jobs()
    facts = quantdask.plan.placement.ModelFacts({}, 3_482_128, False, 32, 32, 320)
    row = {"job_id": baseline.id, "model": "demo", "backend": "none",
           "config": json.dumps({}), "peak_device_mem_bytes": 9_000_000}
    shared = pl.DataFrame([{**row, "peak_shared": True}])
    assert estimate_device_memory(baseline, facts, shared).basis == "checkpoint size and config"
    assert estimate_device_memory(nf4, facts, shared).basis == "checkpoint size and config"
    alone = pl.DataFrame([{**row, "peak_shared": False}])
    assert estimate_device_memory(baseline, facts, alone).basis == "its measured peak"
    older = pl.DataFrame([row])  # results from before the column: measured alone
    assert estimate_device_memory(baseline, facts, older).measured == 9_000_000


DEMO_CONFIG = json.loads(Path(DEMO_MODEL_DIR, "config.json").read_text())
CHECKPOINT = os.path.getsize(Path(DEMO_MODEL_DIR, "model.safetensors"))  # float32


def baseline_estimate(**blocks):
    """The demo baseline's estimate by config, under a sweep with ``blocks``."""
    job = expand_grid(sweep_from_dict(sweep_dict(**blocks)))[0]
    assert job.is_baseline
    return estimate_device_memory(job, model_facts(job, layers=False), pl.DataFrame())


def kv_cache_bytes(batch: int, tokens: int) -> int:
    """By hand from config.json: keys and values, per layer, per key/value head, per position,
    head_dim float32 numbers (the demo model is float32)."""
    config = DEMO_CONFIG
    return (2 * config["num_hidden_layers"] * config["num_key_value_heads"]
            * config["head_dim"] * batch * tokens * 4)


@pytest.mark.timeout(60)
def test_the_estimate_counts_the_kv_cache_of_the_largest_speed_batch():
    speed = {"prompt_length": 96, "new_tokens": 32}
    alone = baseline_estimate(speed={**speed, "batch_sizes": [1]})
    batched = baseline_estimate(speed={**speed, "batch_sizes": [1, 512]})
    # Batch 1's cache (256 KiB) is below the eval's logits: the eval still sets the peak.
    assert alone.peak_phase == "score"
    assert alone.bytes == int((CHECKPOINT + 983_040) * 1.2)
    # Batch 512: 2 x 4 layers x 2 kv heads x 32 x 512 x 128 tokens x 4 bytes = 128 MiB, and one
    # step's logits (batch x vocab float32, 3 copies: generate keeps the last position's only).
    logits = 512 * DEMO_CONFIG["vocab_size"] * 4 * 3
    assert kv_cache_bytes(512, 128) == 134_217_728
    assert batched.peak_phase == "time_generation"
    assert batched.bytes == int((CHECKPOINT + kv_cache_bytes(512, 128) + logits) * 1.2)
    assert "batch 512 x 128 tokens, KV cache 128.0 MiB" in batched.peak_note
    bigger = baseline_estimate(speed={**speed, "batch_sizes": [1024]})
    assert bigger.bytes - batched.bytes == pytest.approx(
        (kv_cache_bytes(512, 128) + logits) * 1.2, abs=2)


@pytest.mark.timeout(60)
def test_the_estimate_counts_lm_evals_batches_of_the_task_phase():
    tasks = {"names": ["demo_facts"], "include_path": DEMO_TASKS_DIR}
    vocab = DEMO_CONFIG["vocab_size"]
    for batch, max_length, window in ((16, None, 256), (64, None, 256), (64, 100, 100)):
        estimate = baseline_estimate(tasks={**tasks, "batch_size": batch,
                                            "max_length": max_length})
        # Padded to the longest input (max_length, else the model's 256 positions): float32
        # logits, 3 copies.
        assert estimate.peak_phase == "score_tasks"
        assert estimate.bytes == int((CHECKPOINT + batch * window * vocab * 4 * 3) * 1.2)
        # An upper bound: it alone refuses nothing (what must fit is the eval's peak).
        assert estimate.firm == int((CHECKPOINT + 983_040) * 1.2)


@pytest.mark.timeout(120)
def test_a_speed_batch_that_fits_no_worker_is_refused_naming_the_job(advertising):
    speed = {"prompt_length": 16, "new_tokens": 8, "batch_sizes": [1, 100_000]}
    jobs = expand_grid(sweep_from_dict(sweep_dict(speed=speed)))
    with pytest.raises(PlacementError) as refused:
        place_jobs(jobs, advertising(1e9))
    assert [job_id for job_id, *_ in refused.value.too_big] == [job.id for job in jobs]
    message = str(refused.value)
    assert f"demo baseline ({jobs[0].id}): needs ~" in message
    assert ("its peak in time_generation: batch 100,000 x 24 tokens, KV cache "
            f"{format_bytes(kv_cache_bytes(100_000, 24))}") in message
    assert "speed.batch_sizes" in message
    # The same sweep with batches that fit is placed: each job asks for its cache.
    fitting = expand_grid(sweep_from_dict(sweep_dict(speed={**speed, "batch_sizes": [1, 64]})))
    placement = place_jobs(fitting, advertising(1e9))
    assert placement.jobs[0].device_memory_bytes == int(
        (CHECKPOINT + kv_cache_bytes(64, 24) + 64 * DEMO_CONFIG["vocab_size"] * 12) * 1.2)


@pytest.mark.timeout(120)
def test_a_task_batch_past_every_worker_asks_for_the_largest_instead(advertising):
    tasks = {"names": ["demo_facts"], "include_path": DEMO_TASKS_DIR, "batch_size": 100_000}
    placement = place_jobs(expand_grid(sweep_from_dict(sweep_dict(tasks=tasks))),
                           advertising(1e9))
    assert [job.device_memory_bytes for job in placement.jobs] == [1_000_000_000] * 2


@pytest.mark.timeout(60)
def test_peaks_measured_without_a_phase_do_not_scale_its_figure_down():
    """An earlier run without the speed block measured the baseline's peak; the same model
    under a large speed batch is scaled by that peak against the phases the baseline ran, not
    against a figure with a cache it never held."""
    speed = {"prompt_length": 96, "new_tokens": 32, "batch_sizes": [512]}
    earlier = expand_grid(sweep_from_dict(sweep_dict()))[0]
    baseline, nf4 = expand_grid(sweep_from_dict(sweep_dict(speed=speed)))
    facts = model_facts(nf4, layers=False)
    peak = CHECKPOINT + 983_040  # exactly its figure: a ratio of 1
    done = pl.DataFrame([{"job_id": earlier.id, "model": "demo", "backend": "none",
                          "config": json.dumps({}), "peak_device_mem_bytes": peak}])
    phases = pl.DataFrame([{"job_id": earlier.id, "phase": name,
                            "peak_device_mem_bytes": peak // 2}
                           for name in ("load", "quantize", "score")])
    scaled = estimate_device_memory(nf4, facts, done, phases)
    assert scaled.basis == "config, scaled by 1 measured peaks of this model"
    assert scaled.peak_phase == "time_generation"
    assert scaled.bytes == int(int(NF4_WEIGHTS + kv_cache_bytes(512, 128)
                                   + 512 * DEMO_CONFIG["vocab_size"] * 12) * 1.2)
    # Its own measured peak: the phase that set it, from the phases frame.
    own = estimate_device_memory(earlier, facts, done, phases.with_columns(
        pl.when(pl.col("phase") == "score").then(peak).otherwise(1).alias(
            "peak_device_mem_bytes")))
    assert own.basis == "its measured peak" and own.peak_phase == "score"


@pytest.fixture
def no_workers():
    """A client of an in-process scheduler (no socket) with no worker: nothing could run."""
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        yield client


@pytest.mark.timeout(60)
def test_the_library_refuses_a_length_past_the_models_positions_before_anything_runs(
        no_workers, tmp_path):
    import time

    import quantdask as qd

    cases = {"eval.seq_len": sweep_dict(eval={**sweep_dict()["eval"], "seq_len": 1024}),
             "speed.prompt_length": sweep_dict(speed={"prompt_length": 100_000,
                                                      "new_tokens": 64}),
             "tasks.max_length": sweep_dict(tasks={
                 "names": ["demo_facts"], "include_path": DEMO_TASKS_DIR, "max_length": 4096})}
    for field, data in cases.items():
        sweep = sweep_from_dict(data)
        for submit in (qd.submit_sweep, qd.run_sweep):
            began = time.monotonic()
            with pytest.raises(qd.SpecError) as refused:
                submit(sweep, tmp_path / "run", no_workers)
            assert time.monotonic() - began < 10
            assert refused.value.field == field
            assert "model 'demo' takes at most 256 positions" in refused.value.message
            assert not (tmp_path / "run").exists()
