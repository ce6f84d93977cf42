"""The allocator of a mixed-precision search: one format per unit, the least predicted KL
within a byte budget.

Each (unit, format) cell carries the KL its format alone adds to the model (measured by a
probe) and the unit's stored bytes in that format. The predicted KL of an allocation is the sum
of its cells' (the additive model the search verifies afterwards). Choosing one format per unit
to minimise it under the budget is a multiple-choice knapsack:

- ``milp``: exact, through scipy's ``milp`` (HiGHS, the ``search`` extra). Further candidates
  are exact too: each solve excludes the allocations found before it.
- ``fallback``: needs nothing beyond the standard library. Small problems are solved exactly by
  branch and bound; larger ones by the knapsack's convex-hull greedy (its linear relaxation, so
  at most one unit short of the optimum), then single-unit improvements within what is left of
  the budget. Its further candidates are the best single-unit changes of its first.

Ties (units that must share a format, q/k/v say) become one unit whose cells are the sums of
their members'; fixed units keep their format. The budget is checked in integers on the result:
no allocation returned exceeds it.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from quantdask.errors import SpecError

Cells = Mapping[str, Mapping[str, tuple[float, int]]]
"""unit -> format -> (KL added, stored bytes); a format a unit cannot take is left out."""

BRANCH_AND_BOUND_GROUPS = 64
"""Up to this many groups (tied units count once), the fallback searches by branch and bound
from its greedy allocation; above it, the greedy's result stands (its gap to the optimum is
at most one group's part, small among so many)."""

BRANCH_AND_BOUND_NODES = 50_000
"""The branch and bound stops after this many nodes with the best it has (never worse than
the greedy's)."""


@dataclass(frozen=True)
class Allocation:
    """One format per unit, with its predicted KL (the sum of its cells') and stored bytes."""

    formats: dict[str, str]
    kl: float
    bytes: int
    budget_bytes: int
    solver: str
    rank: int  # 1 for the best found, 2 for the next, ...


@dataclass(frozen=True)
class _Group:
    """Units that take one format together, and each format's summed (KL, bytes)."""

    units: tuple[str, ...]
    options: tuple[tuple[str, float, int], ...]  # (format, kl, bytes), fewest bytes first


def scipy_milp_available() -> bool:
    """Whether the exact solver (scipy's ``milp``) can be imported here."""
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        return False
    return True


def allocate(cells: Cells, budget_bytes: int, *, ties: Iterable[Sequence[str]] = (),
             fixed: Mapping[str, str] | None = None, candidates: int = 1,
             solver: str = "auto") -> list[Allocation]:
    """Up to ``candidates`` allocations of least predicted KL whose bytes stay within
    ``budget_bytes``, best first (fewer when fewer exist). ``solver`` is ``"milp"``,
    ``"fallback"`` or ``"auto"`` (milp where scipy is installed)."""
    if solver not in ("auto", "milp", "fallback"):
        raise SpecError("solver", f"must be auto, milp or fallback, got {solver!r}")
    if candidates < 1:
        raise SpecError("candidates", f"must be at least 1, got {candidates}")
    groups = groups_of(cells, ties, fixed or {})
    least = sum(group.options[0][2] for group in groups)
    if least > budget_bytes:
        raise SpecError("budget", f"{budget_bytes:,} bytes is below the smallest allocation "
                                  f"({least:,} bytes, every unit at its smallest format); "
                                  "raise the budget or offer smaller formats")
    if solver == "auto":
        solver = "milp" if scipy_milp_available() else "fallback"
    if solver == "milp":
        picks = _solve_milp(groups, budget_bytes, candidates)
    else:
        picks = _solve_fallback(groups, budget_bytes, candidates)
    return [_allocation(groups, pick, budget_bytes, solver, rank)
            for rank, pick in enumerate(picks, start=1)]


