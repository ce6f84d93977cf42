"""Per-module formats (the ``modules`` option of a backend a mixed-precision search can use):
``{full module name: {key: value, ...} | null}``, each key one of the backend's own options
(``Searchable.module_keys``: hqq's bits and group size, torchao's mode and group size), each left
out taking the config's own value; null keeps that module unquantized.

>>> from quantdask.backends.hqq import HqqOptions
>>> options = HqqOptions(bits=4, group_size=64, modules={"a": {"bits": 2}, "b": None})
>>> module_format("a", options, ("bits", "group_size")), module_format("b", options, ("bits",))
({'bits': 2, 'group_size': 64}, None)
"""

from __future__ import annotations

import re
from typing import Any

from quantdask.backends.options import BackendOptions, option
from quantdask.errors import SpecError


def modules_option(keys: tuple[str, ...]) -> Any:
    """The ``modules`` option of a backend whose modules may each take ``keys``."""
    return option(dict, help=f"per-module formats, by full module name: {{{', '.join(keys)}}} "
                             "(each left out: the config's own), or null to keep that module "
                             "unquantized (a mixed-precision search's candidates)")


def check_modules(options: BackendOptions, keys: tuple[str, ...]) -> None:
    """Refuse a ``modules`` entry that is not a mapping of ``keys`` to values those options
    of ``options`` accept (or null), naming it."""
    for name, format in (options.get("modules") or {}).items():
        where = f"modules.{name}"
        if format is None:
            continue
        if not isinstance(format, dict) or not format:
            raise SpecError(where, f"must be a mapping of {' and '.join(keys)} (any may be left "
                                   f"out) or null to keep the module unquantized, got {format!r}")
        for key, value in format.items():
            if key not in keys:
                raise SpecError(f"{where}.{key}", f"unknown key; a module's format takes "
                                                  f"{' and '.join(keys)}")
            if value is not None:  # null: none (torchao int8 has no group size)
                type(options).declared()[key].validate(f"{where}.{key}", value)


def module_format(name: str, options: BackendOptions, keys: tuple[str, ...]
                  ) -> dict[str, Any] | None:
    """The values of ``keys`` module ``name`` is quantized with: its own from ``modules``,
    else the config's; None where ``modules`` keeps it unquantized."""
    modules = options.get("modules") or {}
    own = modules.get(name, {})
    if own is None:
        return None
    return {key: own.get(key, options.get(key)) for key in keys}


def unknown_modules(options: BackendOptions, linears: set[str], backend: str) -> str | None:
    """Why ``modules`` cannot apply: a name that is no linear layer ``backend`` quantizes."""
    unknown = sorted(set(options.get("modules") or {}) - linears)
    if unknown:
        return (f"modules names {unknown[:3]}{' ...' if len(unknown) > 3 else ''}, which are "
                f"not linear layers {backend} quantizes in this model (full module names, as "
                "model.named_modules() gives them)")
    return None


def mixed_label(options: BackendOptions) -> str:
    """What a config label adds for per-module formats."""
    modules = options.get("modules")
    return f" mixed({len(modules)} modules)" if modules else ""


def module_options(backend, options: BackendOptions, name: str) -> BackendOptions | None:
    """The options module ``name`` is quantized with alone (``ModuleAlone``):
    the config's, with the module's own format from ``modules``; None where kept."""
    own = module_format(name, options, backend.module_keys)
    if own is None:
        return None
    shared = {key: value for key, value in options.as_dict().items()
              if key != "modules" and key not in backend.module_keys and value is not None}
    try:
        return backend.normalize({**shared, **_given(own)}, f"modules.{name}")
    except SpecError:
        # A key the module left out may not apply to its own format (torchao's int8 takes
        # no group size): the module's own keys alone then.
        given = (options.get("modules") or {}).get(name) or {}
        if set(given) >= set(own):
            raise
        return backend.normalize({**shared, **_given(given)}, f"modules.{name}")


def _given(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


# transformers' fused experts parameters (each expert's projections stacked), and the
# projections each holds: gate and up fused, or one.
_FUSED = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<fused>gate_up_proj|gate_proj|up_proj|down_proj)$")
_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj")}


def expert_projections(name: str) -> tuple[str, tuple[str, ...]] | None:
    """For a fused experts member (``model.layers.0.mlp.experts.gate_up_proj``): its experts
    module and the per-expert projections it holds (``("gate_proj", "up_proj")``), the names
    a runtime that keeps one linear per expert gives them (``experts.3.gate_proj``); else
    None."""
    found = _FUSED.match(name)
    if found is None:
        return None
    fused = found.group("fused")
    return found.group("experts"), _PROJECTIONS.get(fused, (fused,))


def fused_expert_params(model) -> dict[str, Any]:
    """``model``'s fused experts parameters by full name (3-D, every expert of a projection,
    named as :func:`expert_projections` reads them), each with the module holding it."""
    return {f"{owner}.{name}": module for owner, module in model.named_modules()
            for name, weight in module.named_parameters(recurse=False)
            if weight.dim() == 3 and expert_projections(f"{owner}.{name}")}
