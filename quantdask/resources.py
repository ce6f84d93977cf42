"""The files that ship with quantdask: notebooks, the report template and the demo.

An installed wheel holds them inside the package: ``quantdask/notebooks``, ``quantdask/data``
(the demo model, its eval text, the demo sweep) and ``quantdask/report/template``. A source
checkout (an editable install, or the checkout on ``PYTHONPATH``) keeps ``notebooks/`` and
``data/`` at the repository's top level, beside the package (pyproject.toml maps them into the
wheel). Both are found from ``importlib.resources.files("quantdask")``.

The anchor is the regular package ``quantdask``, not ``quantdask.notebooks``: those folders have
no ``__init__.py``, and setuptools' editable finder cannot import such a package mapped outside
its parent's folder, so ``files("quantdask.notebooks")`` works in a wheel only.

>>> demo_sweep().name
'demo_sweep.yaml'
"""

from __future__ import annotations

import atexit
import contextlib
import functools
from importlib.resources import as_file, files
from pathlib import Path

_extracted = contextlib.ExitStack()
atexit.register(_extracted.close)


@functools.cache
def _on_disk(name: str) -> Path:
    """A shipped folder as a real directory: models, notebooks and templates are read by
    libraries that take file-system paths."""
    package = files("quantdask")
    if isinstance(package, Path):  # the package is files on disk (every pip install)
        shipped = package.resolve() / name
        if shipped.is_dir():
            return shipped
        # A source checkout: the folder is at the repository's top level, beside the package.
        root = shipped.parent.parent
        if (root / "pyproject.toml").is_file() and (root / name).is_dir():
            return root / name
        return shipped  # missing: where an install puts it, for the caller's message
    # Imported from an archive (a zip): extracted once for the process (directories need
    # Python 3.12+).
    return _extracted.enter_context(as_file(package / name))


def notebooks_dir() -> Path:
    """The folder of the notebooks (quickstart, report, scaling, memory, quality)."""
    return _on_disk("notebooks")


def report_template_dir() -> Path:
    """The nbconvert template of the HTML reports."""
    return _on_disk("report/template")


def data_dir() -> Path:
    """The folder of the demo's data: the demo model, its eval text and the demo sweep."""
    return _on_disk("data")


def demo_model_dir() -> Path:
    """The demo model (safetensors, config and tokenizer)."""
    return data_dir() / "demo-model"


def demo_eval_text() -> Path:
    """The demo's eval text."""
    return data_dir() / "demo" / "eval.txt"


def demo_tasks_dir() -> Path:
    """The demo's lm-eval tasks (``demo_facts``: one folder per task)."""
    return data_dir() / "tasks"


def demo_sweep() -> Path:
    """The demo sweep (its paths are relative to the file)."""
    return data_dir() / "demo_sweep.yaml"
