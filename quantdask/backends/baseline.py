"""The unquantized baseline every sweep includes: what size and quality are compared to."""

from __future__ import annotations

from quantdask.backends.base import UNQUANTIZED, Backend, BackendOptions
from quantdask.backends.capabilities import Lacks, Savable, Searchable
from quantdask.words import BASELINE  # its name, re-exported here


def load_unquantized(source, options: BackendOptions, device: str):
    return source.build(device)


baseline_backend = Backend(
    name=BASELINE,
    quantize=load_unquantized,
    options=BackendOptions,  # none
    label=lambda options: "baseline",
    sizing=UNQUANTIZED,
    capabilities=(Savable(), Lacks(Searchable, "the baseline quantizes nothing")),
    description="The model as loaded, unquantized.",
)
