"""Placement by device memory: the estimates, the up-front refusal, resume, and the requests
jobs and references make (against a real, in-process Dask scheduler whose workers advertise
chosen memory sizes)."""

from __future__ import annotations

import dataclasses
import json

import polars as pl
import psutil
import pytest
from conftest import sweep_dict
from distributed import Client, LocalCluster

import quantdask.driver.placement
from quantdask.driver.placement import (
    advertised_memory,
    estimate_device_memory,
    place_jobs,
    workers_with_room,
)
from quantdask.driver.retry import with_more_room
from quantdask.errors import PlacementError
from quantdask.spec.sweep import DEVICE_MEMORY, expand_grid
from quantdask.spec.sweep_file import sweep_from_dict

BASELINE_ESTIMATE = int((3_482_128 + 983_040) * 1.2)  # see test_operator's plan test
NF4_ESTIMATE = int(int(3_482_128 * 4.5 / 32 + 983_040) * 1.2)

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
    monkeypatch.setattr(quantdask.driver.placement, "done_results", lambda run_dir: done)
    placement = place_jobs([baseline, nf4], advertising(3e6), run_dir="anywhere")
    assert placement.jobs[0].device_memory_bytes == 3_000_000
    # nf4 never ran: its config's figure, scaled as the baseline's peak compares with its own.
    scaled = estimate_device_memory(nf4, quantdask.driver.placement.ModelFacts(
        {}, 3_482_128, False, 32, 32, 320), done)
    assert scaled.basis == "config, scaled by 1 measured peaks of this model"
    assert placement.jobs[1].device_memory_bytes == scaled.bytes
    assert scaled.bytes == int(int(3_482_128 * 4.5 / 32 + 983_040) * (peak / 4_465_168) * 1.2)


def test_without_advertised_memory_jobs_ask_for_a_gpu_share_only(advertising, caplog):
    placement = place_jobs(demo_jobs(), advertising(None))
    assert placement.largest == 0 and all(j.resources == {"GPU": 1.0} for j in placement.jobs)
    assert "placement by device memory is off for this sweep: no worker advertises" \
        in caplog.text


def test_a_peak_measured_while_packed_jobs_ran_is_not_learned_from():
    # With jobs_per_gpu > 1 the peak is the worker's, shared with its neighbours: a job's own
    # estimate must not come from it, nor must its neighbours'.
    baseline, nf4 = demo_jobs()
    facts = quantdask.driver.placement.ModelFacts({}, 3_482_128, False, 32, 32, 320)
    row = {"job_id": baseline.id, "model": "demo", "backend": "none",
           "config": json.dumps({}), "peak_device_mem_bytes": 9_000_000}
    shared = pl.DataFrame([{**row, "peak_shared": True}])
    assert estimate_device_memory(baseline, facts, shared).basis == "checkpoint size and config"
    assert estimate_device_memory(nf4, facts, shared).basis == "checkpoint size and config"
    alone = pl.DataFrame([{**row, "peak_shared": False}])
    assert estimate_device_memory(baseline, facts, alone).basis == "its measured peak"
    older = pl.DataFrame([row])  # results from before the column: measured alone
    assert estimate_device_memory(baseline, facts, older).measured == 9_000_000
