"""A GGUF measured in llama.cpp's own runtime, not dequantized into torch: llama.cpp runs its
matmuls on 8-bit activations and keeps an f16 KV cache, so its figures are its own. The sweep's
windows go in as token ids (no re-tokenization, no BOS added), each window in one decode, and
every position's full logits come back into the same :class:`QualityMeter` every job uses."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from quantdask.measure.metrics import QualityMeter


def llama_cpp_meter(path: str | os.PathLike, windows: torch.Tensor,
                    reference: dict[str, torch.Tensor] | None, threads: int) -> QualityMeter:
    """``windows`` scored by the GGUF at ``path`` in llama.cpp (``threads`` for both decode
    and batch), against ``reference`` (the sweep's torch reference; None: itself)."""
    import llama_cpp
    import numpy as np
    import torch

    from quantdask.measure.metrics import QualityMeter

    length = windows.size(1)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=length, n_batch=length, n_ubatch=length,
                          logits_all=True, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
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
