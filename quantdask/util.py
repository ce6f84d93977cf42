"""Small helpers every layer uses: one clock reading for records, one atomic write, one way to
format durations and byte counts, where a job's scratch goes, imports that reach no network.
Importing it imports the standard library only, so any module may import it."""

from __future__ import annotations

import datetime as dt
import os
import tempfile
import threading
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: mkstemp makes files private, a report is there to be shared


def utcnow() -> dt.datetime:
    """Now, timezone-aware in UTC: every timestamp quantdask records."""
    return dt.datetime.now(dt.UTC)


def atomic_write(path: Path, write, durable: bool = True) -> None:
    """Write through a temporary file in the same directory, then rename: all or nothing.

    ``write`` gets the open binary file. ``durable`` syncs the file and the rename to disk (a
    record); a live view that is rewritten every second skips it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_UMASK)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:  # the rename itself must reach the disk too, or a power cut can forget it
            directory = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def format_duration(seconds: float | None) -> str:
    """``0:05``, ``12:30`` or ``1:02:03``; ``-`` for unknown."""
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def format_bytes(value: int | None) -> str:
    """``512 B``, ``1.5 MiB``, ``3.2 GiB``; ``-`` for unknown."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def scratch_root() -> str | None:
    """Where a job's temporary folders go: the Dask worker's own local directory when this
    runs in a worker (Dask removes it with the worker, and a killed worker's at the next
    start), else None, the system's temporary folder. A worker process ends without Python's
    exit handlers, so a folder left to a model's finalizer (the last job's) stayed in /tmp."""
    try:
        from distributed import get_worker

        return get_worker().local_directory
    except (ImportError, ValueError):  # not in a worker
        return None


_OFFLINE_IMPORTS = threading.RLock()  # (re-entrant: an import may import another)


def import_offline(module: str):
    """``module`` imported with the Hugging Face Hub offline while its import runs.

    bitsandbytes, on a processor with AVX512-BF16 and with ``kernels`` installed (transformers
    requires it), fetches a CPU kernel from the Hub as it is imported: code downloaded at
    import, a network lookup per worker, and 4-bit figures that would depend on whether the
    fetch worked. quantdask downloads nothing: its own CPU kernel runs everywhere. Only the
    import is offline (a model named by Hub id still loads). Raises ImportError as
    ``importlib.import_module`` does."""
    import importlib
    import sys

    if sys.modules.get(module) is not None:  # (None there: its import fails, as it should)
        return sys.modules[module]
    try:
        from huggingface_hub import constants as hub
    except ImportError:  # no Hub client: nothing could reach the Hub
        return importlib.import_module(module)
    with _OFFLINE_IMPORTS:  # two jobs' imports at once would put back each other's setting
        online = hub.HF_HUB_OFFLINE
        hub.HF_HUB_OFFLINE = True
        try:
            return importlib.import_module(module)
        finally:
            hub.HF_HUB_OFFLINE = online


def import_datasets_offline():
    """The ``datasets`` module, set never to reach the network (quantdask downloads nothing).

    Both switches are needed: ``HF_DATASETS_OFFLINE`` is read when ``datasets`` is first
    imported, and a process where another library (lm-eval) imported it first kept it online:
    a dataset missing from the cache was then looked up on the Hub, five retries over 23 s,
    before the refusal. Its config's ``HF_HUB_OFFLINE`` is what its loaders check at call time.
    Raises ImportError when ``datasets`` is not installed."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets

    datasets.config.HF_HUB_OFFLINE = True
    return datasets
