"""torchao weight-only quantization: int8 (per channel) and int4 (grouped), an optional backend.

Install with ``pip install 'quantdask[torchao]'``. On a CPU, int4 uses torchao's CPU int4 kernel
(group sizes 32, 64, 128); on CUDA, the tile-packed layout, which needs a bfloat16 model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantdask.backends.base import (
    Backend,
    HostWork,
    Sizing,
    missing_library,
    named_in,
    require_library,
    skip_label,
    tensor_nbytes,
)
from quantdask.backends.capabilities import Dequantizes, ModuleAlone, Savable, Searchable
from quantdask.backends.options import LM_HEAD, BackendOptions, option, skip_modules_option
from quantdask.backends.per_module import (
    check_modules,
    mixed_label,
    module_format,
    modules_option,
    unknown_modules,
)
from quantdask.errors import SpecError, UnsupportedHere

MODULE_KEYS = ("mode", "group_size")  # what a module's own format may set (``modules``)
INT4_GROUP_SIZE = 128  # int4's default group size (int8 is per channel: none)
CPU_INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class TorchaoOptions(BackendOptions):
    """torchao's options; int4's group size is filled in by ``complete_options``."""

    mode: str | None = option(str, choices=("int8_weight_only", "int4_weight_only"),
                              help="int8 per-channel or int4 grouped weights")
    group_size: int | None = option(
        int, choices=(32, 64, 128, 256),
        help=f"int4: input features sharing one scale (default {INT4_GROUP_SIZE})")
    skip_modules: tuple[str, ...] | None = skip_modules_option()
    modules: dict | None = modules_option(MODULE_KEYS)

    def complete(self) -> TorchaoOptions:
        return complete_options(self)


def complete_options(options: TorchaoOptions) -> TorchaoOptions:
    if options.mode is None:
        raise SpecError("mode", "is required for torchao: int8_weight_only or int4_weight_only")
    check_modules(options, MODULE_KEYS)
    for name, own in (options.modules or {}).items():
        if own and own.get("mode") == "int8_weight_only" and own.get("group_size") is not None:
            raise SpecError(f"modules.{name}.group_size", "applies to int4_weight_only only; "
                                                          "set it to null")
    if options.mode == "int8_weight_only":
        if options.group_size is not None:
            raise SpecError("group_size", "applies to int4_weight_only only; remove it")
        return options
    return options.with_defaults(group_size=INT4_GROUP_SIZE)


def module_config(name: str, options: TorchaoOptions) -> tuple[str, int | None] | None:
    """The (mode, group size) module ``name`` is quantized with (``per_module``; int8 has no
    group, int4 the default where none is given); None where ``modules`` keeps it."""
    own = module_format(name, options, MODULE_KEYS)
    if own is None:
        return None
    if own["mode"] == "int8_weight_only":
        return own["mode"], None
    return own["mode"], own["group_size"] or INT4_GROUP_SIZE


def config_label(options: TorchaoOptions) -> str:
    if options.mode == "int8_weight_only":
        label = "ao int8wo"
    else:
        label = f"ao int4wo g{options.group_size}"
    return label + mixed_label(options) + skip_label(options.skip_modules, LM_HEAD)


TORCHAO = ("torchao.quantization", "torchao", "'quantdask[torchao]'")  # module, name, install


def _targets(model, options: TorchaoOptions) -> dict:
    """The linear layers torchao quantizes here, by name (``selects``)."""
    return {name: module for name, module in model.named_modules()
            if selects(name, type(module), options)}


def int4_unsupported(group: int | None, widths: dict[str, int], cuda: bool) -> str | None:
    """Why int4 with ``group`` cannot run on layers of these input ``widths`` here, or None.

    torchao skips a layer whose width its group size does not divide, silently: refused
    instead, so a result never claims int4 for a partly quantized model.
    """
    if group is None:  # complete_options sets it for int4
        return "torchao int4 needs a group_size"
    narrow = [(name, width) for name, width in widths.items() if width % group]
    if narrow:
        name, width = narrow[0]
        return (f"group_size={group} does not divide {name}.in_features={width}; choose a "
                "group size that divides every layer width")
    if not cuda and group not in CPU_INT4_GROUP_SIZES:
        return f"torchao int4 on a CPU supports group_size {CPU_INT4_GROUP_SIZES}, not {group}"
    return None


def check_torchao(options: TorchaoOptions, facts) -> str | None:
    """The driver's look before a sweep (``quantdask plan``): a reason it cannot run, or None."""
    missing = missing_library(*TORCHAO)
    if missing or not facts.linear_in_features:
        return missing
    linears = {name for name in facts.linear_in_features
               if not named_in(name, options.skip_modules)}
    return unknown_modules(options, linears, "torchao") or _unsupported_groups(
        options, {name: width for name, width in facts.linear_in_features.items()
                  if name in linears}, facts.cuda)


