"""Per-layer error of a quantized model: where in the network the quantization error comes from.

For every quantized linear layer: the dequantized weight against the original (relative error,
SQNR) and the layer's output on a probe batch against the output the original weight gives for
the same input (captured with a forward hook, so each layer is judged on its own error).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from quantdask.records import Row

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel


def decoder_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder's stack of layers and its module name (``model.layers``, ``transformer.h``):
    the ``ModuleList`` of the model holding ``num_hidden_layers`` blocks."""
    import torch

    count = getattr(model.config, "num_hidden_layers", None)
    stacks = [(name, module) for name, module in model.named_modules()
              if isinstance(module, torch.nn.ModuleList) and len(module) > 0
              and (count is None or len(module) == count)]
    if not stacks:
        raise ValueError(f"{type(model).__name__}: no stack of {count} decoder layers found")
    return stacks[0]


def _sqnr_db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    return -math.inf if signal == 0 else 10.0 * math.log10(signal / noise)


def _stored_transposed(module: torch.nn.Module) -> bool:
    """Whether the checkpoint holds this layer's weight as (in, out): GPT-2's ``Conv1D``, kept
    by transformers as the replaced module's ``source_cls`` (bitsandbytes stores (out, in))."""
    from transformers.pytorch_utils import Conv1D

    return issubclass(getattr(module, "source_cls", type(module)), Conv1D)


def _oriented(original: torch.Tensor, weight_q: torch.Tensor,
              transposed: bool) -> tuple[torch.Tensor, bool]:
    """The original weight as (out_features, in_features), like the dequantized one, and whether
    the checkpoint stores it transposed (``transposed``, or a shape only the transpose fits).

    Raises ValueError when the two shapes do not correspond (a fused or reshaped layer)."""
    if original.dim() == 2 and transposed and tuple(weight_q.shape) == tuple(original.t().shape):
        return original.t(), True
    if tuple(weight_q.shape) == tuple(original.shape):
        return original, False
    if original.dim() == 2 and tuple(weight_q.shape) == tuple(original.t().shape):
        return original.t(), True
    raise ValueError(f"dequantized weight {tuple(weight_q.shape)} does not match the "
                     f"checkpoint's {tuple(original.shape)}")


def weight_errors(
    model: torch.nn.Module,
    dequantize_layer: Callable[[torch.nn.Module], torch.Tensor | None],
    originals: dict[str, torch.Tensor],
) -> tuple[list[Row], dict[str, str]]:
    """One row per layer ``dequantize_layer`` recognizes, in network order, with weight errors;
    and the layers it recognized but could not measure, with the reason (never an exception:
    the stats must not cost the job its measurements).

    Call it before the model's first forward pass: kernels may repack weights then (bitsandbytes
    does on some CPUs). Layers are dequantized one at a time, so memory stays at one layer.
    """
    rows, unmeasured = [], {}
    for name, module in model.named_modules():
        original = originals.get(f"{name}.weight")
        if original is None:
            continue
        try:
            weight_q = dequantize_layer(module)
            if weight_q is None:  # not a layer this backend quantized (e.g. the output head)
                continue
            original, transposed = _oriented(original.float(), weight_q,
                                             _stored_transposed(module))
            noise = _sum_of_squares(weight_q.float().cpu() - original)
        except Exception as err:  # noqa: BLE001 - recorded as unmeasured, with the reason
            unmeasured[name] = f"{type(err).__name__}: {err}"
            continue
        signal = _sum_of_squares(original)
        rows.append({
            "layer": name,
            "out_features": int(original.shape[0]),
            "in_features": int(original.shape[1]),
            "weight_rel_error": math.sqrt(noise / signal) if signal else 0.0,
            "weight_sqnr_db": _sqnr_db(signal, noise),
            "transposed": transposed,
        })
    return rows, unmeasured


