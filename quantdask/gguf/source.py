"""llama.cpp's converter and gguf-py, from the same source as the runtime: the sdist of the
pinned llama-cpp-python vendors llama.cpp whole, but its wheel ships neither, so
``install_converter`` (``quantdask gguf-setup``; ``make test`` runs it) extracts them from the
sdist into a folder of their own, once. Nothing is downloaded at run time."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
"""The llama.cpp that llama-cpp-python 0.3.36 vendors (its CHANGELOG)."""

ENV = "QUANTDASK_LLAMA_CPP"
"""Where the converter's folder is (default: under the user's data folder)."""
EXTRACTED = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")
INSTALL = "quantdask gguf-setup (after pip install 'quantdask[gguf]')"


def converter_dir() -> Path:
    """The folder holding ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return data / "quantdask" / f"llama.cpp-{LLAMA_CPP_COMMIT[:7]}"


def missing_converter() -> str | None:
    """Why the converter cannot run here, or None."""
    folder = converter_dir()
    if not (folder / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp's converter is not at {folder}; run {INSTALL}"
    return None


def install_converter(sdist: str | os.PathLike | None = None) -> Path:
    """Extract the converter from llama-cpp-python's sdist (``sdist``, else ``pip download``
    of the pinned one, its sha256 checked) into :func:`converter_dir`; a no-op when there."""
    folder = converter_dir()
    if missing_converter() is None:
        return folder
    with tempfile.TemporaryDirectory(prefix="quantdask-llama-cpp-") as scratch:
        if sdist is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                            "-d", scratch], check=True)
            sdist = next(Path(scratch).glob("llama_cpp_python-*.tar.gz"))
        digest = hashlib.sha256(Path(sdist).read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{sdist}: sha256 {digest}, not the pinned {SDIST_SHA256}")
        root = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        staged = Path(scratch) / "staged"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(root)
                       and m.name[len(root):].split("/")[0] in EXTRACTED]
            archive.extractall(staged, members=members, filter="data")
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.move(str(staged / root), folder)
    (folder / "COMMIT").write_text(LLAMA_CPP_COMMIT + "\n")
    return folder


def gguf_module():
    """The gguf-py of the pinned llama.cpp (PyPI's ``gguf`` lags its converter), loaded as the
    package ``gguf`` from its own folder. Its parent never joins ``sys.path``: gguf-py's folder
    also holds a ``tests`` package, which would shadow the caller's (a worker then fails to
    unpickle a function of a ``tests`` module)."""
    import importlib.util

    package = (converter_dir() / "gguf-py" / "gguf").resolve()
    loaded = sys.modules.get("gguf")
    if loaded is None:
        spec = importlib.util.spec_from_file_location(
            "gguf", package / "__init__.py", submodule_search_locations=[str(package)])
        if spec is None or spec.loader is None:
            raise ImportError(f"no gguf package at {package}")
        loaded = importlib.util.module_from_spec(spec)
        sys.modules["gguf"] = loaded
        try:
            spec.loader.exec_module(loaded)
        except BaseException:
            del sys.modules["gguf"]
            raise
    if not str(Path(str(loaded.__file__)).resolve()).startswith(str(package)):
        raise ImportError(f"gguf was imported from {loaded.__file__}, not the pinned {package}")
    return loaded


_READERS: OrderedDict[tuple, Any] = OrderedDict()
_READERS_LOCK = threading.Lock()


def read_gguf(path: str | os.PathLike):
    """gguf-py's ``GGUFReader`` of the file at ``path``, kept for the next caller (the three
    latest files, by path, size and time): reading a header parses every vocabulary string in
    Python (3.3 s for SmolLM2's 49,152), and a GGUF job reads its converted file's and its own
    file's several times. Read only: the tensors are a memory map of the file."""
    found = Path(path).resolve()
    stat = found.stat()
    key = (str(found), stat.st_size, stat.st_mtime_ns)
    with _READERS_LOCK:
        if key in _READERS:
            _READERS.move_to_end(key)
            return _READERS[key]
    reader = gguf_module().GGUFReader(str(found))
    with _READERS_LOCK:
        _READERS[key] = reader
        while len(_READERS) > 3:
            _READERS.popitem(last=False)
    return reader


def forget_readers() -> None:
    """Let the kept readers go: a header's parsed vocabulary is Python objects, per token,
    about 200 MiB for a 151,936-token vocabulary, that stayed in the worker, which its nanny
    holds against the slot's limit, for the next job (a later job parses its files again)."""
    with _READERS_LOCK:
        _READERS.clear()
