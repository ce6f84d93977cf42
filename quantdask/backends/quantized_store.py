"""Each (member, format) of a model quantized once per machine, then read back by every task
that needs it: a search's cells (kl or fisher), its whole-format measures and its torch
offspring (``probes.swapped_weight``), a GGUF mix's file (``gguf.assembled``), on any worker
of the machine, in this run or a later one (a rerun, another sweep of the same model).

A backend opts in with ``ModuleAlone.kept`` (a :class:`~quantdask.backends.capabilities.
KeptForm`): GGUF keeps the bytes llama.cpp's quantizer wrote (about 0.3-1.1 bytes per weight),
read back by libggml's dequantizer (1-3 G weights/s against the quantizer's 14-40 M/s on
K-quants). Others quantize again each time (``store_for`` gives None).

The files live under ``util.cache_root()/quantized``: one folder per (model's files, the dtype
its weights are held in, backend, quantizer version), one safetensors file per (member,
format's options). Written all or nothing; a file that cannot be read is quantized again.
Folders beyond :data:`STORE_LIMIT_BYTES` in all, least recently opened first, are deleted
when another is opened; any of it may be deleted at any time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantdask.util import atomic_write, cache_root

if TYPE_CHECKING:
    import torch

    from quantdask.backends.base import Backend
    from quantdask.backends.capabilities import KeptForm
    from quantdask.sweepfile.model import ModelSpec

STORE_LIMIT_BYTES = 32 << 30
"""The quantized tensors a machine keeps, at most, across models (a 1.5B model's six GGUF
types take about 5 GB)."""

_opened: set[Path] = set()  # folders this process has opened (pruned for once)
_lock = threading.Lock()


@dataclass(frozen=True)
class QuantizedStore:
    """One model's quantized members on this machine, for one backend (see the module)."""

    folder: Path
    kept: KeptForm

    def quantized(self, key: Any, quantize: Callable[[], Any]) -> Any:
        """The quantized module stored under ``key`` (JSON: a member and its format's
        options), else made by ``quantize()`` and stored."""
        path = self.folder / f"{_digest(key)}.safetensors"
        with contextlib.suppress(Exception):  # absent, half-deleted or unreadable: again
            return self._read(path)
        module = quantize()
        self._write(path, module)
        return module

    def _read(self, path: Path) -> Any:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as found:
            tensors = {key: found.get_tensor(key) for key in found.keys()}  # noqa: SIM118
            text = found.metadata() or {}
        return self.kept.module(tensors, text)

    def _write(self, path: Path, module: Any) -> None:
        from safetensors.torch import save

        tensors, text = self.kept.tensors(module)
        data = save({key: t.detach().cpu().contiguous() for key, t in tensors.items()}, text)
        with contextlib.suppress(OSError):  # a full disk costs the sharing, not the task
            atomic_write(path, lambda f: f.write(data), durable=False)


def store_for(model: ModelSpec, built: torch.nn.Module, backend: Backend
              ) -> QuantizedStore | None:
    """The store of ``model`` (``built``: the full-precision model as the probes hold it, whose
    weights' dtype the quantized ones follow) for ``backend``; None where the backend keeps no
    form (``ModuleAlone.kept``)."""
    alone = backend.probe_quantizer()
    kept = getattr(alone, "kept", None)
    if kept is None:
        return None
    dtype = str(next(built.parameters()).dtype)
    return opened_store([model.identity(), dtype, backend.name, kept.version], kept)


def opened_store(identity: Any, kept: KeptForm) -> QuantizedStore:
    """The store of what ``identity`` (JSON) names, its folder made and marked opened now (the
    others pruned, once per process)."""
    folder = store_root() / _digest(identity)
    with _lock:
        if folder not in _opened:
            _opened.add(folder)
            with contextlib.suppress(OSError):
                folder.mkdir(parents=True, exist_ok=True)
                folder.touch()  # its last opening, for the pruning
                prune(store_root(), keep=folder)
    return QuantizedStore(folder, kept)


def store_root() -> Path:
    """Where every model's quantized members are kept on this machine."""
    return cache_root() / "quantized"


def prune(root: Path, keep: Path, limit: int = STORE_LIMIT_BYTES) -> list[Path]:
    """Delete the folders under ``root`` opened longest ago until those left hold at most
    ``limit`` bytes (``keep`` is never deleted); the deleted folders."""
    folders = [f for f in root.iterdir() if f.is_dir()]
    sizes = {f: sum(p.stat().st_size for p in f.glob("*") if p.is_file()) for f in folders}
    total, deleted = sum(sizes.values()), []
    for folder in sorted(folders, key=lambda f: f.stat().st_mtime):
        if total <= limit:
            break
        if folder == keep:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        total -= sizes[folder]
        deleted.append(folder)
    return deleted


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:24]
