"""Sweep YAML files: safe loading, and errors that name the field as the file spells it.

>>> sweep = load_sweep("data/demo_sweep.yaml")
>>> sweep.name
'demo'
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

from quantdask.errors import SpecError
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.search import SearchSpec
from quantdask.sweepfile.settings import ArtifactSettings, CalibrationSettings, EvalSettings
from quantdask.sweepfile.speed import SpeedSettings
from quantdask.sweepfile.sweep import BackendBlock, Sweep
from quantdask.sweepfile.tasks import TaskSettings


@contextmanager
def _under(prefix: str):
    """Re-raise a SpecError with its field placed under ``prefix`` (``models[0]`` + ``path``)."""
    try:
        yield
    except SpecError as err:
        joined = ".".join(part for part in (prefix, err.field) if part)
        raise SpecError(joined or "sweep", err.message) from None
    except TypeError as err:  # a missing required argument of a spec class
        raise SpecError(prefix or "sweep", str(err).split(") ", 1)[-1]) from None


def field_names(cls) -> list[str]:
    """The keys a sweep file may give ``cls`` (not ``root``, nor what is resolved later)."""
    return [f.name for f in fields(cls)
            if f.init and f.name != "root" and not f.metadata.get("resolved")]


def _mapping(where: str, value: Any, cls: type, required: tuple[str, ...] = ()) -> dict:
    allowed = field_names(cls)
    if not isinstance(value, dict):
        raise SpecError(where, f"must be a mapping with keys {', '.join(allowed)}, got {value!r}")
    for key in value:
        if key not in allowed:
            raise SpecError(f"{where}.{key}" if where else str(key),
                            f"unknown key; allowed: {', '.join(allowed)}")
    for key in required:
        if key not in value:
            raise SpecError(f"{where}.{key}" if where else key, "is required")
    return value


def _list(where: str, value: Any, what: str) -> list:
    if not isinstance(value, list) or not value:
        raise SpecError(where, f"must be a non-empty list of {what}, got {value!r}")
    return value


def sweep_from_dict(data: Any, root: str = ".") -> Sweep:
    """A :class:`Sweep` from plain data (a parsed YAML file); paths are relative to ``root``."""
    data = _mapping("", data, Sweep, required=("name", "models", "eval"))
    if "backends" not in data and not data.get("searches"):
        raise SpecError("backends", "is required (or searches)")
    models = []
    for i, raw in enumerate(_list("models", data["models"], "models")):
        where = f"models[{i}]"
        with _under(where):
            models.append(ModelSpec(**_mapping("", raw, ModelSpec), root=root))
    blocks = []
    given = data.get("backends") or []
    for i, raw in enumerate(_list("backends", given, "backend blocks") if given else []):
        where = f"backends[{i}]"
        with _under(where):
            blocks.append(BackendBlock(**_mapping("", raw, BackendBlock, required=("backend",))))
    with _under("eval"):
        evaluation = EvalSettings(**_mapping("", data["eval"], EvalSettings), root=root)
    calibration = None
    if data.get("calibration") is not None:
        with _under("calibration"):
            calibration = CalibrationSettings(
                **_mapping("", data["calibration"], CalibrationSettings), root=root)
    artifacts = None
    if data.get("artifacts") is not None:
        with _under("artifacts"):
            artifacts = ArtifactSettings(**_mapping("", data["artifacts"], ArtifactSettings),
                                         root=root)
    tasks = None
    if data.get("tasks") is not None:
        with _under("tasks"):
            tasks = TaskSettings(**_mapping("", data["tasks"], TaskSettings,
                                            required=("names",)), root=root)
    speed = None
    if data.get("speed") is not None:
        with _under("speed"):
            speed = SpeedSettings(**_mapping("", data["speed"], SpeedSettings))
    searches = []
    for i, raw in enumerate(_list("searches", data["searches"], "searches")
                            if data.get("searches") is not None else []):
        with _under(f"searches[{i}]"):
            searches.append(SearchSpec(**_mapping("", raw, SearchSpec, required=(
                "name", "model", "backend", "formats", "budget"))))
    rest = {k: v for k, v in data.items() if k not in (
        "models", "backends", "eval", "calibration", "artifacts", "tasks", "speed", "searches")}
    with _under(""):
        return Sweep(models=models, backends=blocks, eval=evaluation, calibration=calibration,
                     artifacts=artifacts, tasks=tasks, speed=speed, searches=searches, **rest)


def load_sweep(path: str | os.PathLike) -> Sweep:
    """Read and validate a sweep YAML file (``yaml.safe_load``: no Python objects)."""
    import yaml

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as err:
        raise SpecError("sweep", f"cannot read {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise SpecError("sweep", f"{path} is not UTF-8 text; give a YAML file") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid syntax"
        raise SpecError("sweep", f"{path} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise SpecError("sweep", f"{path} must hold a YAML mapping with keys "
                                 f"{', '.join(field_names(Sweep))}")
    return sweep_from_dict(data, root=os.path.dirname(os.path.abspath(path)))
