"""A sweep's mixed-precision searches (``searches:``): which model, backend and formats, the
units the formats are chosen for, the budget, and what to verify.

>>> SearchSpec(name="mix", model="demo", backend="hqq", base={"group_size": 64},
...            formats={"b2": {"bits": 2}, "b4": {"bits": 4}, "keep": None},
...            budget={"bits_per_weight": 3.5}).budgets()
(3.5,)

Units are named after the model's modules: ``granularity: linear`` makes each linear of the
decoder layers a unit (``model.layers.3.mlp.down_proj``), ``block`` each decoder layer's linears
together (``model.layers.3``). ``tie`` lists module names (their last part) that take one
format together within each layer (``[q_proj, k_proj, v_proj]``; left out, those the backend's
runtime fuses, GPTQ's q/k/v and gate/up for vLLM; ``[]`` ties none); ``fixed`` gives units a
format: by full unit name, or by the last part of the name for every layer (``down_proj: b8``).
The budget is the whole model's stored size: ``bits_per_weight`` of all its parameters, or
``bytes``. ``frontier`` adds budgets (bits per weight); ``candidates`` is how many allocations
per budget are verified as jobs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from quantdask.backends import BackendOptions, get_backend, searchable_backends
from quantdask.backends.capabilities import Searchable
from quantdask.errors import SpecError
from quantdask.records import SearchedFor
from quantdask.sweepfile.fields import NAME, keyed, positive_int, require

KEEP = "keep"
"""The format label that keeps a unit in full precision (its value in ``formats`` is null)."""

ALL_UNITS = "(all)"
"""The sensitivity frame's unit for a whole format: every unit in it at once. Its joint KL
beside the sum of the format's cells shows how far the additive prediction holds (at low bits
the units' errors add up to more than their sum)."""

GRANULARITIES = ("linear", "block")
SOLVERS = ("auto", "milp", "fallback")
SENSITIVITIES = ("auto", "kl", "fisher")


@dataclass(frozen=True)
class Refine:
    """A search's refinement (``refine:``): from the solver's allocation at the main budget,
    ``generations`` rounds of ``offspring`` mutated mixes, each scored by its whole-model KL
    on ``windows`` calibration windows (never the eval's); ``seed`` draws the mutations."""

    generations: int = 4
    offspring: int = 8
    windows: int = 16
    seed: int = 0

    def __post_init__(self):
        for name in ("generations", "offspring", "windows"):
            positive_int(f"refine.{name}", getattr(self, name))
        require("refine.seed", self.seed, int, "an integer")


