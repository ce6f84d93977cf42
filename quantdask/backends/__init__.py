"""The backend registry: quantization libraries by name.

>>> from quantdask.backends import get_backend
>>> get_backend("bitsandbytes").normalize({"bits": 4}, "options").quant_type
'nf4'
"""

from __future__ import annotations

from quantdask.backends.autoround import autoround_backend
from quantdask.backends.base import Backend
from quantdask.backends.baseline import BASELINE, baseline_backend
from quantdask.backends.bitsandbytes import bitsandbytes_backend
from quantdask.backends.capabilities import Searchable
from quantdask.backends.gptq.backend import awq_backend, gptq_backend
from quantdask.backends.hqq import hqq_backend
from quantdask.backends.options import BackendOptions, Option, option
from quantdask.backends.torchao import torchao_backend
from quantdask.errors import SpecError

_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Make ``backend`` available to sweeps under ``backend.name``."""
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered; pass replace=True")
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str, field: str = "backend") -> Backend:
    """The backend registered as ``name``; a :class:`SpecError` naming the choices otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        choices = ", ".join(n for n in _REGISTRY if n != BASELINE)
        raise SpecError(field, f"unknown backend {name!r}; available: {choices}") from None


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def searchable_backends() -> list[str]:
    """The backends a mixed-precision search can use: those that quantize one module alone
    and take per-module formats (:class:`~quantdask.backends.capabilities.Searchable`)."""
    return [name for name in sorted(_REGISTRY) if _REGISTRY[name].has(Searchable) is not None]


register_backend(baseline_backend)
register_backend(bitsandbytes_backend)
register_backend(torchao_backend)
register_backend(hqq_backend)
register_backend(autoround_backend)
register_backend(gptq_backend)
register_backend(awq_backend)

__all__ = ["BASELINE", "Backend", "BackendOptions", "Option", "backend_names", "get_backend",
           "option", "register_backend", "searchable_backends"]