def _unsupported_groups(options: TorchaoOptions, widths: dict[str, int], cuda: bool
                        ) -> str | None:
    """Why an int4 group of some module (its own or the config's) cannot run here, or None."""
    groups: dict[int | None, dict[str, int]] = {}
    for name, width in widths.items():
        config = module_config(name, options)
        if config is not None and config[0] == "int4_weight_only":
            groups.setdefault(config[1], {})[name] = width
    return next(filter(None, (int4_unsupported(group, members, cuda)
                              for group, members in groups.items())), None)


def _config(quantization, mode: str, group: int | None, device: str, dtype: str):
    """torchao's config for (``mode``, ``group``) on ``device`` (see the module)."""
    if mode == "int8_weight_only":
        return quantization.Int8WeightOnlyConfig()
    if device.startswith("cuda"):
        if dtype != "torch.bfloat16":
            raise UnsupportedHere("torchao int4 on CUDA needs a bfloat16 model; "
                                  "set the model's dtype: bfloat16")
        return quantization.Int4WeightOnlyConfig(group_size=group,
                                                 int4_packing_format="tile_packed_to_4d")
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    return PrototypeInt4WeightOnlyConfig(group_size=group)


def quantize_torchao(source, options: TorchaoOptions, device: str):
    quantization = require_library(*TORCHAO)
    model = source.build(device)
    linears = {name for name, module in model.named_modules()
               if isinstance(module, _linear()) and not named_in(name, options.skip_modules)}
    targets = _targets(model, options)
    reason = unknown_modules(options, linears, "torchao") or _unsupported_groups(
        options, {n: m.in_features for n, m in targets.items()}, device.startswith("cuda"))
    if reason:
        raise UnsupportedHere(reason)
    by_config: dict[tuple, set] = {}
    for name, module in targets.items():
        config = module_config(name, options)
        assert config is not None  # a module kept is no target
        by_config.setdefault(config, set()).add(module)
    for (mode, group), wanted in by_config.items():
        config = _config(quantization, mode, group, device, str(source.dtype))
        quantization.quantize_(model, config,
                               filter_fn=lambda module, fqn, wanted=wanted: module in wanted)
    return model


def quantize_module(module, options: TorchaoOptions):
    """One linear layer quantized alone as ``quantize_torchao`` quantizes it with
    ``options`` (a search's probe); ``module`` keeps its weight."""
    import torch
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):  # (its jobs leave GPT-2's Conv1D as it is)
        raise UnsupportedHere("torchao quantizes nn.Linear only: a Conv1D stays in full "
                              "precision in its jobs")
    quantization = require_library(*TORCHAO)
    weight = module.weight.detach()
    reason = _unsupported_groups(options, {"the layer": weight.size(1)},
                                 weight.device.type == "cuda")
    if reason:
        raise UnsupportedHere(reason)
    copy = torch.nn.Linear(weight.size(1), weight.size(0), bias=module.bias is not None,
                           device="meta")
    copy.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
    if module.bias is not None:
        copy.bias = torch.nn.Parameter(module.bias.detach().clone(), requires_grad=False)
    mode, group = module_config("", options) or ("", None)
    config = _config(quantization, mode, group, str(weight.device), str(weight.dtype))
    quantization.quantize_(copy, config, filter_fn=lambda m, fqn: m is copy)
    return copy


INT4_UNSAVED = ("torchao's int4 on the CPU (its Int4OpaqueTensor) has no save format: "
                "transformers refuses to serialize it (checked on torchao 0.18, transformers "
                "5.25); a mix of int8 and kept modules saves")


