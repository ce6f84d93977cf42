"""Adaptive scaling of a cluster quantdask starts or is given: how many workers, and when to
grow and shrink (Dask's ``adapt``).

>>> Adapt.parse("1:4")
Adapt(minimum=1, maximum=4, interval_s=1.0, idle_s=10.0, target_duration_s=5.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantdask.errors import SpecError


@dataclass(frozen=True)
class Adapt:
    """Let a cluster grow while jobs wait and shrink when they are done, between ``minimum``
    and ``maximum`` workers (Dask's adaptive scaling).

    Dask asks for enough workers to finish the waiting work in about ``target_duration_s``,
    reconsiders every ``interval_s``, and retires a worker once it has wanted fewer for
    ``idle_s``. ``Adapt.parse("1:4")`` reads the CLI's ``--adapt MIN:MAX``.
    """

    minimum: int = 1
    maximum: int = 4
    interval_s: float = 1.0
    idle_s: float = 10.0
    target_duration_s: float = 5.0

    def __post_init__(self):
        for name in ("minimum", "maximum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"adapt.{name}", f"must be an integer >= 0, got {value!r}")
        if self.maximum < max(1, self.minimum):
            raise SpecError("adapt.maximum", f"must be at least the minimum and 1, got "
                                             f"{self.minimum}:{self.maximum}")
        for name in ("interval_s", "idle_s", "target_duration_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise SpecError(f"adapt.{name}", f"must be a number of seconds > 0, got "
                                                 f"{value!r}")

    @classmethod
    def parse(cls, text: str) -> Adapt:
        """``"MIN:MAX"``, as in ``--adapt 1:4``."""
        low, _, high = text.partition(":")
        try:
            counts = int(low), int(high)
        except ValueError:
            raise SpecError("adapt", f"must be MIN:MAX worker counts such as 1:4, got "
                                     f"{text!r}") from None
        return cls(*counts)

    def apply(self, cluster: Any) -> None:
        """Turn on adaptive scaling on ``cluster`` (any Dask cluster object with ``adapt``)."""
        if not hasattr(cluster, "adapt"):
            raise SpecError("adapt", f"{type(cluster).__name__} cannot scale itself; start "
                                     "workers by hand or use a cluster that can (local, SLURM)")
        cluster.adapt(minimum=self.minimum, maximum=self.maximum,
                      interval=f"{self.interval_s}s",
                      wait_count=max(1, round(self.idle_s / self.interval_s)),
                      target_duration=f"{self.target_duration_s}s")