@dataclass(frozen=True)
class SearchSpec:
    """One search (see the module). ``formats`` maps a label to the options it adds to
    ``base`` (null: kept in full precision); each is checked as the backend checks a config."""

    name: str
    model: str
    backend: str
    formats: dict[str, dict | None]
    budget: dict[str, float]
    base: dict[str, Any] = field(default_factory=dict)
    granularity: str = "linear"
    tie: list[list[str]] | None = None  # None: the backend's runtime ties (Searchable.ties)
    fixed: dict[str, str] = field(default_factory=dict)
    frontier: list[float] = field(default_factory=list)
    candidates: int = 1
    windows: int = 16  # calibration windows each probe measures (from the calibration text)
    cells_per_task: int = 16  # (unit, format) cells one probe task measures
    solver: str = "auto"
    # How cells are scored: kl (each measured with its unit swapped in), fisher (one backward
    # pass per calibration batch, search.fisher) or auto (fisher where kl would cost more than
    # AUTO_KL_SHARE of the search's work; search.pricing)
    sensitivity: str = "auto"
    fisher_tokens: int = 1024  # calibration positions a Fisher capture keeps, over all batches
    refine: dict[str, Any] | None = None  # Refine's fields
    _options: dict[str, BackendOptions | None] = field(default_factory=dict, init=False,
                                                       repr=False, compare=False)
    _refine: Refine | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not (isinstance(self.name, str) and NAME.match(self.name)):
            raise SpecError("name", f"must be letters, digits, '.', '_' or '-', got {self.name!r}")
        require("model", self.model, str, "the name of one of the sweep's models")
        backend = get_backend(self.backend, "backend")
        refusal = backend.refusal(Searchable)
        if refusal is not None:
            raise SpecError("backend", f"{refusal}; backends that can: "
                                       f"{', '.join(searchable_backends())}")
        require("base", self.base, dict, "a mapping of the backend's options")
        require("formats", self.formats, dict, "a mapping of label to options (null: keep)")
        if len([f for f in self.formats.values() if f is not None]) < 1:
            raise SpecError("formats", "give at least one quantized format, e.g. b4: {bits: 4}")
        options: dict[str, BackendOptions | None] = {}
        for label, extra in self.formats.items():
            if not (isinstance(label, str) and NAME.match(label)):
                raise SpecError(f"formats.{label}", "a format's label must be letters, digits, "
                                                    "'.', '_' or '-'")
            if extra is None:
                options[label] = None
                continue
            require(f"formats.{label}", extra, dict, "a mapping of options, or null to keep")
            for key in extra:
                if key not in backend.module_keys:  # one model holds one value of the others
                    raise SpecError(f"formats.{label}.{key}", f"a format sets only what each "
                                    f"module may have of its own: {', '.join(backend.module_keys)}"
                                    f"; put {key} in base")
            options[label] = backend.normalize({**self.base, **extra}, f"formats.{label}")
        object.__setattr__(self, "_options", options)
        if self.granularity not in GRANULARITIES:
            raise SpecError("granularity", f"must be {' or '.join(GRANULARITIES)}, got "
                                           f"{self.granularity!r}")
        self._check_tie_and_fixed()
        self._check_budgets()
        positive_int("candidates", self.candidates)
        positive_int("windows", self.windows)
        positive_int("cells_per_task", self.cells_per_task)
        if self.solver not in SOLVERS:
            raise SpecError("solver", f"must be {' or '.join(SOLVERS)}, got {self.solver!r}")
        if self.sensitivity not in SENSITIVITIES:
            raise SpecError("sensitivity", f"must be {', '.join(SENSITIVITIES)}, got "
                                           f"{self.sensitivity!r}")
        positive_int("fisher_tokens", self.fisher_tokens)
        self._check_refine(backend)

    def _check_refine(self, backend) -> None:
        if self.refine is None:
            return
        keyed("refine", self.refine, ("generations", "offspring", "windows", "seed"),
              "a mapping: {generations: G, offspring: N, windows: W}")
        why = backend.has(Searchable).refine_why
        if why is not None:
            raise SpecError("refine", f"{self.backend} has no runtime scorer for a whole mix: "
                                      f"{why}; drop refine")
        if any(o is not None and getattr(o, "imatrix", None) for o in self._options.values()):
            raise SpecError("refine", "offspring are scored without an importance matrix, as "
                                      "the probes are: drop imatrix from the formats, or refine")
        object.__setattr__(self, "_refine", Refine(**self.refine))

    def refinement(self) -> Refine | None:
        """The refinement's settings (None: no ``refine``)."""
        return self._refine

    def _check_tie_and_fixed(self) -> None:
        if self.tie is not None:
            self._check_tie()
        require("fixed", self.fixed, dict, "a mapping of unit name to format label")
        for unit, label in self.fixed.items():
            if label not in self.formats:
                raise SpecError(f"fixed.{unit}", f"{label!r} is not one of the formats "
                                                 f"({', '.join(self.formats)})")

    def _check_tie(self) -> None:
        require("tie", self.tie, list, "a list of lists of module names ([] ties none)")
        for i, names in enumerate(self.tie or []):
            require(f"tie[{i}]", names, list, "a list of module names (q_proj, k_proj)")
            if len(names) < 2 or not all(isinstance(n, str) and n for n in names):
                raise SpecError(f"tie[{i}]", f"must name two or more modules, got {names!r}")
        if self.tie and self.granularity != "linear":
            raise SpecError("tie", "ties units of granularity: linear; a block is one unit")

    def ties(self) -> list[list[str]]:
        """The module names tied within each layer: ``tie`` as given, or, left out, those
        the backend's runtime requires tied (``Searchable.ties``: the linears it fuses)."""
        if self.tie is not None:
            return self.tie
        searchable = get_backend(self.backend).has(Searchable)
        return [list(names) for names in (searchable.ties if searchable else ())]

    def _check_budgets(self) -> None:
        keyed("budget", self.budget, ("bits_per_weight", "bytes"),
              "a mapping: {bits_per_weight: B} or {bytes: N}")
        if len(self.budget) != 1:
            raise SpecError("budget", "give one of bits_per_weight or bytes")
        [(kind, value)] = self.budget.items()
        require(f"budget.{kind}", value, (int, float), "a positive number")
        if not (value > 0 and math.isfinite(value)):
            raise SpecError(f"budget.{kind}", f"must be a positive number, got {value!r}")
        require("frontier", self.frontier, list, "a list of budgets in bits per weight")
        for i, bits in enumerate(self.frontier):
            require(f"frontier[{i}]", bits, (int, float), "bits per weight")
            if not (bits > 0 and math.isfinite(bits)):
                raise SpecError(f"frontier[{i}]", f"must be a positive number, got {bits!r}")

    def describe(self) -> str:
        """One line for ``quantdask plan``: what the search probes and verifies."""
        [(kind, value)] = self.budget.items()
        budget = f"{value:,} bytes" if kind == "bytes" else f"{value:g} bits per weight"
        if self.frontier:
            budget += f" (frontier: {', '.join(f'{b:g}' for b in self.frontier)})"
        return (f"search {self.name}: {self.model}, {self.backend} formats "
                f"{', '.join(self.formats)} per {self.granularity} unit, on {self.windows} "
                f"calibration windows; budget {budget}, {self.candidates} candidate(s) each, "
                "beside each uniform format: probed when the sweep runs, its jobs made from "
                "the probes")

    def format_options(self) -> dict[str, BackendOptions | None]:
        """Each format's completed options (None: kept in full precision)."""
        return dict(self._options)

    def budgets(self) -> tuple[float, ...]:
        """The budgets in bits per weight (the main one first; a bytes budget is converted by
        the driver, which knows the parameter count)."""
        main = self.budget.get("bits_per_weight")
        rest = tuple(float(b) for b in self.frontier if b != main)
        return ((float(main),) if main is not None else ()) + rest

    def ties_in(self, units: Iterable[str]) -> list[list[str]]:
        """The tied groups among ``units`` (linear units): per layer, those whose last name
        part is in one ``tie`` list."""
        groups: dict[tuple[str, int], list[str]] = {}
        for unit in units:
            layer, _, last = unit.rpartition(".")
            for i, names in enumerate(self.ties()):
                if last in names:
                    groups.setdefault((layer, i), []).append(unit)
        return [group for group in groups.values() if len(group) > 1]

    def fixed_in(self, units: Iterable[str]) -> dict[str, str]:
        """The fixed format of each of ``units`` a ``fixed`` entry names (by full name, or
        by its last part), refused when an entry names none of them."""
        units = list(units)
        found: dict[str, str] = {}
        for pattern, label in self.fixed.items():
            ending = re.compile(rf"(^|\.){re.escape(pattern)}$")
            named = [u for u in units if ending.search(u)]
            if not named:
                raise SpecError(f"fixed.{pattern}", f"names no unit of {self.model} "
                                                    f"(units look like {units[0]!r})")
            found.update(dict.fromkeys(named, label))
        return found


