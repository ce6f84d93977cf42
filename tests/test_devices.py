"""Device sampling behind a small interface (a fake NVML here), and the per-device summary."""

from __future__ import annotations

import datetime as dt
import time
from types import SimpleNamespace

import polars as pl
import psutil
import pytest

from quantdask.process.devices import DeviceSampler, NvmlProbe, ProcessProbe, physical_gpu_id
from quantdask.store.summary import device_summary

pytestmark = pytest.mark.timeout(60)

GIB = 2**30


class FakeNvml:
    """The slice of pynvml's API quantdask uses, for two GPUs with fixed readings."""

    def __init__(self):
        self.initialized = False
        self.readings = {0: (10, 1 * GIB), 1: (85, 30 * GIB)}

    def nvmlInit(self):
        self.initialized = True

    def nvmlDeviceGetHandleByIndex(self, index):
        assert self.initialized, "nvmlInit first"
        return index

    # NVML numbers GPUs by PCI bus; CUDA (fastest first) may number them the other way round.
    uuids = {"GPU-aaaa": 1, "GPU-bbbb": 0}

    def nvmlDeviceGetHandleByUUID(self, uuid):
        assert self.initialized, "nvmlInit first"
        return self.uuids[uuid]

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self.readings[handle][0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=self.readings[handle][1], total=141 * GIB, free=0)


def test_nvml_probe_reads_the_physical_gpu():
    probe = NvmlProbe(1, nvml=FakeNvml())
    assert probe.device == "cuda:1"
    assert probe.sample() == {"utilization_pct": 85.0, "memory_used_bytes": 30 * GIB,
                              "memory_total_bytes": 141 * GIB}


def test_a_cuda_device_is_found_in_nvml_by_its_uuid_not_its_index(monkeypatch):
    import torch

    from quantdask.process.devices import cuda_probe, nvml_uuid

    # CUDA's device 0 is the GPU that NVML, by PCI bus, numbers 1 (uuid GPU-aaaa).
    cuda_order = ["aaaa", "bbbb"]
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid=cuda_order[i]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert nvml_uuid(0) == "GPU-aaaa" and nvml_uuid(1) == "GPU-bbbb"
    probe = cuda_probe(0, nvml=FakeNvml())
    assert probe.device == "cuda:0"
    assert probe.sample()["utilization_pct"] == 85.0  # NVML's device 1, not its device 0
    # dask-cuda's worker 1 sees only CUDA's GPU 1 (bbbb, NVML's 0) as its device 0: labelled
    # by its id in CUDA_VISIBLE_DEVICES, read from NVML's device 0.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    cuda_order[:] = ["bbbb"]
    probe = cuda_probe(0, nvml=FakeNvml())
    assert probe.device == "cuda:1" and probe.sample()["utilization_pct"] == 10.0
    # A GPU named by UUID in CUDA_VISIBLE_DEVICES is looked up as named.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbbb")
    assert nvml_uuid(0) == "GPU-bbbb"
    assert cuda_probe(0, nvml=FakeNvml()).sample()["utilization_pct"] == 10.0


def test_physical_gpu_id_respects_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # as dask-cuda sets it for worker 5
    assert physical_gpu_id(0) == "5" and physical_gpu_id(1) == "7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert physical_gpu_id(0) == "0"


def test_sampler_tags_samples_with_the_running_job_and_drains_them():
    sampler = DeviceSampler(interval_s=60, probe_factory=lambda: NvmlProbe(0, nvml=FakeNvml()))
    sampler.setup(None)
    try:
        sampler.job_started("bitsandbytes-1")
        taken = sampler.job_finished("bitsandbytes-1")
        sampler.sample_now()
        samples = taken + sampler.drain()
    finally:
        sampler.teardown(None)
    # The thread's first sample (idle), the job's first and last, and one idle again.
    assert [s["job_id"] for s in samples] == [None, "bitsandbytes-1", "bitsandbytes-1", None]
    assert {s["device"] for s in samples} == {"cuda:0"}
    assert all(s["utilization_pct"] == 10.0 for s in samples)
    assert sampler.drain() == []


def test_packed_jobs_share_their_samples_and_neither_takes_the_others():
    # jobs_per_gpu: 2 runs two jobs on one worker at once: A, then B joins, A ends, B ends.
    sampler = DeviceSampler(interval_s=60, probe_factory=lambda: NvmlProbe(0, nvml=FakeNvml()))
    sampler.setup(None)
    try:
        sampler.drain()  # the thread's first (idle) sample
        sampler.job_started("A")
        sampler.job_started("B")
        sampler.sample_now()
        for_a = sampler.job_finished("A")
        sampler.sample_now()
        for_b = sampler.job_finished("B")
        left = sampler.drain()
    finally:
        sampler.teardown(None)
    # A's record gets only what it ran alone; what both ran stays for B, the last to end.
    assert [s["job_id"] for s in for_a] == ["A"]
    assert [s["job_id"] for s in for_b] == ["A,B", "A,B", "A,B", "B", "B"]
    assert left == [] and all("_jobs" not in s for s in for_a + for_b)