def groups_of(cells: Cells, ties: Iterable[Sequence[str]], fixed: Mapping[str, str]
            ) -> list[_Group]:
    """The units merged by their ties (overlapping ties merge), each group's formats those
    every member can take (only the fixed one where a member is fixed)."""
    parent = {unit: unit for unit in cells}

    def root(unit: str) -> str:
        while parent[unit] != unit:
            parent[unit] = parent[parent[unit]]
            unit = parent[unit]
        return unit

    for i, tie in enumerate(ties):
        for unit in tie:
            if unit not in cells:
                raise SpecError(f"tie[{i}]", f"{unit!r} is no unit of this search")
        for a, b in itertools.pairwise(tie):
            parent[root(a)] = root(b)
    for unit, chosen in fixed.items():
        if chosen not in cells.get(unit, {}):
            raise SpecError(f"fixed.{unit}", f"{chosen!r} is not a format this unit can take "
                                             f"(it has {sorted(cells.get(unit, {}))})")
    members: dict[str, list[str]] = {}
    for unit in cells:
        members.setdefault(root(unit), []).append(unit)
    groups = []
    for units in members.values():
        formats = set.intersection(*(set(cells[u]) for u in units))
        pinned = {fixed[u] for u in units if u in fixed}
        if len(pinned) > 1:
            raise SpecError("fixed", f"tied units {units} are fixed to different formats "
                                     f"{sorted(pinned)}")
        formats &= pinned or formats
        if not formats:
            raise SpecError("tie", f"tied units {units} share no format they can all take")
        options = sorted(((f, sum(cells[u][f][0] for u in units),
                           sum(int(cells[u][f][1]) for u in units)) for f in formats),
                         key=lambda option: (option[2], option[1], option[0]))
        groups.append(_Group(tuple(units), tuple(options)))
    return groups


def _allocation(groups: list[_Group], pick: Sequence[int], budget: int, solver: str,
                rank: int) -> Allocation:
    formats, kl, size = {}, 0.0, 0
    for group, index in zip(groups, pick, strict=True):
        name, cell_kl, cell_bytes = group.options[index]
        formats.update(dict.fromkeys(group.units, name))
        kl, size = kl + cell_kl, size + cell_bytes
    assert size <= budget, (size, budget)  # checked in integers by each solver
    return Allocation(formats, kl, size, budget, solver, rank)


def _bytes_of(groups: list[_Group], pick: Sequence[int]) -> int:
    return sum(group.options[i][2] for group, i in zip(groups, pick, strict=True))


def _kl_of(groups: list[_Group], pick: Sequence[int]) -> float:
    return math.fsum(group.options[i][1] for group, i in zip(groups, pick, strict=True))


def _solve_milp(groups: list[_Group], budget: int, candidates: int) -> list[tuple[int, ...]]:
    """Exact, by HiGHS: binaries x[g, o], one per group, bytes within the budget; each further
    candidate excludes those found (a no-good cut)."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_array

    starts = list(itertools.accumulate((len(g.options) for g in groups), initial=0))
    n = starts[-1]
    kl = np.array([o[1] for g in groups for o in g.options])
    size = np.array([o[2] for g in groups for o in g.options], dtype=float)
    one_hot = csr_array((np.ones(n), (np.repeat(np.arange(len(groups)),
                                                [len(g.options) for g in groups]),
                                      np.arange(n))), shape=(len(groups), n))
    found: list[tuple[int, ...]] = []
    limit = float(budget)
    while len(found) < candidates:
        rows = [LinearConstraint(one_hot, 1, 1),
                LinearConstraint(size[None, :] / budget, -np.inf, limit / budget)]
        for pick in found:
            cut = np.zeros(n)
            cut[[starts[g] + i for g, i in enumerate(pick)]] = 1
            rows.append(LinearConstraint(cut[None, :], -np.inf, len(groups) - 1))
        with _highs_debug_lines_dropped():
            result = milp(kl, constraints=rows, integrality=np.ones(n), bounds=Bounds(0, 1),
                          options={"mip_rel_gap": 0, "time_limit": 120})
        if result.x is None:
            break  # no further allocation within the budget
        if result.status != 0:  # stopped by its time limit: the best it found, not proven
            raise RuntimeError(f"milp stopped before proving its allocation optimal "
                               f"({result.message}); use solver='fallback'")
        pick = tuple(int(np.argmax(result.x[starts[g]:starts[g + 1]]))
                     for g in range(len(groups)))
        excess = _bytes_of(groups, pick) - budget
        if excess > 0:  # within HiGHS' tolerance, not within the budget: tighten and again
            limit -= excess
            continue
        found.append(pick)
        limit = float(budget)
    return found


@contextlib.contextmanager
def _highs_debug_lines_dropped():
    """HiGHS 1.x (scipy 1.17) prints debugging lines to the process's standard output from
    C++ ("HighsMipSolverData::transformNewIntegerFeasibleSolution ..."), whatever ``disp``
    says: they go to /dev/null for the solve (a second or two; Python's own buffer is flushed
    first, so nothing printed before is lost)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _solve_fallback(groups: list[_Group], budget: int, candidates: int
                    ) -> list[tuple[int, ...]]:
    """Greedy then improvements; then, up to ``BRANCH_AND_BOUND_GROUPS`` groups, branch and
    bound from there (exact unless it meets ``BRANCH_AND_BOUND_NODES``)."""
    best = _improved(groups, budget, _hull_greedy(groups, budget))
    found = [best, *_single_changes(groups, budget, best, candidates - 1)]
    if len(groups) > BRANCH_AND_BOUND_GROUPS:
        return found
    return _branch_and_bound(groups, budget, candidates, found)


