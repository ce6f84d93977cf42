"""Checks of one field of a sweep, each raising a SpecError that names the field and says what is
allowed."""

from __future__ import annotations

import os
import re
from typing import Any

from quantdask.errors import SpecError

NAME = re.compile(r"^[\w.-]+$")
"""What a name that becomes part of a path or a label may hold."""


def require(field_name: str, value: Any, kind: type | tuple, what: str) -> Any:
    """``value`` if it is of ``kind`` (a bool is no int), else SpecError."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise SpecError(field_name, f"must be {what}, got {value!r}")
    return value


def keyed(field_name: str, value: Any, allowed: tuple[str, ...], what: str) -> dict:
    """``value`` if it is a mapping whose keys are all ``allowed``, else a SpecError naming the
    field (or the unknown key under it)."""
    require(field_name, value, dict, what)
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise SpecError(f"{field_name}.{unknown[0]}", f"unknown key; allowed: {', '.join(allowed)}")
    return value


def positive_int(field_name: str, value: Any, what: str = "a positive integer") -> int:
    """``value`` if it is an int of at least 1, else SpecError."""
    require(field_name, value, int, what)
    if value < 1:
        raise SpecError(field_name, f"must be {what}, got {value!r}")
    return value


def resolve_root(root: str) -> str:
    """The directory a sweep's relative paths are relative to (the working one by default)."""
    return os.path.abspath(root or ".")
