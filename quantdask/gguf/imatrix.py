"""An importance matrix for llama.cpp's quantizer, computed in torch on the sweep's calibration
windows: for every linear layer inside the decoder blocks, the mean over tokens of each input
column's squared activation, which is what llama.cpp's ``llama-imatrix`` accumulates (the sum of
``x^2`` per column over every token of each matmul's input, divided by the tokens) and what
``llama_model_quantize`` takes per tensor (``llama_model_imatrix_data``). The head is left out,
as the tool leaves it by default. Names are mapped to the GGUF's with the pinned gguf-py."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch


def importance(model: torch.nn.Module, windows: torch.Tensor, architecture: str,
               batch_size: int = 4) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 mean squared input per column, from ``model`` (a
    transformers causal LM in float) run over ``windows`` (samples x seq_len ids)."""
    import torch

    from quantdask.gguf.source import gguf_module

    gguf = gguf_module()
    arch = {name: kind for kind, name in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    blocks = getattr(model.config, "num_hidden_layers", 0)
    names = gguf.get_tensor_name_map(arch, blocks)
    device = next(model.parameters()).device
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []

    def hooked(name: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * x).sum(0).cpu()
            counts[name] = counts.get(name, 0) + x.shape[0]
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            hooks.append(module.register_forward_pre_hook(hooked(name)))
    try:
        with torch.no_grad():
            for start in range(0, windows.size(0), batch_size):
                model(input_ids=windows[start:start + batch_size].to(device))
    finally:
        for hook in hooks:
            hook.remove()
    found = {}
    for name, total in sums.items():
        gguf_name = names.get_name(f"{name}.weight", try_suffixes=(".weight",))
        if gguf_name is None:
            raise ValueError(f"{name}: no GGUF tensor of the {architecture} architecture maps "
                             "to it")
        found[gguf_name] = (total / counts[name]).float().numpy()
    return found


class ImatrixArray:
    """``entries`` as llama.cpp's NULL-terminated ``llama_model_imatrix_data`` array; holds
    the buffers while a quantization reads them (``pointer``)."""

    def __init__(self, entries: dict[str, np.ndarray]):
        import llama_cpp
        import numpy as np

        self._names = [name.encode() for name in entries]
        self._values = [np.ascontiguousarray(v, dtype=np.float32) for v in entries.values()]
        self._array = (llama_cpp.llama_model_imatrix_data * (len(entries) + 1))()
        for i, (name, values) in enumerate(zip(self._names, self._values)):
            self._array[i].name = name
            self._array[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            self._array[i].size = values.size
        self._array[len(entries)].name = None

    @property
    def pointer(self):
        import llama_cpp

        return ctypes.cast(self._array, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
