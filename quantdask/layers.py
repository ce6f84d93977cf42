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
    return math.inf if noise == 0 else 10.0 * math.log10(signal / noise)


def layer_stats(
    model: torch.nn.Module,
    dequantize_layer: Callable[[torch.nn.Module], torch.Tensor | None],
    originals: dict[str, torch.Tensor],
    probe: torch.Tensor,
    device: str,
) -> list[dict[str, Any]]:
    """One row per layer that ``dequantize_layer`` recognizes, in network order.

    ``originals`` is the unquantized state dict; ``probe`` a batch of token ids. Weights are
    dequantized one layer at a time, so memory stays at one layer's worth.
    """
    import torch

    linear = {name: module for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and f"{name}.weight" in originals}
    output_err: dict[str, list[float]] = {name: [0.0, 0.0] for name in linear}

    def hook(name: str):
        weight = originals[f"{name}.weight"]
        bias = originals.get(f"{name}.bias")

        def capture(module, inputs, output):
            x = inputs[0].float()
            expected = torch.nn.functional.linear(
                x, weight.float().to(x.device), None if bias is None else bias.float().to(x.device))
            output_err[name][0] += (output.float() - expected).pow(2).sum().item()
            output_err[name][1] += expected.pow(2).sum().item()

        return capture

    handles = [module.register_forward_hook(hook(name)) for name, module in linear.items()]
    try:
        with torch.inference_mode():
            model(input_ids=probe.to(device))
    finally:
        for handle in handles:
            handle.remove()

    rows = []
    for name, module in linear.items():
        weight_q = dequantize_layer(module)
        if weight_q is None:  # left unquantized (e.g. the output head)
            continue
        original = originals[f"{name}.weight"].float()
        noise = (weight_q.float().cpu() - original).pow(2).sum().item()
        signal = original.pow(2).sum().item()
        out_noise, out_signal = output_err[name]
        rows.append({
            "layer": name,
            "out_features": int(original.shape[0]),
            "in_features": int(original.shape[1]),
            "weight_rel_error": math.sqrt(noise / signal) if signal else 0.0,
            "weight_sqnr_db": _sqnr_db(signal, noise),
            "output_rel_error": math.sqrt(out_noise / out_signal) if out_signal else 0.0,
        })
    return rows
