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
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict(keep_vars=True).values():
        if id(tensor) not in seen:  # keep_vars: a tied tensor is the same object twice
            seen.add(id(tensor))
            total += tensor_nbytes(tensor)
    return total


def tensor_nbytes(tensor) -> int:
    """Bytes a tensor stores; for a tensor subclass (torchao), the sum of its inner tensors."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(tensor, n)) for n in names
                   if getattr(tensor, n) is not None)
    return tensor.numel() * tensor.element_size()


def eval_windows(token_ids: list[int], seq_len: int, samples: int) -> torch.Tensor:
    """The first ``samples`` non-overlapping windows of ``seq_len`` tokens, as a 2-D tensor."""
    import torch

    needed = seq_len * samples
    if len(token_ids) < needed:
        raise ValueError(f"eval text has {len(token_ids)} tokens; eval.samples x eval.seq_len "
                         f"needs {needed}. Lower them or give a longer text")
    return torch.tensor(token_ids[:needed], dtype=torch.long).view(samples, seq_len)


def forward_log_probs(model: torch.nn.Module, windows: torch.Tensor, batch_size: int,
                      device: str):
    """Yield, batch by batch, float32 CPU log-probs of the next token at each position but the
    last: (batch, seq_len - 1, vocab)."""
    import torch

    with torch.inference_mode():
        for batch in windows.split(batch_size):
            logits = model(input_ids=batch.to(device)).logits[:, :-1].float()
            yield torch.log_softmax(logits, dim=-1).cpu()


def quality(model: torch.nn.Module, windows: torch.Tensor, reference_log_probs: torch.Tensor,
            batch_size: int, device: str) -> dict[str, float]:
    """Perplexity on ``windows``, and KL divergence and top-1 agreement against the reference.

    KL is KL(reference || model) per predicted token, averaged over tokens (nats); top-1
    agreement is the share of positions where both pick the same most likely next token.
    """
    import torch

    nll = kl = agree = 0.0
    tokens = 0
    for i, log_q in enumerate(forward_log_probs(model, windows, batch_size, device)):
        rows = slice(i * batch_size, i * batch_size + log_q.size(0))
        log_p = reference_log_probs[rows]
        targets = windows[rows, 1:]
        nll -= log_q.gather(-1, targets.unsqueeze(-1)).sum().item()
        # Tokens the reference gives probability 0 add nothing (0 * log 0 = 0), not NaN.
        kl += torch.where(log_p > -math.inf, log_p.exp() * (log_p - log_q), 0.0).sum().item()
        agree += (log_p.argmax(-1) == log_q.argmax(-1)).sum().item()
        tokens += targets.numel()
    scores = {"perplexity": math.exp(nll / tokens), "kl_divergence": max(kl / tokens, 0.0),
              "top1_agreement": agree / tokens, "eval_tokens": tokens}
    broken = [name for name in ("perplexity", "kl_divergence") if not math.isfinite(scores[name])]
    if broken:  # e.g. an fp16 overflow in the quantized model: a failure, not a measurement
        raise ArithmeticError(f"non-finite {', '.join(broken)} ({scores}); the quantized model "
                              "produced inf/nan logits")
    return scores


def physical_gpu_id(local_index: int = 0) -> str:
    """The physical id of this process's ``local_index``-th GPU, respecting CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if local_index < len(ids):
            return ids[local_index]
    return str(local_index)
