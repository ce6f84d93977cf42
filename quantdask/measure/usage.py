"""Resource measurement on a worker: memory peaks, section timers, the model's stored size.

(The quality metrics, perplexity, KL and top-1 agreement, are in :mod:`quantdask.measure.metrics`.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from quantdask.backends.base import tensor_nbytes

if TYPE_CHECKING:
    import torch


def _vm_hwm_bytes() -> int | None:
    """The process's peak resident set size (Linux VmHWM), or None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_vm_hwm() -> bool:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0), which turns the
    # process-lifetime peak into a per-job peak.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


_measuring_lock = threading.Lock()
_measuring: dict[PeakMemory, int] = {}  # the blocks measuring in this process: their threads


class PeakMemory:
    """Peak device memory and peak host RSS over a ``with`` block.

    On CUDA, device memory is ``torch.cuda.max_memory_allocated`` (reset at entry). On a CPU slot
    the device is host memory, so both figures are the process's peak RSS.

    A block inside another in the same thread (a job's calibration inside the job) measures
    its own peak: the outer block keeps its peak so far before the inner one resets the
    counters, so the outer's figure still covers everything it enclosed.

    Both counters are the process's (per device), so jobs packed on one worker
    (``jobs_per_gpu`` > 1, one thread each) cannot each have their own. A block that overlaps
    another thread's is ``shared``: it does not reset the counters (that would cut the other's
    peak short), and its figures are the peak of everything the worker ran meanwhile, an upper
    bound of its own. Results say so (``peak_shared``), and placement does not learn a job's
    memory from such a figure.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.peak_device_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_rss_bytes = 0
        self.shared = False
        self._carried = (0, 0, 0)  # (device, reserved, rss) peaks before an inner block's reset
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        this_thread = threading.get_ident()
        with _measuring_lock:
            for other, thread in _measuring.items():
                if thread != this_thread:
                    other.shared = self.shared = True
                else:
                    other._carry()
            _measuring[self] = this_thread
            alone = not self.shared
            if self.cuda:
                import torch

                torch.cuda.synchronize()
                if alone:
                    torch.cuda.reset_peak_memory_stats()
            if not ((not alone or _reset_vm_hwm()) and _vm_hwm_bytes() is not None):
                # No resettable kernel counter: sample RSS instead (coarser, still per job).
                self._sampler = threading.Thread(target=self._sample, daemon=True)
                self._sampler.start()
        self.peak_rss_bytes = current_rss_bytes()
        return self

    def _carry(self) -> None:
        """Keep the peaks so far (an inner block in this thread is about to reset them)."""
        device = reserved = 0
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            device, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        rss = self.peak_rss_bytes if self._sampler is not None else (_vm_hwm_bytes() or 0)
        carried = self._carried
        self._carried = (max(carried[0], device), max(carried[1], reserved), max(carried[2], rss))

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak_rss_bytes = max(self.peak_rss_bytes, current_rss_bytes())

    def __exit__(self, *exc) -> None:
        with _measuring_lock:
            _measuring.pop(self, None)
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
        else:
            self.peak_rss_bytes = max(self.peak_rss_bytes, _vm_hwm_bytes() or 0)
        self.peak_rss_bytes = max(self.peak_rss_bytes, current_rss_bytes(), self._carried[2])
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.peak_device_bytes = max(torch.cuda.max_memory_allocated(), self._carried[0])
            self.peak_reserved_bytes = max(torch.cuda.max_memory_reserved(), self._carried[1])
        else:
            self.peak_device_bytes = self.peak_reserved_bytes = self.peak_rss_bytes


class Stopwatch:
    """Named wall-clock sections: ``with watch("load"): ...`` then ``watch.seconds["load"]``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str):
        return _Section(self, name)


class _Section:
    def __init__(self, watch: Stopwatch, name: str):
        self.watch, self.name = watch, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        elapsed = time.perf_counter() - self.start
        self.watch.seconds[self.name] = self.watch.seconds.get(self.name, 0.0) + elapsed


def stored_tensors(model: torch.nn.Module,
                   stored_bytes=None) -> Iterator[tuple[str, torch.Tensor, int]]:
    """The tensors of the model's serialized state, each once: ``(state_dict key, tensor,
    bytes it counts)``.

    ``state_dict`` is what a checkpoint of the quantized model holds (bitsandbytes adds absmax,
    quant maps and scales there); shared tensors are counted once, under their first key.
    ``stored_bytes(tensor)`` (a backend's) counts a tensor whose layout pads it as the weight it
    holds.
    """
    seen: set[int] = set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:  # keep_vars: a tied tensor is the same object twice
            seen.add(id(tensor))
            yield key, tensor, (stored_bytes or tensor_nbytes)(tensor)
