"""What each worker's device is doing over time: utilization and memory, sampled in the background.

A :class:`DeviceSampler` worker plugin samples its worker's device every ``interval_s``: the GPU
through NVML, or, on a CPU slot, the worker process (CPU %, RSS). Jobs drain the samples into
their records and the driver drains the rest at the end of a sweep, so the device-samples frame
covers busy and idle time alike.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from collections import deque
from typing import Any, Protocol

from distributed.diagnostics.plugin import WorkerPlugin

from quantdask.records import Row

log = logging.getLogger("quantdask.devices")

SAMPLER_NAME = "quantdask-device-sampler"
TELEMETRY_TOPIC = "quantdask-telemetry"
"""Dask event topic: each worker's latest reading, about once a second, for live dashboards."""
TELEMETRY_EVERY_S = 1.0
MAX_BUFFERED = 20_000  # samples kept between drains (~3 h idle at 0.5 s); the oldest go first


class DeviceProbe(Protocol):
    """One reading of a device: utilization in percent and memory in bytes."""

    device: str

    def sample(self) -> dict[str, float | int]: ...


class NvmlProbe:
    """A GPU read through NVML. ``nvml`` is the ``pynvml`` module (or a fake with its API).

    ``gpu`` names the GPU as NVML does: its UUID (``GPU-...``, ``MIG-...``; what
    :func:`nvml_uuid` gives for a CUDA device) or NVML's own index. NVML numbers GPUs by PCI
    bus, CUDA fastest first, so a CUDA index is not an NVML index. ``device`` is the label the
    samples carry (default ``cuda:<gpu>``).
    """

    def __init__(self, gpu: int | str, nvml: Any = None, device: str | None = None):
        if nvml is None:
            try:
                import pynvml

                nvml = pynvml
            except ImportError as err:
                raise ImportError("GPU sampling needs NVML: pip install nvidia-ml-py "
                                  "(or quantdask[gpu])") from err
        self.nvml = nvml
        nvml.nvmlInit()
        if str(gpu).isdigit():
            self.handle = nvml.nvmlDeviceGetHandleByIndex(int(gpu))
        else:
            self.handle = nvml.nvmlDeviceGetHandleByUUID(str(gpu))
        self.device = device or f"cuda:{gpu}"

    def sample(self) -> dict[str, float | int]:
        rates = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
        memory = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return {"utilization_pct": float(rates.gpu), "memory_used_bytes": int(memory.used),
                "memory_total_bytes": int(memory.total)}


def nvml_uuid(cuda_index: int = 0) -> str:
    """NVML's name (UUID) of this process's ``cuda_index``-th CUDA device.

    CUDA orders devices fastest first and NVML by PCI bus, and dask-cuda replaces each
    worker's environment (so ``CUDA_DEVICE_ORDER`` cannot be passed down): the UUID is the one
    name both agree on. A ``CUDA_VISIBLE_DEVICES`` that names the GPU by UUID is used as it
    is."""
    import torch

    visible = physical_gpu_id(cuda_index)
    if visible.startswith(("GPU-", "MIG-")):
        return visible
    return f"GPU-{torch.cuda.get_device_properties(cuda_index).uuid}"


def cuda_probe(cuda_index: int = 0, nvml: Any = None) -> NvmlProbe:
    """The NVML probe of this process's ``cuda_index``-th CUDA device, labelled as results
    label it (``cuda:<id in CUDA_VISIBLE_DEVICES>``)."""

    return NvmlProbe(nvml_uuid(cuda_index), nvml=nvml,
                     device=f"cuda:{physical_gpu_id(cuda_index)}")


class ProcessProbe:
    """A CPU slot: the worker process's CPU use and resident memory."""

    device = "cpu"

    def __init__(self):
        import psutil

        self.process = psutil.Process()
        self.total = psutil.virtual_memory().total
        self.process.cpu_percent(None)  # the first call only starts the measurement

    def sample(self) -> dict[str, float | int]:
        return {"utilization_pct": float(self.process.cpu_percent(None)),
                "memory_used_bytes": int(self.process.memory_info().rss),
                "memory_total_bytes": int(self.total)}


def default_probe() -> DeviceProbe:
    """NVML for this worker's GPU when it has one, else the process probe."""
    import torch

    if torch.cuda.is_available():
        return cuda_probe(0)
    return ProcessProbe()