def test_process_probe_reads_this_process():
    probe = ProcessProbe()
    # Keep this process busy for 0.3 s of CPU time, measured here independently of psutil:
    # the probe's utilization is this process's CPU time over the wall time, in percent.
    cpu0, wall0 = time.process_time(), time.monotonic()
    while time.process_time() - cpu0 < 0.3:
        pass
    busy = probe.sample()
    busy_pct = 100 * (time.process_time() - cpu0) / (time.monotonic() - wall0)
    # Then idle for 0.3 s: each reading covers the time since the previous one.
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(0.3)
    idle = probe.sample()
    idle_pct = 100 * (time.process_time() - cpu0) / (time.monotonic() - wall0)
    # On a loaded machine the busy loop gets a smaller share of a core: the tolerance is at
    # most half the gap between the two, so that no constant reading can pass both checks.
    gap = busy_pct - idle_pct
    assert gap > 5, (busy_pct, idle_pct)
    tolerance = min(10.0, gap / 2)
    assert busy["utilization_pct"] == pytest.approx(busy_pct, abs=tolerance)
    assert idle["utilization_pct"] == pytest.approx(idle_pct, abs=tolerance)
    assert idle["memory_used_bytes"] == pytest.approx(psutil.Process().memory_info().rss,
                                                      rel=0.05)
    assert idle["memory_total_bytes"] == psutil.virtual_memory().total


def test_device_summary_busy_idle_and_utilization():
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def at(seconds):
        return t0 + dt.timedelta(seconds=seconds)

    results = pl.DataFrame({
        "job_id": ["a", "b", "c"],
        "worker": ["0", "0", "1"], "device": ["cuda:0", "cuda:0", "cuda:1"],
        "started_at": [at(0), at(4), at(0)], "finished_at": [at(4), at(10), at(5)],
        "peak_device_mem_bytes": [100, 300, 200],
    })
    summary = device_summary(results).to_dicts()
    assert summary == [
        {"worker": "0", "device": "cuda:0", "jobs": 2, "attempts": 2, "tasks": 0,
         "busy_s": 10.0, "idle_s": 0.0, "utilization": 1.0, "peak_device_mem_bytes": 300},
        {"worker": "1", "device": "cuda:1", "jobs": 1, "attempts": 1, "tasks": 0,
         "busy_s": 5.0, "idle_s": 5.0, "utilization": 0.5, "peak_device_mem_bytes": 200},
    ]

    # From the attempts: two sessions a day apart (a resumed run), a failed try that counts as
    # busy time, and two jobs sharing worker 0 at once (jobs_per_gpu 2) counted once.
    day = 86_400
    attempts = pl.DataFrame({
        "run_id": ["r1", "r1", "r1", "r2", "r2"],
        "job_id": ["a", "b", "c", "c", "d"],
        "worker": ["0", "0", "1", "1", "0"], "device": ["cuda:0", "cuda:0", "cuda:1",
                                                      "cuda:1", "cuda:0"],
        "started_at": [at(0), at(2), at(0), at(day), at(day)],
        "finished_at": [at(4), at(6), at(3), at(day + 4), at(day + 2)],
        "status": ["done", "done", "failed", "done", "done"],
    })
    by_worker = {r["worker"]: r for r in device_summary(results, attempts=attempts).to_dicts()}
    # Windows: 6 s (session 1) + 4 s (session 2) = 10 s, not a day.
    assert by_worker["0"]["busy_s"] == 6.0 + 2.0 and by_worker["0"]["idle_s"] == 2.0
    assert by_worker["0"]["jobs"] == 3 and by_worker["0"]["attempts"] == 3
    assert by_worker["1"]["busy_s"] == 3.0 + 4.0 and by_worker["1"]["utilization"] == 0.7
    assert by_worker["1"]["attempts"] == 2 and by_worker["1"]["jobs"] == 1
    # A search's probe on worker 1 after its job's try, inside session 1's window: busy too.
    probe = pl.DataFrame({"run_id": ["r1"], "kind": ["probe"], "worker": ["1"],
                          "device": ["cuda:1"], "started_at": [at(3)], "finished_at": [at(6)],
                          "status": ["done"]})
    by_worker = {r["worker"]: r for r in device_summary(results, attempts=attempts,
                                                        worker_tasks=probe).to_dicts()}
    assert by_worker["1"]["busy_s"] == 3.0 + 3.0 + 4.0 and by_worker["1"]["utilization"] == 1.0
    assert (by_worker["1"]["tasks"], by_worker["1"]["attempts"]) == (1, 2)
    assert by_worker["0"]["busy_s"] == 8.0 and by_worker["0"]["tasks"] == 0


def test_a_failed_dask_cuda_import_names_what_is_missing_and_the_extra():
    from quantdask.cluster.local import dask_cuda_missing

    bindings = ImportError("cannot import name 'bindings' from 'cuda'", name="cuda")
    message = dask_cuda_missing(bindings)
    assert "dask-cuda is installed but cannot import 'cuda'" in message
    assert "quantdask[gpu-cu" in message and "bindings" in message
    absent = ModuleNotFoundError("No module named 'dask_cuda'", name="dask_cuda")
    assert dask_cuda_missing(absent).startswith("dask-cuda is not installed; GPU workers need it")


def test_peaks_of_blocks_that_overlap_in_two_threads_are_flagged_shared():
    import threading

    from quantdask.measure.usage import PeakMemory

    with PeakMemory(cuda=False) as alone:
        with PeakMemory(cuda=False) as nested:  # the same job (one thread): not shared
            rss_inside = psutil.Process().memory_info().rss
    assert not alone.shared and not nested.shared
    assert alone.peak_rss_bytes >= nested.peak_rss_bytes >= rss_inside
    first_in, second_done = threading.Event(), threading.Event()
    blocks = {}

    def packed(name: str, wait_for: threading.Event | None, then: threading.Event):
        with PeakMemory(cuda=False) as peak:
            blocks[name] = peak
            then.set()
            if wait_for is not None:
                assert wait_for.wait(10)
    one = threading.Thread(target=packed, args=("one", second_done, first_in))
    one.start()
    assert first_in.wait(10)
    packed("two", None, threading.Event())  # starts and ends while "one" runs
    second_done.set()
    one.join(10)
    assert blocks["one"].shared and blocks["two"].shared
    with PeakMemory(cuda=False) as after:  # nothing else running now
        pass
    assert not after.shared
