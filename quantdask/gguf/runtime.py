"""A GGUF measured in llama.cpp's own runtime, not dequantized into torch: llama.cpp runs its
matmuls on 8-bit activations and keeps an f16 KV cache, so its figures are its own. The sweep's
windows go in as token ids (no re-tokenization, no BOS added), each window in one decode, and
every position's full logits come back into the same :class:`QualityMeter` every job uses."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from quantdask.errors import UnsupportedHere

if TYPE_CHECKING:
    import torch

    from quantdask.measure.metrics import QualityMeter

CUDA_BUILD = ("CMAKE_ARGS='-DGGML_CUDA=on' pip install --force-reinstall --no-cache-dir "
              "llama-cpp-python==0.3.36")


@dataclass(frozen=True)
class RuntimeDevice:
    """Where llama.cpp runs a job's model: ``threads`` CPU threads (the slot's share), and
    with ``gpu`` every layer on this worker's GPU (the first it sees: a dask-cuda worker
    sees its own only), none split across devices."""

    threads: int
    gpu: bool = False

    def check(self) -> None:
        """Refuse (the job is skipped with the reason) a GPU this worker or build lacks."""
        import llama_cpp
        import torch

        if self.gpu and not torch.cuda.is_available():
            raise UnsupportedHere("device: cuda, and this worker has no CUDA device")
        if self.gpu and not llama_cpp.llama_supports_gpu_offload():
            raise UnsupportedHere(f"device: cuda, and this llama-cpp-python was built without "
                                  f"GPU offload: {CUDA_BUILD}")

    def open(self, path: str | os.PathLike, **settings: Any):
        """The GGUF at ``path`` loaded here (``settings``: the context's, for ``Llama``)."""
        import llama_cpp

        self.check()
        return llama_cpp.Llama(model_path=str(path), n_threads=self.threads,
                               n_threads_batch=self.threads, verbose=False,
                               n_gpu_layers=-1 if self.gpu else 0, main_gpu=0,
                               split_mode=llama_cpp.LLAMA_SPLIT_MODE_NONE, **settings)


def llama_cpp_meter(path: str | os.PathLike, windows: torch.Tensor,
                    reference: dict[str, torch.Tensor] | None,
                    device: RuntimeDevice) -> QualityMeter:
    """``windows`` scored by the GGUF at ``path`` in llama.cpp on ``device``, against
    ``reference`` (the sweep's torch reference; None: itself)."""
    import numpy as np
    import torch

    from quantdask.measure.metrics import QualityMeter

    length = windows.size(1)
    llm = device.open(path, n_ctx=length, n_batch=length, n_ubatch=length, logits_all=True)
    meter = QualityMeter(windows, reference)
    try:
        for row, window in enumerate(windows.tolist()):
            llm.reset()
            llm.eval(window)
            logits = torch.from_numpy(np.array(llm.scores[:length - 1], dtype=np.float32))
            meter.add(slice(row, row + 1), slice(0, length - 1),
                      torch.log_softmax(logits, dim=-1).unsqueeze(0))
    finally:
        llm.close()
    return meter
