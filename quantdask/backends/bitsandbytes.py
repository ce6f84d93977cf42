"""bitsandbytes through transformers: 4-bit (nf4/fp4, double quantization) and 8-bit LLM.int8."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from quantdask.backends.base import (
    Backend,
    HostWork,
    Sizing,
    missing_library,
    named_in,
    require_library,
    skip_label,
)
from quantdask.backends.capabilities import Dequantizes, Lacks, ModuleAlone, Savable, Searchable
from quantdask.backends.options import LM_HEAD, BackendOptions, option, skip_modules_option
from quantdask.errors import SpecError, UnsupportedHere


@dataclass(frozen=True)
class BitsAndBytesOptions(BackendOptions):
    """bitsandbytes' options; each width's own defaults are filled in by ``complete_options``."""

    bits: int | None = option(int, choices=(4, 8), help="4 (nf4/fp4) or 8 (LLM.int8)")
    quant_type: str | None = option(str, choices=("nf4", "fp4"), help="4-bit data type")
    double_quant: bool | None = option(bool,
                                       help="4-bit: quantize the quantization constants too")
    compute_dtype: str | None = option(str, choices=("float32", "bfloat16", "float16"),
                                       help="4-bit: dtype of the matmul")
    int8_threshold: float | None = option(
        float, check=lambda v: v >= 0, check_hint="must be >= 0",
        help="8-bit: outlier threshold (0 disables the fp16 outlier path)")
    # None: transformers' own choice, which leaves the output head (LM_HEAD) unquantized.
    skip_modules: tuple[str, ...] | None = skip_modules_option(None, "the output head")

    def complete(self) -> BitsAndBytesOptions:
        return complete_options(self)

    def batch_dependent(self) -> bool:
        # LLM.int8 decomposes the outlier columns of each pass's inputs (at a threshold of 3
        # the KL moved 3.6% between batches of 4 and of 16).
        return self.bits == 8 and bool(self.int8_threshold)


_FOUR_BIT_ONLY = ("quant_type", "double_quant", "compute_dtype")
_EIGHT_BIT_ONLY = ("int8_threshold",)
_DEFAULTS: dict[int, dict[str, Any]] = {
    4: {"quant_type": "nf4", "double_quant": False, "compute_dtype": "float32"},
    8: {"int8_threshold": 6.0}}


def complete_options(options: BitsAndBytesOptions) -> BitsAndBytesOptions:
    """Reject options that do not apply to the chosen bit width; fill that width's defaults."""
    if options.bits is None:
        raise SpecError("bits", "is required for bitsandbytes: 4 or 8")
    wrong = options.given(*(_EIGHT_BIT_ONLY if options.bits == 4 else _FOUR_BIT_ONLY))
    if wrong:
        raise SpecError(wrong[0], f"does not apply to {options.bits}-bit; remove it or use "
                                  f"bits: {12 - options.bits}")
    return options.with_defaults(**_DEFAULTS[options.bits])


def config_label(options: BitsAndBytesOptions) -> str:
    if options.bits == 8:
        label = f"int8 t={options.int8_threshold:g}"
    else:
        if options.quant_type is None:  # complete_options sets it for 4-bit
            raise SpecError("quant_type", "is required for 4-bit")
        label = options.quant_type + (" dq" if options.double_quant else "")
        if options.compute_dtype != "float32":
            label += f" {options.compute_dtype}"
    return label + skip_label(options.skip_modules)


def bitsandbytes_config(options: BitsAndBytesOptions):
    """The transformers ``BitsAndBytesConfig`` for a canonical option set."""
    import torch
    from transformers import BitsAndBytesConfig

    skip = list(options.skip_modules) if options.skip_modules is not None else None
    if options.bits == 4:
        if options.compute_dtype is None:  # complete_options sets it for 4-bit
            raise SpecError("compute_dtype", "is required for 4-bit")
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=options.quant_type,
            bnb_4bit_use_double_quant=options.double_quant,
            bnb_4bit_compute_dtype=getattr(torch, options.compute_dtype),
            llm_int8_skip_modules=skip,
        )
    return BitsAndBytesConfig(
        load_in_8bit=True, llm_int8_threshold=options.int8_threshold, llm_int8_skip_modules=skip
    )


BITSANDBYTES = ("bitsandbytes", "bitsandbytes", "bitsandbytes")  # module, name, what to install


CPU_4BIT_BLOCK = 64
"""bitsandbytes' 4-bit block size: on a processor with AVX512-BF16 its CPU kernel repacks each
4-bit layer at the first forward pass, which needs the layer's input width to be a multiple
of it (a reshape error otherwise, on every attempt)."""