def _hull(group: _Group) -> list[int]:
    """The indices of the group's lower convex hull in (bytes, KL): the options worth buying,
    fewest bytes first, KL falling at a falling rate."""
    hull: list[int] = []
    for i, (_, kl, size) in enumerate(group.options):
        if hull and kl >= group.options[hull[-1]][1]:
            continue  # no better than a cheaper option
        while len(hull) >= 2:
            (_, k1, b1), (_, k2, b2) = group.options[hull[-2]], group.options[hull[-1]]
            # hull[-1] lies on or above the segment from hull[-2] to i: drop it
            if (k1 - k2) * (size - b2) <= (k2 - kl) * (b2 - b1):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def _hull_greedy(groups: list[_Group], budget: int) -> list[int]:
    """The linear relaxation's order, in integers: upgrades along each group's hull, the most
    KL saved per byte first, each taken while it fits (a group whose next upgrade does not fit
    stops there)."""
    hulls = [_hull(g) for g in groups]
    pick = [h[0] for h in hulls]
    position = [0] * len(groups)
    upgrades = []
    for g, hull in enumerate(hulls):
        for step, (a, b) in enumerate(itertools.pairwise(hull)):
            (_, ka, ba), (_, kb, bb) = groups[g].options[a], groups[g].options[b]
            upgrades.append(((ka - kb) / (bb - ba), g, step))
    upgrades.sort(key=lambda u: (-u[0], u[1], u[2]))
    left, stopped = budget - _bytes_of(groups, pick), set()
    for _, g, step in upgrades:
        if g in stopped or position[g] != step:
            continue
        here, there = hulls[g][step], hulls[g][step + 1]
        cost = groups[g].options[there][2] - groups[g].options[here][2]
        if cost > left:
            stopped.add(g)
            continue
        pick[g], position[g], left = there, step + 1, left - cost
    return pick


def _improved(groups: list[_Group], budget: int, pick: list[int]) -> tuple[int, ...]:
    """Single-unit changes, then pairs (one unit gives bytes, another takes them), each the
    best that fits, until none lowers the KL."""
    pick = list(pick)
    while True:
        left = budget - _bytes_of(groups, pick)
        move = _best_single(groups, pick, left)
        if move is None:
            move = _best_pair(groups, pick, left)
        if move is None:
            return tuple(pick)
        for g, i in move:
            pick[g] = i


def _best_single(groups: list[_Group], pick: list[int], left: int):
    best, gain = None, 0.0
    for g, group in enumerate(groups):
        _, kl, size = group.options[pick[g]]
        for i, (_, k, b) in enumerate(group.options):
            if b - size <= left and kl - k > gain + 1e-15:
                best, gain = [(g, i)], kl - k
    return best


