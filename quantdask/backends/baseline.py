"""The unquantized baseline every sweep includes: what size and quality are compared to."""

from __future__ import annotations

from quantdask.backends.base import Backend

BASELINE = "none"


def load_unquantized(source, options: dict, device: str):
    return source.build(device)


baseline_backend = Backend(
    name=BASELINE,
    quantize=load_unquantized,
    label=lambda options: "baseline",
    quantizes=False,
    description="The model as loaded, unquantized.",
)
