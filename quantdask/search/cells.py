"""What a search's worker tasks bring back, typed: a probed (unit, format) cell (a row of the
sensitivity frame), a probed chunk of them, and the model's units."""

from __future__ import annotations

import dataclasses

from quantdask.records import SensitivityRow


@dataclasses.dataclass(frozen=True)
class ProbedCell:
    """One (unit, format) cell as a probe task measured it: its KL against the reference and
    standard error, the bytes the unit stores in that format and the seconds it took; or why
    the backend cannot apply the format to the unit (``error``, no figures)."""

    unit: str
    format: str
    layer: int | None  # its decoder layer (-1: the whole model, the embeddings, the rest)
    params: int  # weights in the unit
    worker: str | None
    kl: float | None = None
    kl_se: float | None = None
    bytes: int | None = None
    error: str | None = None
    seconds: float = 0.0
    method: str = "kl"  # or fisher: then ``score`` is the Fisher estimate and ``kl`` the fit
    score: float | None = None

    @classmethod
    def rest(cls, rest_bytes: int) -> ProbedCell:
        """The bytes no allocation changes (unit "", format "rest")."""
        return cls(unit="", format="rest", layer=-1, params=0, worker=None, kl=0.0, kl_se=0.0,
                   bytes=rest_bytes)

    def row(self, search: str, search_key: str, model: str) -> SensitivityRow:
        """Its row of the sensitivity frame, with the search's columns."""
        return SensitivityRow(search=search, search_key=search_key, model=model,
                              **dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class ProbedChunk:
    """A probe task's result: its cells, and the bytes the model stores outside the units."""

    cells: list[ProbedCell]
    rest_bytes: int


@dataclasses.dataclass(frozen=True)
class SearchUnits:
    """A model's units (name -> its linear modules), its parameter count, and each member's
    (weights, in + out widths) for pricing (``search.pricing``)."""

    units: dict[str, tuple[str, ...]]
    param_count: int
    shapes: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    layers: int = 0  # the model's decoder layers