def _best_pair(groups: list[_Group], pick: list[int], left: int, width: int = 64):
    """The best (give, take) pair among the ``width`` cheapest ways to free bytes and the
    ``width`` best upgrades per byte: bounded work on any size."""
    frees, takes = [], []
    for g, group in enumerate(groups):
        _, kl, size = group.options[pick[g]]
        for i, (_, k, b) in enumerate(group.options):
            if b < size:
                frees.append(((k - kl) / (size - b), k - kl, size - b, g, i))
            elif b > size and k < kl:
                takes.append(((kl - k) / (b - size), kl - k, b - size, g, i))
    best, gain = None, 0.0
    for _, lost, freed, g1, i1 in heapq.nsmallest(width, frees):
        for _, won, cost, g2, i2 in heapq.nlargest(width, takes):
            if g1 != g2 and cost - freed <= left and won - lost > gain + 1e-15:
                best, gain = [(g1, i1), (g2, i2)], won - lost
    return best


def _single_changes(groups: list[_Group], budget: int, best: tuple[int, ...], count: int
                    ) -> list[tuple[int, ...]]:
    """The ``count`` allocations of least KL that differ from ``best`` in one group."""
    left = budget - _bytes_of(groups, best)
    changes = []
    for g, group in enumerate(groups):
        _, kl, size = group.options[best[g]]
        for i, (_, k, b) in enumerate(group.options):
            if i != best[g] and b - size <= left:
                changes.append((k - kl, g, i))
    changes.sort()
    return [best[:g] + (i,) + best[g + 1:] for _, g, i in changes[:count]]


def _branch_and_bound(groups: list[_Group], budget: int, candidates: int,
                      seeds: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Depth first over the groups (most options first), pruned by the linear relaxation of
    the groups left; keeps the ``candidates`` best leaves, starting from ``seeds``. Exact
    unless it stops at ``BRANCH_AND_BOUND_NODES``."""
    order = sorted(range(len(groups)), key=lambda g: -len(groups[g].options))
    least_after = list(itertools.accumulate(
        (groups[g].options[0][2] for g in reversed(order)), initial=0))[::-1]
    relaxations = [_Relaxation([groups[g] for g in order[depth:]])
                   for depth in range(len(order) + 1)]
    kept = [(-_kl_of(groups, seed), seed) for seed in seeds]  # a heap: worst on top
    heapq.heapify(kept)
    nodes = [0]

    def visit(depth: int, pick: list[int], kl: float, left: int) -> None:
        nodes[0] += 1
        if depth == len(order):
            entry = (-kl, tuple(pick))
            if any(entry[1] == other for _, other in kept):
                return  # a seed, found again
            if len(kept) < candidates:
                heapq.heappush(kept, entry)
            elif -kl > kept[0][0]:
                heapq.heapreplace(kept, entry)
            return
        if nodes[0] > BRANCH_AND_BOUND_NODES or (
                len(kept) == candidates
                and kl + relaxations[depth].bound(left) >= -kept[0][0] - 1e-12):
            return
        g = order[depth]
        for i in sorted(range(len(groups[g].options)), key=lambda i: groups[g].options[i][1]):
            _, k, b = groups[g].options[i]
            if b + least_after[depth + 1] <= left:
                pick[g] = i
                visit(depth + 1, pick, kl + k, left - b)
        pick[g] = 0

    visit(0, [0] * len(groups), 0.0, budget)
    return [pick for _, pick in sorted(kept, key=lambda e: (-e[0], e[1]))]


class _Relaxation:
    """The linear relaxation of a multiple-choice knapsack over ``groups``: each group at its
    fewest bytes, then hull upgrades, the most KL saved per byte first, the last one taken in
    part (Sinha and Zoltners). Its KL is a lower bound on any allocation's within the bytes."""

    def __init__(self, groups: list[_Group]):
        self.kl = math.fsum(g.options[0][1] for g in groups)
        self.bytes = sum(g.options[0][2] for g in groups)
        self.upgrades = []  # (saved KL, bytes), best rate first
        for group in groups:
            for a, b in itertools.pairwise(_hull(group)):
                (_, ka, ba), (_, kb, bb) = group.options[a], group.options[b]
                self.upgrades.append((ka - kb, bb - ba))
        self.upgrades.sort(key=lambda u: -u[0] / u[1])

    def bound(self, left: int) -> float:
        lower, left = self.kl, left - self.bytes
        for saved, cost in self.upgrades:
            if cost > left:
                return lower - saved * max(left, 0) / cost
            lower, left = lower - saved, left - cost
        return lower
