"""The unquantized baseline every sweep includes: what size and quality are compared to."""

from __future__ import annotations

from quantdask.backends.base import Backend, BackendOptions
from quantdask.words import BASELINE  # its name, re-exported here


def load_unquantized(source, options: BackendOptions, device: str):
    return source.build(device)


baseline_backend = Backend(
    name=BASELINE,
    unsearchable="the baseline quantizes nothing",
    quantize=load_unquantized,
    options=BackendOptions,  # none
    label=lambda options: "baseline",
    quantizes=False,
    description="The model as loaded, unquantized.",
)
