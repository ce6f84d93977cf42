"""A search's refinement over the cluster (``refine:``), the driver's side: whole mixes scored
by their measured KL, as EvoPress does, where the solver only adds up cells (per-unit errors do
not add at low bits).

From the solver's allocation at the main budget, each generation mutates its parent into
``offspring`` mixes (:func:`mutate`: one unit group up a format, others down until the mix fits
the budget again, in integer bytes), scores each as its own Dask task on ``windows``
calibration windows (``search.refine_task.score_mix``: in the backend's runtime where it has a
scorer, else in torch), and keeps the best, if it beats its parent by more than the standard
error of their paired, window-by-window difference. It stops after ``generations``, or at the
first generation where no offspring does.

Every scored mix is a row of the refinement frame, written as it arrives: a rerun (or a driver
killed mid-generation) regenerates the same offspring (the mutations are seeded by the
generation and the parent) and scores only those not recorded.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import polars as pl

from quantdask.backends import BackendOptions, get_backend
from quantdask.records import RefinementRow
from quantdask.run import LOG_CHANNEL
from quantdask.search.allocation import Cells, groups_of
from quantdask.search.probe_runs import Room

if TYPE_CHECKING:
    from distributed import Future

    from quantdask.search.probing import Probed, _Probing
    from quantdask.sweepfile.search import SearchSpec

log = logging.getLogger(LOG_CHANNEL)

MUTATION_TRIES = 50
"""Draws per offspring before a generation makes do with fewer (every mutation tried is a
parent's mix again, a mix already made, or none that fits)."""


@dataclass(frozen=True)
class Scored:
    """A mix and what scoring it measured."""

    formats: dict[str, str]
    bytes: int
    kl: float
    kl_se: float
    window_kl: list[float]


@dataclass(frozen=True)
class Refined:
    """A refinement's end: its best mix, the solver's it started from, the generations run
    and why it stopped."""

    best: Scored
    start: Scored
    generations: int
    stopped: str


def mix_hash(formats: Mapping[str, str]) -> str:
    """A mix's identity: its formats, canonical JSON, hashed."""
    return hashlib.sha256(json.dumps(dict(formats), sort_keys=True).encode()).hexdigest()[:16]


def mutate(parent: Mapping[str, str], cells: Cells, budget_bytes: int, rng: random.Random, *,
           ties: Sequence[Sequence[str]] = (), fixed: Mapping[str, str] | None = None
           ) -> dict[str, str] | None:
    """One offspring of ``parent`` (unit -> format): a random unit group (tied units move
    together; fixed ones never) one format up in bytes, then random others one format down
    until the mix is within ``budget_bytes`` again; None where none fits."""
    groups = groups_of(cells, ties, fixed or {})
    position = []
    for group in groups:
        labels = [label for label, _, _ in group.options]
        position.append(labels.index(parent[group.units[0]]))

    def moved(i: int, step: int) -> int | None:
        """Group ``i``'s next format in bytes (``step`` +1: up, -1: down), skipping those
        of the same bytes (formats a runtime writes alike: GGUF's fallbacks)."""
        options, at = groups[i].options, position[i]
        size = options[at][2]
        found = next((j for j in (range(at + 1, len(options)) if step > 0
                                  else range(at - 1, -1, -1))
                      if options[j][2] != size), None)
        return found

    up = [i for i in range(len(groups)) if moved(i, +1) is not None]
    if not up:
        return None
    raised = rng.choice(up)
    position[raised] = moved(raised, +1)  # type: ignore[assignment]

    def size() -> int:
        return sum(group.options[p][2] for group, p in zip(groups, position, strict=True))

    while size() > budget_bytes:
        down = [i for i in range(len(groups)) if i != raised and moved(i, -1) is not None]
        if not down:
            return None
        lowered = rng.choice(down)
        position[lowered] = moved(lowered, -1)  # type: ignore[assignment]
    return {unit: group.options[p][0] for group, p in zip(groups, position, strict=True)
            for unit in group.units}


def mix_bytes(formats: Mapping[str, str], cells: Cells) -> int:
    """The units' stored bytes in ``formats``."""
    return sum(cells[unit][label][1] for unit, label in formats.items())


def paired(child: Sequence[float], parent: Sequence[float]) -> tuple[float, float]:
    """The mean window-by-window difference child - parent, and its standard error."""
    diffs = [c - p for c, p in zip(child, parent, strict=True)]
    mean = sum(diffs) / len(diffs)
    if len(diffs) < 2:
        return mean, math.inf
    variance = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return mean, math.sqrt(variance / len(diffs))


def refine(run: _Probing, probed: Probed, start: dict[str, str], budget_bytes: int,
           ties: Sequence[Sequence[str]], fixed: Mapping[str, str]) -> Refined | None:
    """Refine ``start`` within ``budget_bytes`` (see the module); None when ``watch.stop``
    ended it."""
    from quantdask.search.identity import probe_settings
    from quantdask.search.probe_task import search_reference

    search = run.search
    settings = search.refinement()
    assert settings is not None
    windows = probe_settings(run.sweep, search, settings.windows)
    key = refine_key(probed, settings, budget_bytes, start)
    done = _recorded(run, key)
    reference = None

    def scored(generation: int, mixes: list[dict[str, str]], parent: Scored | None
               ) -> list[Scored] | None:
        nonlocal reference
        missing = [(i, m) for i, m in enumerate(mixes) if (generation, mix_hash(m)) not in done]
        if missing and reference is None:
            reference = run.one("refinement reference", search_reference, run.model, windows,
                                windows.read_text())
            if reference is None:
                return None
        if missing and reference is not None and not _score(
                run, probed, key, generation, missing, parent, reference, done):
            return None
        return [_scored(done[(generation, mix_hash(m))], probed) for m in mixes]

    first = scored(0, [start], None)
    if first is None:
        return None
    parent, best = first[0], first[0]
    for generation in range(1, settings.generations + 1):
        rng = random.Random(f"{settings.seed}-{generation}-{mix_hash(parent.formats)}")
        offspring = _offspring(parent.formats, probed.cells, budget_bytes, rng,
                               settings.offspring, ties, fixed)
        if not offspring:
            return Refined(best, first[0], generation - 1, "no mutation fits the budget")
        children = scored(generation, offspring, parent)
        if children is None:
            return None
        child = min(children, key=lambda c: c.kl)
        gain, se = paired(child.window_kl, parent.window_kl)
        log.info("search %s: refinement generation %d: best offspring KL %.5g against its "
                 "parent's %.5g (%+.3g ± %.2g)", search.name, generation, child.kl, parent.kl,
                 gain, se)
        if not -gain > se:
            return Refined(best, first[0], generation,
                           f"no offspring of generation {generation} beat its parent beyond "
                           "the standard error")
        parent = best = child
    return Refined(best, first[0], settings.generations, f"{settings.generations} generations")


def refine_key(probed: Probed, settings: Any, budget_bytes: int, start: Mapping[str, str]
               ) -> str:
    """What a refinement's rows depend on: the cells' key, its windows and seed, the budget
    and the mix it starts from."""
    identity = [probed.key, settings.windows, settings.seed, budget_bytes, mix_hash(start)]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]


