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


def cache_root() -> Path:
    """quantdask's folder in the user's cache (``$XDG_CACHE_HOME`` or ``~/.cache``): what is
    kept between runs on this machine (converted GGUFs, quantized tensors, the report's
    bundle); any of it may be deleted to reclaim the space."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quantdask"


def restore_environment(saved: dict[str, str]) -> None:
    """Put the process's environment back to ``saved`` (a copy of ``os.environ`` made before
    a library set its variables process-wide): by difference, so that no variable is ever
    missing, even for a moment, under another job of the worker."""
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


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


TRIM_EVERY_S = 0.1
"""How often the freed heap is handed back while a block runs: as often as Dask's nanny
reads the worker's RSS (``distributed.worker.memory.monitor-interval``, 100 ms)."""


class _HeapTrimmer:
    """One thread per process that calls glibc's ``malloc_trim`` every ``TRIM_EVERY_S``
    while any block under it runs (tasks packed on a worker share it, and a backend's own
    block inside a task: gptqmodel's pool threads free each fitted layer's tensors into
    glibc's per-thread heaps, which keep them: its fit from the checkpoint of a 2.09 GB
    model held 2.4 GB of anonymous memory, freed but never returned).

    torch's CPU tensors come from glibc's heap (under its dynamic mmap threshold), whose freed
    chunks stay resident: a job's RSS rose with every transient it ever freed. The 340 MB
    model's nf4 job peaked 140-200 MiB above what it held, varying from run to run, and its
    nanny counts that; trimmed, within 20-60 MiB (benchmarks/slot_memory.py). The trim costs
    about a millisecond a time."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._users = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> None:
        import threading

        with self._lock:
            self._users += 1
            if self._users == 1 and malloc_trim() is not None:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(self._stop,),
                                                name="quantdask-heap-trim", daemon=True)
                self._thread.start()

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._users -= 1
            thread, last = self._thread, self._users == 0
            if last:
                self._stop.set()
                self._thread = None
        if last and thread is not None:
            thread.join()
            trim = malloc_trim()
            if trim is not None:
                trim(0)  # what the block freed after the thread's last trim

    @staticmethod
    def _run(stop) -> None:
        trim = malloc_trim()
        while trim is not None and not stop.wait(TRIM_EVERY_S):
            trim(0)


def malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library is not glibc."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


heap_trimmed = _HeapTrimmer()
"""``with heap_trimmed:`` hands the freed heap back to the OS while the block runs (see
``_HeapTrimmer``)."""
