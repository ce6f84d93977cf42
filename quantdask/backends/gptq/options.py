"""The gptq and awq backends' options (checked at spec time), their completion and labels."""

from __future__ import annotations

from dataclasses import dataclass

from quantdask.backends.gptq.mixed import MODULE_KEYS
from quantdask.backends.options import LM_HEAD, BackendOptions, option, skip_modules_option
from quantdask.backends.per_module import check_modules, mixed_label, modules_option
from quantdask.errors import SpecError

GPTQ_BITS = (2, 3, 4, 8)  # what transformers reloads (gptqmodel's 5-7 bit format it does not)
GPTQ_GROUPS = (-1, 16, 32, 64, 128, 256)
AWQ_GROUPS = (-1, 16, 32, 64, 128)  # its torch kernel's


@dataclass(frozen=True)
class GptqOptions(BackendOptions):
    """GPTQ's options."""

    bits: int | None = option(int, choices=GPTQ_BITS, help="bits per weight")
    group_size: int | None = option(int, choices=GPTQ_GROUPS, default=128,
                                    help="weights sharing one scale and zero (default 128; "
                                         "-1: one group per output row)")
    sym: bool | None = option(bool, default=True, help="symmetric integers (default true)")
    desc_act: bool | None = option(bool, default=False,
                                   help="quantize columns in order of activation size "
                                        "(default false)")
    damp_percent: float | None = option(
        float, default=0.05, check=lambda v: 0 < v < 1, check_hint="must be between 0 and 1",
        help="dampening added to the Hessian's diagonal, as a share of its mean (default 0.05)")
    skip_modules: tuple[str, ...] | None = skip_modules_option()
    modules: dict | None = modules_option(MODULE_KEYS)

    def complete(self) -> GptqOptions:
        return complete_gptq(self)


@dataclass(frozen=True)
class AwqOptions(BackendOptions):
    """AWQ's options."""

    bits: int | None = option(int, choices=(4,), default=4,
                              help="bits per weight (4: the only width AWQ is sound at here)")
    group_size: int | None = option(int, choices=AWQ_GROUPS, default=128,
                                    help="weights sharing one scale and zero (default 128)")
    sym: bool | None = option(bool, default=False,
                              help="symmetric integers (default false: AWQ's zero points)")
    skip_modules: tuple[str, ...] | None = skip_modules_option()

    def complete(self) -> AwqOptions:
        return _head_only(self)


def _head_only(options):
    """Both leave only the output head unquantized: transformers reloads a GPTQ or AWQ model
    whose other layers were left in full precision with those layers' weights missing."""
    if tuple(options.skip_modules or ()) != LM_HEAD:
        raise SpecError("skip_modules", "gptqmodel's GPTQ and AWQ models reload only with every "
                                        "decoder layer quantized: leave it out (the head alone "
                                        "is skipped)")
    return options


def complete_gptq(options: GptqOptions) -> GptqOptions:
    if options.bits is None:
        raise SpecError("bits", f"is required for gptq: one of "
                                f"{', '.join(map(str, GPTQ_BITS))}")
    check_modules(options, MODULE_KEYS)
    kept = [name for name, own in (options.modules or {}).items() if own is None]
    if kept:
        raise SpecError(f"modules.{kept[0]}", "a GPTQ mix quantizes every decoder linear (a "
                                              "layer left in full precision does not reload): "
                                              "give it 8 bits instead of null")
    return _head_only(options)


def gptq_label(options: GptqOptions) -> str:
    label = f"gptq {options.bits}b g{options.group_size}"
    label += " desc" if options.desc_act else ""
    label += "" if options.sym else " asym"
    label += "" if options.damp_percent == 0.05 else f" damp={options.damp_percent:g}"
    return label + mixed_label(options)


def awq_label(options: AwqOptions) -> str:
    return f"awq {options.bits}b g{options.group_size}" + (" sym" if options.sym else "")