def _offspring(parent: dict[str, str], cells: Cells, budget_bytes: int, rng: random.Random,
               count: int, ties, fixed) -> list[dict[str, str]]:
    made: list[dict[str, str]] = []
    seen = {mix_hash(parent)}
    for _ in range(count * MUTATION_TRIES):
        if len(made) == count:
            break
        child = mutate(parent, cells, budget_bytes, rng, ties=ties, fixed=fixed)
        if child is not None and mix_hash(child) not in seen:
            seen.add(mix_hash(child))
            made.append(child)
    return made


def _score(run: _Probing, probed: Probed, key: str, generation: int,
           mixes: list[tuple[int, dict[str, str]]], parent: Scored | None, reference: Future,
           done: dict) -> bool:
    """Score ``mixes`` ((candidate index, formats)) of ``generation`` as tasks, each row
    written as it arrives; False when stopped."""
    from quantdask.search.refine_task import score_mix

    search, formats = run.search, run.search.format_options()

    def mix_args(room: Room, attempt: int, mix: dict[str, str]) -> tuple:
        return (run.model, reference, room.batch_size, search.backend, formats, mix,
                probed.units, mix_options(search, probed.units, mix),
                run.faults(attempt, "refine"))

    tasks = [run.task(f"refinement generation {generation}, offspring {index}", score_mix,
                      functools.partial(mix_args, mix=mix)) for index, mix in mixes]
    for task_index, future in run.run(tasks, f"refine-g{generation}"):
        index, mix = mixes[task_index]
        found = future.result()
        gain, se = paired(found.window_kl, parent.window_kl) if parent else (0.0, 0.0)
        row = RefinementRow(
            search=search.name, search_key=key, model=run.model.label, generation=generation,
            candidate=index + (parent is not None), parent=mix_hash(parent.formats) if parent
            else "", mix=mix_hash(mix), formats=json.dumps(mix, sort_keys=True),
            bytes=mix_bytes(mix, probed.cells) + probed.rest_bytes, kl=found.kl,
            kl_se=found.kl_se, kl_vs_parent=gain, kl_vs_parent_se=se,
            window_kl=json.dumps(found.window_kl), measured_in=found.measured_in,
            worker=found.worker, seconds=found.seconds)
        run.store.write_rows("refinement", f"{search.name}-{key}-g{generation}-{row.mix}",
                             [row])
        done[(generation, row.mix)] = dataclasses.asdict(row)
    return not run.watch.stop.is_set()


def _recorded(run: _Probing, key: str) -> dict[tuple[int, str], dict]:
    frame = run.store.read("refinement").filter((pl.col("search") == run.search.name)
                                                 & (pl.col("search_key") == key))
    return {(row["generation"], row["mix"]): row for row in frame.iter_rows(named=True)}


def _scored(row: dict, probed: Probed) -> Scored:
    formats = json.loads(row["formats"])
    return Scored(formats, mix_bytes(formats, probed.cells), row["kl"], row["kl_se"],
                  json.loads(row["window_kl"]))


def mix_options(search: SearchSpec, units: dict[str, tuple[str, ...]],
                chosen: dict[str, str]) -> BackendOptions:
    """A mix as the backend's options: those of its most used quantized format, and every
    unit's members given their own format (``modules``; null where kept)."""
    formats = search.format_options()
    used = [label for label in chosen.values() if formats[label] is not None]
    base = formats[max(sorted(set(used)), key=used.count)] if used else None
    base = base or next(o for o in formats.values() if o is not None)
    backend = get_backend(search.backend)
    modules: dict[str, Any] = {}
    for unit, label in chosen.items():
        own = formats[label]
        for module in units[unit]:
            modules[module] = None if own is None else {
                key: own.get(key) for key in backend.module_keys}
    return backend.normalize({**base.as_dict(), "modules": modules}, f"searches.{search.name}")
