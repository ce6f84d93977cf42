"""The GPU cluster's worker spec, checked without a GPU: dask-cuda is replaced by a stand-in that
does what LocalCUDACluster 26.10 does with the arguments quantdask gives it (its
``local_cuda_cluster.py``: ``parse_memory_limit(memory_limit, nthreads=1,
total_cores=n_workers)``, then ``LocalCluster.__init__(n_workers=0, memory_limit=...)``, and one
worker per ``CUDA_VISIBLE_DEVICES`` entry, numbers or ``GPU-``/``MIG-`` UUIDs)."""

from __future__ import annotations

import importlib.util
import logging
import sys
from types import ModuleType

import pytest

from quantdask.cluster import local
from tests.conftest import REPO

UUIDS = ["GPU-9baca7f5-0f2f-01ac-6b05-8da14d6e9005", "GPU-84fd49f2-48ad-50e8-9f2e-3bf0dfd47ccb"]
MIG = "MIG-41b3359c-e721-56e5-8009-12e5797ed514"


def fake_dask_cuda(monkeypatch, seen: dict, real_scheduler: bool = False) -> None:
    """Put a stand-in ``dask_cuda`` in ``sys.modules`` that records LocalCUDACluster's
    arguments; with ``real_scheduler`` it then builds the worker spec as dask-cuda does, on a
    real LocalCluster with no workers (no GPU is touched), else stops there."""
    from distributed import LocalCluster
    from distributed.worker_memory import parse_memory_limit

    class LocalCUDACluster(LocalCluster):
        def __init__(self, CUDA_VISIBLE_DEVICES=None, n_workers=None, memory_limit="auto",
                     **kwargs):
            seen.update(CUDA_VISIBLE_DEVICES=CUDA_VISIBLE_DEVICES, n_workers=n_workers,
                        memory_limit=memory_limit, **kwargs)
            if not real_scheduler:
                raise RuntimeError("stop here")  # what follows needs a real cluster
            self.memory_limit = parse_memory_limit(
                memory_limit=memory_limit, nthreads=1, total_cores=n_workers,
                logger=logging.getLogger("fake_dask_cuda"))
            super().__init__(n_workers=0, memory_limit=self.memory_limit, processes=True,
                             **kwargs)

    fake = ModuleType("dask_cuda")
    fake.LocalCUDACluster = LocalCUDACluster
    monkeypatch.setitem(sys.modules, "dask_cuda", fake)


def test_gpu_workers_get_no_host_memory_limit(monkeypatch):
    # A limit read once at start (the host's memory on a VM that grows after boot can read a
    # few GiB) would pause each worker at 80% and kill it at 95% before any job ran.
    seen = {}
    fake_dask_cuda(monkeypatch, seen, real_scheduler=True)
    common = {"host": "127.0.0.1", "dashboard_address": None, "threads_per_worker": 1,
              "resources": {"GPU": 1}, "silence_logs": logging.ERROR,
              "scheduler_kwargs": local.SCHEDULER_OPTIONS, "preload": [local.WORKER_PRELOAD]}
    with local._start_cuda_cluster(["0", "1"], common, None) as handle:
        assert seen["memory_limit"] in (0, None)
        assert seen["n_workers"] == 2 and seen["CUDA_VISIBLE_DEVICES"] == "0,1"
        spec = handle.cluster.new_spec
        assert spec["options"]["memory_limit"] is None  # what each nanny and worker gets
        assert handle.cluster.memory_limit is None
        assert handle.kind == "cuda" and handle.gpus == ["0", "1"]


@pytest.mark.parametrize("visible", [",".join(UUIDS), f"{UUIDS[0]}, {MIG}"])
def test_cuda_visible_devices_given_as_uuids_reach_dask_cuda_as_they_are(monkeypatch, visible):
    entries = [v.strip() for v in visible.split(",")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(local, "cuda_device_count", lambda: len(entries))
    for gpus, expected in ((None, entries), ("1", entries[1:]), ([0], entries[:1])):
        seen = {}
        fake_dask_cuda(monkeypatch, seen)
        with pytest.raises(RuntimeError, match="stop here"):
            local.start_cluster(gpus=gpus)
        assert seen["CUDA_VISIBLE_DEVICES"] == ",".join(expected)
        assert seen["n_workers"] == len(expected)
    # Numbers still map through the inherited list (a SLURM allocation of GPUs 2 and 3).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert local._physical_gpus([1], None) == ["3"]


def test_a_worker_on_a_uuid_gpu_labels_and_probes_it_by_that_uuid(monkeypatch):
    from quantdask.process import devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", UUIDS[1])
    calls = []

    class FakeNvml:
        def nvmlInit(self):
            pass

        def nvmlDeviceGetHandleByUUID(self, uuid):
            calls.append(("uuid", uuid))
            return uuid

        def nvmlDeviceGetHandleByIndex(self, index):
            calls.append(("index", index))
            return index

    assert devices.physical_gpu_id(0) == UUIDS[1]
    assert devices.nvml_uuid(0) == UUIDS[1]  # no torch call: the name is the UUID already
    probe = devices.cuda_probe(0, nvml=FakeNvml())
    assert probe.device == f"cuda:{UUIDS[1]}" and calls == [("uuid", UUIDS[1])]


def test_the_smoke_reads_each_gpu_memory_by_its_cuda_index_not_its_physical_id(monkeypatch):
    # cluster.gpus holds physical ids (here UUIDs); the smoke used int() on them.
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "scripts" / "gpu_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    from quantdask.plan import placement
    from quantdask.process import devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(UUIDS))
    totals = {UUIDS[0]: 80 * 2**30, UUIDS[1]: 40 * 2**30}

    class FakeProbe:
        def __init__(self, gpu):
            self.gpu = gpu

        def sample(self):
            return {"memory_total_bytes": totals[self.gpu]}

    monkeypatch.setattr(devices, "NvmlProbe", FakeProbe)
    monkeypatch.setattr(placement, "advertised_memory",
                        lambda client: {UUIDS[0]: totals[UUIDS[0]], UUIDS[1]: totals[UUIDS[1]]})
    ok, shown = smoke.memory_advertised_as_expected(None, list(UUIDS), dry_run=False)
    assert ok, shown
    assert f"{UUIDS[1]}: 40.0 GiB" in shown