def export_mix(model, options: TorchaoOptions, folder) -> Path:
    """A torchao config of per-module formats written as a checkpoint plain transformers
    loads (``Searchable.export``): the model loaded through transformers' own ``TorchAoConfig``
    with torchao's ``FqnToConfig`` (each linear's config by full name, the others left as
    they are), saved with safetensors into ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, TorchAoConfig

    quantization = require_library(*TORCHAO)
    configs: dict[str, object] = {"_default": None}  # a module not named stays as it is
    config = AutoConfig.from_pretrained(model.location, trust_remote_code=model.trust_remote_code)
    with torch.device("meta"):
        empty = AutoModelForCausalLM.from_config(config)
    for name in _targets(empty, options):
        found = module_config(name, options)
        if found is not None and found[0] != "int8_weight_only":
            raise UnsupportedHere(INT4_UNSAVED)
        if found is not None:
            configs[name] = _config(quantization, found[0], found[1], "cpu", "")
    quantized = AutoModelForCausalLM.from_pretrained(
        model.location, device_map="cpu", trust_remote_code=model.trust_remote_code,
        quantization_config=TorchAoConfig(quant_type=quantization.FqnToConfig(configs)))
    target = Path(folder) / "model"
    quantized.save_pretrained(target)
    return target / "model.safetensors"


def _linear() -> type:
    import torch

    return torch.nn.Linear


def selects(name: str, module_class: type, options: TorchaoOptions) -> bool:
    """torchao quantizes every ``nn.Linear`` (subclasses too) but the skipped modules and
    those ``modules`` keeps."""
    import torch

    return (issubclass(module_class, torch.nn.Linear)
            and not named_in(name, options.skip_modules)
            and module_config(name, options) is not None)


def weight_bits(options: TorchaoOptions, loaded_bits: int) -> float:
    """The model is loaded onto the device whole and then quantized layer by layer, so the
    peak holds the weights as loaded (the quantized copies replace them as they go)."""
    return float(loaded_bits)


def stored_bytes(tensor) -> int:
    """What a torchao tensor counts toward ``size_bytes``: its stored bytes, less the padding of
    the CUDA int4 tile-packed layout. That layout quantizes the weight padded to a width that is
    a multiple of 1024 and a height that is a multiple of 8, and its packed weights and scales
    both grow with the padded area: the weight's own share is its area over the padded one.
    (Device memory holds the padding: the job's peaks include it.)"""

    stored = tensor_nbytes(tensor)
    if type(tensor).__name__ != "Int4TilePackedTo4dTensor":
        return stored
    *_, rows, width = tensor.shape
    padded = _round_up(rows, TILE_PACKED_ROWS) * _round_up(width, TILE_PACKED_WIDTH)
    return stored * rows * width // padded


TILE_PACKED_WIDTH, TILE_PACKED_ROWS = 1024, 8  # torchao's Int4TilePackedTo4dTensor.from_hp


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def dequantize_layer(module):
    """A torchao-quantized linear layer's weight as float32; None for any other module."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    weight: torch.Tensor | None = getattr(module, "weight", None)
    if not isinstance(module, torch.nn.Linear) or not is_traceable_wrapper_subclass(weight):
        return None
    try:
        return weight.dequantize().float()
    except NotImplementedError:
        # Some packed int4 layouts cannot dequantize; W^T = linear(I, W) recovers the weight.
        eye = torch.eye(module.in_features, dtype=weight.dtype, device=weight.device)
        return torch.nn.functional.linear(eye, weight).t().float()


torchao_backend = Backend(
    name="torchao",
    quantize=quantize_torchao,
    options=TorchaoOptions,
    label=config_label,
    check=check_torchao,
    sizing=Sizing(selects=selects, weight_bits=weight_bits, stored_bytes=stored_bytes,
                  host_work=lambda options: HostWork(imports=84 * 2**20)),
    capabilities=(Dequantizes(dequantize_layer), Savable(),
                  ModuleAlone(quantize_module), Searchable(
                      MODULE_KEYS, export=export_mix,
                      least_bits=lambda o: {"int4_weight_only": 4, "int8_weight_only": 8}.get(
                          str(o.mode)))),
    description="torchao weight-only int8 / int4 (optional: pip install 'quantdask[torchao]')",
)