class OutputErrors:
    """Each measured layer's output error (``output_rel_error``): its output on the first
    ``probe`` eval windows against the original weight applied to the same input, captured
    with forward hooks while the model evaluates (no forward pass of its own). Use it as a
    context around the eval, with ``batch`` as ``sliced_log_probs``' ``on_batch``; then
    ``rows()`` are the layer rows with the error (null for a layer whose output could not be
    compared, e.g. one that returns more than a tensor, with the reason in the job's log).

    The output head (a measured one: most backends skip it) is compared on the last position
    of each of its calls only: over every position it would make probe x seq_len x vocab
    floats, several times over (gigabytes at a 128k vocabulary)."""

    def __init__(self, model: torch.nn.Module, rows: Sequence[Row],
                 originals: dict[str, torch.Tensor], probe: int):
        self.model: torch.nn.Module | None = model  # None once measured (``__exit__``)
        self.originals, self.probe = originals, probe
        self._rows = rows
        self.sums = {row["layer"]: [0.0, 0.0] for row in rows}
        self.transposed = {row["layer"]: row["transposed"] for row in rows}
        self.failed: dict[str, str] = {}  # layer -> why its output could not be compared
        self.take = 0  # leading windows of the running batch that belong to the probe
        self._handles: list = []
        head = (cast("PreTrainedModel", model).get_output_embeddings()
                if hasattr(model, "get_output_embeddings") else None)
        self._head = next((n for n, m in model.named_modules() if m is head), None)

    def batch(self, rows: slice) -> None:
        """The next forward pass runs windows ``rows``: measure the probe's among them (past
        the probe, the hooks go: the rest of the eval runs without them)."""
        self.take = max(0, min(rows.stop, self.probe) - rows.start)
        if rows.start >= self.probe:
            self._remove_hooks()

    def __enter__(self) -> OutputErrors:
        if self.model is None:
            raise RuntimeError("an OutputErrors measures once: make another")
        try:
            for name in self.sums:
                module = self.model.get_submodule(name)
                self._handles.append(module.register_forward_hook(self._hook(name)))
        except BaseException:
            self._remove_hooks()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove_hooks()
        # Measured: the model and its original weights go, and ``rows()`` keeps the sums. A
        # streamed pass keeps each layer's watch to its end; holding them would hold every
        # layer and its float32 originals, the whole model (a worker killed at its limit).
        self.model, self.originals = None, {}

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, name: str):
        import torch

        weight = self.originals[f"{name}.weight"]
        bias = self.originals.get(f"{name}.bias")
        positions = slice(-1, None) if name == self._head else slice(None)

        def capture(module, inputs, output):
            if not self.take or name in self.failed:
                return
            try:
                x = inputs[0][:self.take, positions].float()
                w = weight.to(x.device).float()
                expected = torch.nn.functional.linear(
                    x, w.t() if self.transposed[name] else w,
                    None if bias is None else bias.to(x.device).float())
                produced = output[:self.take, positions].float()
                self.sums[name][0] += _sum_of_squares(produced - expected)
                self.sums[name][1] += _sum_of_squares(expected)
            except (MemoryError, torch.cuda.OutOfMemoryError):
                raise  # the eval's own device is full: the job's failure, retried with room
            except Exception as error:  # noqa: BLE001 - this layer's output error stays null
                self.failed[name] = f"{type(error).__name__}: {error}"

        return capture

    def rows(self) -> list[Row]:
        out = []
        for row in self._rows:
            error, norm = self.sums[row["layer"]]
            measured = (None if row["layer"] in self.failed
                        else math.sqrt(error / norm) if norm else 0.0)
            out.append({k: v for k, v in row.items() if k != "transposed"}
                       | {"output_rel_error": measured})
        return out


def _sum_of_squares(values: torch.Tensor) -> float:
    """Sum of squares, the same bits at any torch thread count: each row reduced by one thread,
    then the rows added exactly (torch splits the sum of a whole large tensor by thread)."""
    from quantdask.measure.metrics import exact_sum

    return exact_sum(values.pow(2).sum(-1))
