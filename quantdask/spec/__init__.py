"""Deprecated: the sweep-file model moved to :mod:`quantdask.sweepfile`.

``import quantdask.spec.gates`` and the other ``quantdask.spec.<module>`` imports still work for
one release: each name is the same module object as ``quantdask.sweepfile.<module>``, so classes
and functions compare equal and ``isinstance`` holds. Importing this package warns once.
"""

from __future__ import annotations

import importlib
import sys
import warnings

MOVED_TO = "quantdask.sweepfile"
MODULES = ("fields", "gates", "model", "search", "settings", "speed", "sweep", "sweep_file",
           "tasks", "text_source")

warnings.warn("quantdask.spec is now quantdask.sweepfile; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)

for _name in MODULES:
    _module = importlib.import_module(f"{MOVED_TO}.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _module
    globals()[_name] = _module