@dataclass(frozen=True)
class SearchRole:
    """What a search made a job for (the results' ``search`` columns): ``role`` is
    ``mixed`` (a candidate at one of its budgets), ``equal-bytes`` (the allocation re-solved
    at a uniform config's bytes) or ``uniform`` (one format everywhere); ``candidate`` its
    rank among its budget's (1: the best); the predicted KL (the sum of its cells') and
    stored bytes."""

    search: str
    role: str
    candidate: int
    budget_bits_per_weight: float
    predicted_kl: float
    predicted_bytes: int
    predicted_in: str | None = None  # how (``search.agreement.predicted_in``)

    @classmethod
    def column_names(cls) -> tuple[str, ...]:
        """The results columns it fills."""
        return tuple(cls("", "", 0, 0.0, 0.0, 0).columns())

    def columns(self) -> dict[str, Any]:
        return SearchedFor(self.search, self.role, self.candidate, self.budget_bits_per_weight,
                           self.predicted_kl, self.predicted_bytes, self.predicted_in).columns()


def check_searches(searches: list[SearchSpec], models: Iterable[str],
                   calibration: Any) -> None:
    """What a sweep's searches need from the rest of it: known models, distinct names, a
    calibration block (the probes' windows come from its text)."""
    names = list(models)
    seen: set[str] = set()
    for i, search in enumerate(searches):
        require(f"searches[{i}]", search, SearchSpec, "a search")
        if search.model not in names:
            raise SpecError(f"searches[{i}].model", f"{search.model!r} is none of the sweep's "
                                                    f"models ({', '.join(names)})")
        if search.name in seen:
            raise SpecError(f"searches[{i}].name", f"two searches are named {search.name!r}")
        seen.add(search.name)
        if calibration is None:
            raise SpecError(f"searches[{i}]", "a search probes on calibration windows: add a "
                                              "calibration block (calibration: {text: ...})")
