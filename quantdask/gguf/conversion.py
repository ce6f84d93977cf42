"""A model's full-precision GGUF, made once for the sweep: one Dask task per (model, outtype)
that the model's GGUF jobs depend on (``OwnRuntime.prepare``), writing into a cache on its
machine. Only the file's path travels through Dask, never the gigabytes: a job on a machine
that sees the file (the same one, or shared storage) reads it; one on a machine that does not
converts there, once per machine (a lock per model)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import socket
from dataclasses import dataclass
from pathlib import Path

from quantdask.backends.capabilities import Preparation
from quantdask.errors import UnsupportedHere
from quantdask.gguf.source import LLAMA_CPP_COMMIT
from quantdask.gguf.types import canonical

FULL_PRECISION = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
"""The types a GGUF job takes as converted (the runtime's cost before any weight is
quantized): the converter's outtype for each."""


def cache_dir() -> Path:
    """Where converted GGUFs are kept on a worker's machine (delete it to reclaim the space)."""
    from quantdask.util import cache_root

    return cache_root() / "gguf"


def conversion_key(model, outtype: str) -> str:
    """What the converted file is: the model (its files' fingerprint, as its jobs' ids take
    it), the outtype and the converter's source (a model retrained in place converts again)."""
    return hashlib.sha256(json.dumps([model.identity(), outtype, LLAMA_CPP_COMMIT],
                                     sort_keys=True).encode()).hexdigest()[:16]


def converted(model, outtype: str, timeout_s: float = 3600.0) -> Path:
    """The model's GGUF in ``outtype``, converted on this machine once (a lock per model: a
    second caller waits for the first's file, then reads it)."""
    from quantdask.gguf.convert import convert

    folder = cache_dir() / conversion_key(model, outtype)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"model-{outtype}.gguf"
    with open(folder / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not out.is_file():
                convert(model.location, out, outtype, timeout_s)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


@dataclass(frozen=True)
class Converted:
    """What the conversion task made: the file's ``path`` on ``host`` (its size, to know the
    same file elsewhere), or why the converter refused the model (``refused``: its jobs are
    skipped with it)."""

    outtype: str
    path: str | None
    host: str
    size: int = 0
    refused: str | None = None


def outtype_of(options) -> str:
    """The outtype a GGUF config is quantized from (or is, for F32/F16/BF16)."""
    return FULL_PRECISION.get(canonical(str(options.type)), "f32")


def convert_for_jobs(model, outtype: str, timeout_s: float) -> Converted:
    """The conversion task: the model converted here (or found in this machine's cache). A
    model the converter refuses is a result, not an error: each job then records the reason."""
    from quantdask.process.runtime import worker_task
    from quantdask.words import WorkerTaskKind

    host = socket.gethostname()
    with worker_task(WorkerTaskKind.CONVERT, model.label):
        try:
            path = converted(model, outtype, timeout_s)
        except UnsupportedHere as refused:
            return Converted(outtype, None, host, refused=str(refused))
    return Converted(outtype, str(path), host, path.stat().st_size)


def conversion(job) -> Preparation:
    """The conversion a GGUF job depends on (``OwnRuntime.prepare``): one per model and
    outtype, whatever the configs."""
    outtype = outtype_of(job.options)
    return Preparation(f"gguf-convert-{conversion_key(job.model, outtype)}", convert_for_jobs,
                       (job.model, outtype, job.timeout_s))


def base_file(prepared: Converted | None, model, outtype: str, timeout_s: float) -> Path:
    """The converted file a job quantizes: the conversion task's where this machine sees it
    (the same machine, or shared storage: the same size), else converted here once."""
    if prepared is not None and prepared.outtype == outtype:
        if prepared.refused is not None:
            raise UnsupportedHere(prepared.refused)
        path = Path(prepared.path or "")
        if path.is_file() and path.stat().st_size == prepared.size:
            return path
    return converted(model, outtype, timeout_s)
