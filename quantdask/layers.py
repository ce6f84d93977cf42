"""Per-layer error of a quantized model: where in the network the quantization error comes from.

For every quantized linear layer: the dequantized weight against the original (relative error,
SQNR) and the layer's output on a probe batch against the output the original weight gives for
the same input (captured with a forward hook, so each layer is judged on its own error).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _sqnr_db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    return -math.inf if signal == 0 else 10.0 * math.log10(signal / noise)


def weight_errors(
    model: torch.nn.Module,
    dequantize_layer: Callable[[torch.nn.Module], torch.Tensor | None],
    originals: dict[str, torch.Tensor],
) -> list[dict[str, Any]]:
    """One row per layer ``dequantize_layer`` recognizes, in network order, with weight errors.

    Call it before the model's first forward pass: kernels may repack weights then (bitsandbytes
    does on some CPUs). Layers are dequantized one at a time, so memory stays at one layer.
    """
    rows = []
    for name, module in model.named_modules():
        original = originals.get(f"{name}.weight")
        weight_q = None if original is None else dequantize_layer(module)
        if weight_q is None:  # not a layer this backend quantized (e.g. the output head)
            continue
        original = original.float()
        noise = (weight_q.float().cpu() - original).pow(2).sum().item()
        signal = original.pow(2).sum().item()
        rows.append({
            "layer": name,
            "out_features": int(original.shape[0]),
            "in_features": int(original.shape[1]),
            "weight_rel_error": math.sqrt(noise / signal) if signal else 0.0,
            "weight_sqnr_db": _sqnr_db(signal, noise),
        })
    return rows


def add_output_errors(
    model: torch.nn.Module,
    rows: list[dict[str, Any]],
    originals: dict[str, torch.Tensor],
    probe: torch.Tensor,
    device: str,
) -> list[dict[str, Any]]:
    """``rows`` with ``output_rel_error``: each layer's output on ``probe`` (token ids) against
    the original weight applied to the same input."""
    import torch

    sums = {row["layer"]: [0.0, 0.0] for row in rows}

    def hook(name: str):
        weight = originals[f"{name}.weight"]
        bias = originals.get(f"{name}.bias")

        def capture(module, inputs, output):
            x = inputs[0].float()
            expected = torch.nn.functional.linear(
                x, weight.float().to(x.device), None if bias is None else bias.float().to(x.device))
            sums[name][0] += (output.float() - expected).pow(2).sum().item()
            sums[name][1] += expected.pow(2).sum().item()

        return capture

    handles = [model.get_submodule(name).register_forward_hook(hook(name)) for name in sums]
    try:
        with torch.inference_mode():
            model(input_ids=probe.to(device))
    finally:
        for handle in handles:
            handle.remove()
    return [{**row, "output_rel_error": math.sqrt(sums[row["layer"]][0] / sums[row["layer"]][1])
             if sums[row["layer"]][1] else 0.0} for row in rows]