class DeviceSampler(WorkerPlugin):
    """Samples the worker's device every ``interval_s`` seconds in a daemon thread."""

    name = SAMPLER_NAME
    idempotent = True  # registering again (another sweep, same cluster) keeps the running one

    def __init__(self, interval_s: float = 0.5, probe_factory=default_probe):
        # Only picklable settings here: the plugin travels to the workers, state is made there.
        self.interval_s = interval_s
        self.probe_factory = probe_factory

    def setup(self, worker=None) -> None:
        self.worker_name = str(worker.name) if worker is not None else f"pid-{os.getpid()}"
        self._worker = worker
        self._published = 0.0
        # Jobs packed on one GPU (jobs_per_gpu > 1) run at once: a sample belongs to all of
        # the jobs running when it was taken.
        self._running: set[str] = set()
        self._lock = threading.Lock()
        self._samples: deque[Row] = deque(maxlen=MAX_BUFFERED)
        self._stop = threading.Event()
        try:
            self.probe = self.probe_factory()
        except Exception as error:  # noqa: BLE001 - no NVML, a GPU id NVML cannot map, ...
            log.error("no device sampling on worker %s: %s", self.worker_name, error)
            self.probe = None
        self._thread = threading.Thread(target=self._run, name=SAMPLER_NAME, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.sample_now()
            if self._stop.wait(self.interval_s):
                return

    def job_started(self, job_id: str) -> None:
        """``job_id`` runs on this worker from now on (take a sample to mark its start)."""
        with self._lock:
            self._running.add(job_id)
        self.sample_now()

    def job_finished(self, job_id: str, take: bool = True) -> list[Row]:
        """``job_id`` ended: take a last sample, and (with ``take``) return the samples no job
        still running here shares, for the finished job's record. Samples taken while a packed
        neighbour runs stay for the neighbour's record; none is dropped or given twice."""
        self.sample_now()
        with self._lock:
            self._running.discard(job_id)
            if not take:
                return []
            mine = [s for s in self._samples if not s["_jobs"] & self._running]
            kept = [s for s in self._samples if s["_jobs"] & self._running]
            self._samples.clear()
            self._samples.extend(kept)
        return [_public(s) for s in mine]

    def sample_now(self) -> None:
        if self.probe is None:
            return
        try:
            reading = self.probe.sample()
        except Exception as error:  # noqa: BLE001 - e.g. NVML queries a MIG slice refuses
            # Sampling is telemetry: it must never fail a job. Turn it off, say so once.
            log.error("device sampling on worker %s stopped: %s", self.worker_name, error)
            self.probe = None
            return
        with self._lock:
            jobs = frozenset(self._running)
            sample = {"worker": self.worker_name, "device": self.probe.device,
                      "time": dt.datetime.now(dt.UTC),
                      "job_id": ",".join(sorted(jobs)) or None, **reading, "_jobs": jobs}
            self._samples.append(sample)
        self._publish(_public(sample))

    def _publish(self, sample: Row) -> None:
        """Send the latest reading to whoever watches the sweep (``log_event`` is thread-safe;
        the driver subscribes to :data:`TELEMETRY_TOPIC`)."""
        now = time.monotonic()
        if self._worker is None or now - self._published < TELEMETRY_EVERY_S:
            return
        self._published = now
        try:
            # The scheduler overwrites a "worker" key with the worker's address: send the name
            # (what the results and samples call a worker) as "name".
            self._worker.log_event(TELEMETRY_TOPIC, {
                **{k: v for k, v in sample.items() if k != "worker"},
                "name": self.worker_name, "time": sample["time"].isoformat(),
                **self._host_memory()})
        except Exception as error:  # noqa: BLE001 - a closing worker; telemetry is optional
            log.debug("telemetry not sent: %s", error)

    def _host_memory(self) -> dict[str, int]:
        """The worker process's resident memory and its Dask memory limit (none: no limit),
        past which its nanny restarts it: what the driver says of a worker that died."""
        import psutil

        limit = getattr(getattr(self._worker, "memory_manager", None), "memory_limit", None)
        return {"host_rss_bytes": int(psutil.Process().memory_info().rss),
                **({"host_memory_limit_bytes": int(limit)} if limit else {})}

    def drain(self) -> list[Row]:
        """Every sample taken since the last drain (and forget them)."""
        with self._lock:
            taken = [_public(s) for s in self._samples]
            self._samples.clear()
        return taken

    def teardown(self, worker=None) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _public(sample: Row) -> Row:
    """A sample as it leaves the sampler: its running jobs are in ``job_id`` (comma-joined)."""
    return {k: v for k, v in sample.items() if k != "_jobs"}


def this_workers_sampler() -> DeviceSampler | None:
    """The sampler of the Dask worker running this code (None outside a worker or without one)."""
    try:
        from distributed import get_worker

        plugin = get_worker().plugins.get(SAMPLER_NAME)
    except ValueError:
        return None
    return plugin if isinstance(plugin, DeviceSampler) else None


def drain_this_worker(dask_worker) -> list[Row]:
    """For ``client.run``, which passes the worker as ``dask_worker`` (``get_worker`` finds
    none there, outside a task): that worker's undrained samples."""
    sampler = dask_worker.plugins.get(SAMPLER_NAME)
    return sampler.drain() if sampler is not None else []


def physical_gpu_id(local_index: int = 0) -> str:
    """The physical id of this process's ``local_index``-th GPU, respecting CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if local_index < len(ids):
            return ids[local_index]
    return str(local_index)
