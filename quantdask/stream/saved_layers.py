"""The decoder layers of a quantized checkpoint a calibrated backend saved, read one at a time
into a streamed model (``stream.streaming``): GPTQ fitted block by block from the checkpoint
(``StreamedFit``), then measured as transformers loads what it saved.

The layers come out as ``from_pretrained`` makes them: the model built on the meta device,
transformers' own quantizer for the checkpoint's ``quantization_config`` (with the loading
settings the backend gives, its CPU kernel) replaces the linear layers; each layer's turn
copies its empty layer, reads its tensors from the saved files (the packed weights, scales and
zero points, and the rest) and runs the quantizer's after-loading step on it (the kernels'
formats, their buffers). A tensor the saved files lack but the layer holds unsaved (a rotary
table) is taken from the full-precision layer the stream read.
"""

from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING

from quantdask.backends.base import SavedQuantized
from quantdask.errors import UnsupportedHere
from quantdask.measure.checkpoint_reader import CheckpointReader
from quantdask.measure.layers import decoder_layers
from quantdask.stream.streaming import assign, let_go

if TYPE_CHECKING:
    import torch


class SavedLayers:
    """``saved``'s quantized decoder layers, each as ``from_pretrained`` would load it with
    ``saved.loading`` (merged into the saved quantization config) on ``device``, then
    ``saved.prepare``d."""

    def __init__(self, saved: SavedQuantized, device: str):
        import torch
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.quantizers import AutoHfQuantizer

        config = AutoConfig.from_pretrained(saved.directory)
        stored = getattr(config, "quantization_config", None)
        if stored is None:
            raise UnsupportedHere(f"{saved.directory} holds no quantized checkpoint")
        with warnings.catch_warnings():  # merged on purpose, as from_pretrained merges them
            warnings.simplefilter("ignore", UserWarning)
            settings = (AutoHfQuantizer.merge_quantization_configs(stored, saved.loading)
                        if saved.loading is not None else stored)
        self.quantizer = AutoHfQuantizer.from_config(settings, pre_quantized=True)
        dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(
            torch, config.dtype or "float32")
        with init_empty_weights(include_buffers=True):  # nothing allocated, buffers neither
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.quantizer.preprocess_model(model, device_map={"": device})
        self.prefix, self.layers = decoder_layers(model)
        self.reader = CheckpointReader(saved.directory, model)
        self.device, self.prepare = device, saved.prepare

    def layer(self, full_precision: torch.nn.Module, name: str) -> torch.nn.Module:
        """Saved layer ``name`` (``model.layers.3``) in place of ``full_precision`` (the same
        layer read from the model's own checkpoint), which is let go."""
        import torch

        index = int(name.rsplit(".", 1)[1])
        layer = copy.deepcopy(self.layers[index])
        own = {**dict(full_precision.named_parameters()), **dict(full_precision.named_buffers())}
        for key, empty in [*layer.named_parameters(), *layer.named_buffers()]:
            full = f"{name}.{key}"
            if full in self.reader:
                value = self.reader.read(full)
            elif key in own:
                value = own[key]
            else:
                raise UnsupportedHere(f"the saved checkpoint holds no tensor for {full}")
            # Floating tensors in the dtype the layer holds them in, as loading casts them.
            dtype = empty.dtype if value.is_floating_point() else value.dtype
            assign(layer, key, value.to(device=self.device, dtype=dtype),
                   parameter=isinstance(empty, torch.nn.Parameter))
        self.quantizer._process_model_after_weight_loading(layer)
        classes = {key: type(module) for key, module in full_precision.named_modules()}
        for key, module in layer.named_modules():
            if self.prepare is not None:
                self.prepare(module)
            if hasattr(module, "qweight") and key in classes:
                module.source_cls = classes[key]  # per-layer stats: how the checkpoint held it
        let_go(full_precision)
        return layer.eval()

    __call__ = layer  # the stream's quantize_layer hook