def cpu_4bit_unsupported(widths: dict[str, int]) -> str | None:
    """Why bitsandbytes' CPU 4-bit kernel cannot run layers of these input ``widths`` on this
    processor, or None."""
    from bitsandbytes.functional import has_avx512bf16

    narrow = [(name, width) for name, width in widths.items() if width % CPU_4BIT_BLOCK]
    if not narrow or not has_avx512bf16():
        return None
    name, width = narrow[0]
    return (f"bitsandbytes' CPU 4-bit kernel on this processor (AVX512-BF16) needs each "
            f"quantized layer's input width to be a multiple of {CPU_4BIT_BLOCK}: "
            f"{name}.in_features={width}; quantize on a GPU, or leave the layer out "
            "(skip_modules)")


def selected_widths(source, options: BitsAndBytesOptions) -> dict[str, int]:
    """The input width of each layer transformers will replace (``selects``), from a skeleton
    of ``source``'s model on the meta device: no weight is read and nothing allocated."""
    import copy

    import torch
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        # A copy: building sets fields (dtype) on the config the worker keeps between jobs.
        skeleton = source.model_class._from_config(copy.deepcopy(source.config))
    # Conv1D stores its weight in x out (transformers transposes it into Linear4bit).
    return {name: module.weight.shape[0] if isinstance(module, Conv1D) else module.in_features
            for name, module in skeleton.named_modules()
            if selects(name, type(module), options)}


def quantize_bitsandbytes(source, options: BitsAndBytesOptions, device: str):
    bnb = require_library(*BITSANDBYTES)
    cpu_4bit = device == "cpu" and options.bits == 4
    if cpu_4bit and bnb.functional.has_avx512bf16():  # the kernel with the width limit
        # Refused from the layers' shapes, before a model is built and quantized for nothing.
        try:
            widths = selected_widths(source, options)
        except Exception:  # noqa: BLE001 - a model that will not build on the meta device
            widths = {}  # (remote code, say): the check on the built model below decides
        reason = cpu_4bit_unsupported(widths)
        if reason:
            raise UnsupportedHere(reason)
    model = source.build(device, quantization_config=bitsandbytes_config(options))
    if cpu_4bit:  # what transformers did replace: the truth, should the skeleton's names miss
        reason = cpu_4bit_unsupported({name: module.in_features
                                       for name, module in model.named_modules()
                                       if isinstance(module, bnb.nn.Linear4bit)})
        if reason:
            raise UnsupportedHere(reason)
    return model


def quantize_module(module, options: BitsAndBytesOptions):
    """One linear layer (or GPT-2's ``Conv1D``) as the bitsandbytes layer transformers makes
    of it with ``options``, quantized on the layer's device (a streamed model's layers);
    ``module`` keeps its weight."""
    import torch
    from transformers.pytorch_utils import Conv1D

    bnb = require_library(*BITSANDBYTES)
    weight = module.weight.detach()
    if isinstance(module, Conv1D):  # stored (in, out): transformers transposes it too
        weight = weight.t()
    out_features, in_features = weight.shape
    bias = module.bias is not None
    config = bitsandbytes_config(options)
    if options.bits == 4:
        reason = cpu_4bit_unsupported({"the layer": in_features}) \
            if weight.device.type == "cpu" and bnb.functional.has_avx512bf16() else None
        if reason:
            raise UnsupportedHere(reason)
        layer = bnb.nn.Linear4bit(in_features, out_features, bias,
                                  config.bnb_4bit_compute_dtype,
                                  compress_statistics=config.bnb_4bit_use_double_quant,
                                  quant_type=config.bnb_4bit_quant_type,
                                  quant_storage=config.bnb_4bit_quant_storage, device="meta")
        layer.weight = bnb.nn.Params4bit(weight.to("cpu").contiguous(), requires_grad=False,
                                         **layer.weight.__dict__).to(weight.device)
    else:
        layer = bnb.nn.Linear8bitLt(in_features, out_features, bias, has_fp16_weights=False,
                                    threshold=config.llm_int8_threshold, device="meta")
        layer.weight = bnb.nn.Int8Params(weight.to("cpu").contiguous(), requires_grad=False,
                                         has_fp16_weights=False).to(weight.device)
    if bias:
        layer.bias = torch.nn.Parameter(module.bias.detach().clone(), requires_grad=False)
    layer.source_cls = type(module)
    return layer.eval()


def check_bitsandbytes(options: BitsAndBytesOptions, facts) -> str | None:
    """The driver's look before a sweep (``quantdask plan``): a reason it cannot run, or None."""
    missing = missing_library(*BITSANDBYTES)
    if missing or facts.cuda or options.bits != 4:
        return missing
    replaced = {name for name, module_class, _ in facts.weight_modules
                if selects(name, module_class, options)}
    return cpu_4bit_unsupported({name: width for name, width in facts.linear_in_features.items()
                                 if name in replaced})


