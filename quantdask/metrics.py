"""Measurements taken on a worker: memory peaks, model size, perplexity."""

from __future__ import annotations

import math
import os
import threading
import time
from typing import TYPE_CHECKING

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


class PeakMemory:
    """Peak device memory and peak host RSS over a ``with`` block.

    On CUDA, device memory is ``torch.cuda.max_memory_allocated`` (reset at entry). On a CPU slot
    the device is host memory, so both figures are the process's peak RSS.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.peak_device_bytes = 0
        self.peak_reserved_bytes = 0
        self.peak_rss_bytes = 0
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if not (_reset_vm_hwm() and _vm_hwm_bytes() is not None):
            # No resettable kernel counter: sample RSS instead (coarser, still per job).
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        self.peak_rss_bytes = current_rss_bytes()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak_rss_bytes = max(self.peak_rss_bytes, current_rss_bytes())

    def __exit__(self, *exc) -> None:
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
        else:
            self.peak_rss_bytes = max(self.peak_rss_bytes, _vm_hwm_bytes() or 0)
        self.peak_rss_bytes = max(self.peak_rss_bytes, current_rss_bytes())
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.peak_device_bytes = torch.cuda.max_memory_allocated()
            self.peak_reserved_bytes = torch.cuda.max_memory_reserved()
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


def model_size_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's serialized state: quantized weights plus their quantization constants.

    ``state_dict`` is what a checkpoint of the quantized model holds (bitsandbytes adds absmax,
    quant maps and scales there); shared tensors are counted once.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def eval_windows(token_ids: list[int], seq_len: int, samples: int) -> torch.Tensor:
    """The first ``samples`` non-overlapping windows of ``seq_len`` tokens, as a 2-D tensor."""
    import torch

    needed = seq_len * samples
    if len(token_ids) < needed:
        raise ValueError(f"eval text has {len(token_ids)} tokens; eval.samples x eval.seq_len "
                         f"needs {needed}. Lower them or give a longer text")
    return torch.tensor(token_ids[:needed], dtype=torch.long).view(samples, seq_len)


def perplexity(model: torch.nn.Module, windows: torch.Tensor, batch_size: int,
               device: str) -> float:
    """exp(mean next-token negative log-likelihood) over every predicted token of ``windows``."""
    import torch

    total_nll, total_tokens = 0.0, 0
    with torch.inference_mode():
        for batch in windows.split(batch_size):
            batch = batch.to(device)
            logits = model(input_ids=batch).logits[:, :-1].float()
            targets = batch[:, 1:]
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum"
            )
            total_nll += nll.item()
            total_tokens += targets.numel()
    return math.exp(total_nll / total_tokens)


def physical_gpu_id(local_index: int = 0) -> str:
    """The physical id of this process's ``local_index``-th GPU, respecting CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if local_index < len(ids):
            return ids[local_index]
    return str(local_index)
