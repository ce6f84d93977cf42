"""A Python here that sees only what the lent GPU machine will have: its image's packages and
the GPU bundle (scripts/gpu_bundle.py). Every other installed distribution's modules are hidden
(``import`` and ``importlib.util.find_spec`` find nothing, as there), in this process's children
too: a ``sitecustomize`` on ``PYTHONPATH`` hides them at every interpreter's start."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from gpu_bundle import BUNDLE, LENT_PACKAGES, canonical  # noqa: E402

SITECUSTOMIZE = '''\
import sys

HIDDEN = frozenset({hidden!r})


class _Hidden:
    """Wraps a finder: finds nothing for a hidden top-level module."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self._finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attribute):
        return getattr(self._finder, attribute)


sys.meta_path[:] = [_Hidden(finder) for finder in sys.meta_path]
'''


def hidden_modules() -> list[str]:
    """Top-level modules here whose every distribution is neither on the lent machine nor in
    the bundle (quantdask itself travels with the tree)."""
    # The image's packages come with what they need (here, maybe other versions needing other
    # things: huggingface-hub here needs httpx2).
    there = _with_requirements(LENT_PACKAGES) | set(BUNDLE) | {"quantdask"}
    if sys.version_info < (3, 12):  # dask needs it on this older Python only, not on the 3.12
        there |= _with_requirements({"importlib-metadata"})
    return sorted(module for module, dists in importlib.metadata.packages_distributions().items()
                  if not any(canonical(d) in there for d in dists)
                  and module.isidentifier() and module not in sys.stdlib_module_names)


def _with_requirements(names: set[str]) -> set[str]:
    """``names`` and every distribution they require as installed here, transitively."""
    from packaging.requirements import Requirement

    found, todo = set(), list(names)
    while todo:
        current = canonical(todo.pop())
        if current in found:
            continue
        found.add(current)
        try:
            requires = importlib.metadata.requires(current) or ()
        except importlib.metadata.PackageNotFoundError:
            continue  # on the lent machine, not here
        todo += [Requirement(r).name for r in requires if "extra ==" not in r]
    return found


def environment(folder: Path, bundle_site: Path | None = None) -> dict[str, str]:
    """``os.environ`` for a child process that sees what the lent machine would; with
    ``bundle_site`` (an unpacked bundle) first on the path, as scripts/gpu_smoke.sh puts it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(hidden=hidden_modules()))
    path = [str(folder), *([str(bundle_site)] if bundle_site else []), str(REPO)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