def weight_bits(options: BitsAndBytesOptions, loaded_bits: int) -> float:
    """Weights are quantized as they are loaded onto the device: 8-bit takes one byte a
    weight; 4-bit half a byte plus a float32 absmax per block of 64 (double quantization
    stores that absmax in 8 bits)."""
    if options.bits == 8:
        return 8.0
    return 4.0 + (8.0 if options.double_quant else 32.0) / 64


def selects(name: str, module_class: type, options: BitsAndBytesOptions) -> bool:
    """What transformers replaces with bitsandbytes layers: exactly ``nn.Linear`` (not a
    subclass, such as Falcon's own linear class) and GPT-2's ``Conv1D``, but the skipped
    modules (by default the output head)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    replaced = module_class is torch.nn.Linear or issubclass(module_class, Conv1D)
    return replaced and not named_in(name, options.skip_modules or LM_HEAD)


def dequantize_layer(module):
    """A bitsandbytes linear layer's weight dequantized to float32; None for any other module."""
    import bitsandbytes as bnb

    if isinstance(module, bnb.nn.Linear4bit):
        # Valid before the first forward pass only: on CPU that pass repacks 4-bit weights.
        weight = cast("bnb.nn.Params4bit", module.weight)  # nn.Linear's stub says Tensor
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    if isinstance(module, bnb.nn.Linear8bitLt):
        # LLM.int8 stores int8 rows (CB) with one absmax scale per row (SCB); the first
        # forward pass moves SCB from the weight to the layer's matmul state.
        int8 = cast("bnb.nn.Int8Params", module.weight)  # nn.Linear's stub says Tensor
        scales = int8.SCB if int8.SCB is not None else module.state.SCB
        if scales is None:
            raise ValueError("this 8-bit layer holds no row scales (SCB)")
        return int8.data.float() * scales.float().unsqueeze(1) / 127
    return None


def unpack_for_save(model) -> None:
    """Undo, in place, the CPU layout bitsandbytes gives 4-bit weights at their first forward
    pass on a CPU with AVX512-BF16 (``packing_format_for_cpu``), before ``save_pretrained``.

    bitsandbytes 0.50 undoes it itself when saving, but leaves the absmax of a layer without
    double quantization transposed (blocks x rows) and in bfloat16: the saved model, and the
    one in memory after the save, then scale each block by another row's absmax (KL 30x the
    measured one on the demo model). Here the absmax is put back in row order, in its dtype
    (the bfloat16 values the measured forward passes used, so the saved model is the measured
    one); the layer repacks itself at its next forward pass."""
    import bitsandbytes as bnb

    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if not (isinstance(module, bnb.nn.Linear4bit) and state is not None
                and getattr(state, "packing_format_for_cpu", False)):
            continue
        nested = state.original_nested  # the inverse re-quantizes a nested absmax itself
        data, state = bnb.functional._convert_weight_packed_for_cpu_inverse(module.weight.data,
                                                                            state)
        if not nested:
            state.absmax = state.absmax.T.reshape(-1).to(state.original_dtype).contiguous()
        weight = cast("bnb.nn.Params4bit", module.weight)  # nn.Linear's stub says Tensor
        weight.data, weight.quant_state = data, state


def host_work(options: BitsAndBytesOptions) -> HostWork:
    """On a CPU slot (measured, benchmarks/slot_memory.py): 4-bit's working memory is half a
    layer; LLM.int8 holds more, its outlier columns in float while it quantizes and runs."""
    return HostWork(1.0, 0.5, 2.8) if options.bits == 4 else HostWork(1.5, 1.2, 3.5)


bitsandbytes_backend = Backend(
    name="bitsandbytes",
    quantize=quantize_bitsandbytes,
    options=BitsAndBytesOptions,
    label=config_label,
    check=check_bitsandbytes,
    sizing=Sizing(selects=selects, weight_bits=weight_bits, host_work=host_work),
    capabilities=(
        Dequantizes(dequantize_layer), Savable(prepare=unpack_for_save),
        ModuleAlone(quantize_module),
        Lacks(Searchable, "transformers' BitsAndBytesConfig gives one format (nf4, fp4 or "
                          "int8) to every module it quantizes: it can leave modules out, not "
                          "mix formats, so a mixed candidate could not be built"),
    ),
    description="bitsandbytes 4-bit (nf4/fp4) and 8-bit (LLM.int8) via transformers",
)
