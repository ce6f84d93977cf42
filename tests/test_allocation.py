"""The mixed-precision allocator (quantdask.search.allocation): both solvers against brute
force on many small random problems, the fallback against the exact solver on large ones, and
the budget, ties and fixed units held by every answer."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from quantdask.errors import SpecError
from quantdask.search.allocation import allocate, scipy_milp_available

pytestmark = pytest.mark.timeout(120)
SOLVERS = ["milp", "fallback"] if scipy_milp_available() else ["fallback"]
BITS = {"b2": 2.3, "b3": 3.4, "b4": 4.5, "b8": 8.5, "keep": 16.0}  # stored, scales counted
ERROR = {"b2": 1.0, "b3": 0.3, "b4": 0.08, "b8": 0.003, "keep": 0.0}


def problem(units: int, rng: random.Random, formats=tuple(BITS), drop: float = 0.0) -> dict:
    """A model-like problem: sensitivities spread over orders of magnitude, KL falling and
    bytes rising with the bits; with ``drop``, some cells a unit cannot take."""
    cells = {}
    for u in range(units):
        weights, sensitivity = rng.randint(1_000, 100_000), rng.lognormvariate(0, 1.5)
        offered = [f for f in formats if f == "keep" or rng.random() >= drop]
        cells[f"u{u}"] = {f: (sensitivity * ERROR[f] * rng.uniform(0.7, 1.3),
                              int(weights * BITS[f] / 8)) for f in offered}
    return cells


def brute_force(cells, budget, ties=(), fixed=None) -> list[float]:
    """Every allocation's KL within the budget, ties and fixed units held, least first."""
    fixed = fixed or {}
    units = list(cells)
    found = []
    for formats in itertools.product(*(sorted(cells[u]) for u in units)):
        chosen = dict(zip(units, formats))
        if any(chosen[u] != f for u, f in fixed.items()):
            continue
        if any(len({chosen[u] for u in tie}) > 1 for tie in ties):
            continue
        if sum(cells[u][chosen[u]][1] for u in units) <= budget:
            found.append(math.fsum(cells[u][chosen[u]][0] for u in units))
    return sorted(found)


def check(cells, answers, budget, ties=(), fixed=None) -> None:
    """Each answer within the budget, its figures its cells', ties and fixed units held."""
    picks = set()
    for answer in answers:
        assert answer.bytes <= budget
        assert answer.bytes == sum(cells[u][f][1] for u, f in answer.formats.items())
        assert answer.kl == pytest.approx(math.fsum(cells[u][f][0]
                                                    for u, f in answer.formats.items()))
        assert set(answer.formats) == set(cells)
        assert all(len({answer.formats[u] for u in tie}) == 1 for tie in ties)
        assert all(answer.formats[u] == f for u, f in (fixed or {}).items())
        picks.add(tuple(sorted(answer.formats.items())))
    assert len(picks) == len(answers)  # the candidates differ
    assert [a.rank for a in answers] == list(range(1, len(answers) + 1))
    assert [a.kl for a in answers] == sorted(a.kl for a in answers)


@pytest.mark.parametrize("solver", SOLVERS)
def test_both_solvers_agree_with_brute_force_on_small_problems(solver):
    rng = random.Random(20261203)
    for trial in range(80):
        cells = problem(rng.randint(1, 5), rng, drop=0.3)
        units = list(cells)
        ties = [rng.sample(units, 2)] if len(units) >= 3 and rng.random() < 0.4 else []
        fixed = {units[0]: "keep"} if rng.random() < 0.2 else None
        least = sum(min(b for _, b in cells[u].values()) for u in units)
        most = sum(max(b for _, b in cells[u].values()) for u in units)
        budget = rng.randint(least, most)
        expected = brute_force(cells, budget, ties, fixed)
        if not expected:  # the ties or the fixed unit leave nothing within the budget
            with pytest.raises(SpecError):
                allocate(cells, budget, ties=ties, fixed=fixed, solver=solver)
            continue
        answers = allocate(cells, budget, ties=ties, fixed=fixed, candidates=3, solver=solver)
        check(cells, answers, budget, ties, fixed)
        assert [a.kl for a in answers] == pytest.approx(expected[:3], rel=1e-9, abs=1e-12), \
            (trial, cells, budget, ties, fixed)
        assert all(a.solver == solver for a in answers)


@pytest.mark.skipif("milp" not in SOLVERS, reason="needs scipy (the search extra)")
@pytest.mark.parametrize("units", [40, 300])
def test_the_fallback_is_within_one_percent_of_the_exact_solver(units):
    # (1,000 units: benchmarks/search_solver.py, with the times.)
    rng = random.Random(units)
    cells = problem(units, rng, drop=0.1)
    full = sum(cells[u]["keep"][1] for u in cells)
    for bits in (3.0, 4.0, 6.0):
        budget = int(full * bits / 16)
        [exact] = allocate(cells, budget, solver="milp")
        [fallback] = allocate(cells, budget, solver="fallback")
        check(cells, [exact], budget)
        check(cells, [fallback], budget)
        assert exact.kl <= fallback.kl + 1e-9
        assert fallback.kl <= exact.kl * 1.01, (units, bits, exact.kl, fallback.kl)


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_fragile_unit_gets_more_bits_and_ties_share_a_format(solver):
    cells = problem(8, random.Random(3), formats=("b2", "b3", "b4", "keep"))
    cells["u5"] = {f: (kl * 1000, b) for f, (kl, b) in cells["u5"].items()}  # fragile
    full = sum(cells[u]["keep"][1] for u in cells)
    ties = [["u0", "u1", "u2"]]
    [best] = allocate(cells, int(full * 3.5 / 16), ties=ties, fixed={"u7": "b4"},
                      solver=solver)
    bits = {u: BITS[f] for u, f in best.formats.items() if u != "u7"}
    assert bits["u5"] == max(bits.values()) > min(bits.values())
    assert len({best.formats[u] for u in ties[0]}) == 1
    assert best.formats["u7"] == "b4"


def test_bad_requests_are_refused_naming_what_to_change():
    cells = {"a": {"b2": (1.0, 100), "keep": (0.0, 800)},
             "b": {"b4": (0.5, 200), "keep": (0.0, 800)}}
    with pytest.raises(SpecError) as error:
        allocate(cells, 299)
    assert error.value.field == "budget" and "300 bytes" in error.value.message
    with pytest.raises(SpecError, match="no unit of this search"):
        allocate(cells, 1000, ties=[["a", "z"]])
    with pytest.raises(SpecError, match="share no format"):
        allocate({**cells, "a": {"b2": (1.0, 100)}, "b": {"b4": (0.5, 200)}}, 1000,
                 ties=[["a", "b"]])
    with pytest.raises(SpecError) as error:
        allocate(cells, 1000, fixed={"a": "b4"})
    assert error.value.field == "fixed.a"
    with pytest.raises(SpecError):
        allocate(cells, 1000, candidates=0)
    with pytest.raises(SpecError):
        allocate(cells, 1000, solver="simplex")


@pytest.mark.parametrize("solver", SOLVERS)
def test_fewer_candidates_than_asked_when_fewer_exist(solver):
    cells = {"a": {"b2": (1.0, 100), "keep": (0.0, 800)},
             "b": {"b4": (0.5, 200), "keep": (0.0, 800)}}
    answers = allocate(cells, 1000, candidates=5, solver=solver)
    assert [a.formats for a in answers] == [{"a": "keep", "b": "b4"},
                                            {"a": "b2", "b": "keep"}, {"a": "b2", "b": "b4"}]
