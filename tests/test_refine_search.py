"""A Fisher-scored search refined over a real 2-slot cluster: one backward pass per
calibration batch instead of a forward per cell, scores fitted to nats, offspring scored as
their own tasks and never over the budget, the refined mix verified beside the one-shot mix,
a rerun that scores nothing again, offspring whose worker is killed rerun with nothing lost
or duplicated, and the mistakes refused before anything runs."""

from __future__ import annotations

import json

import polars as pl
import pytest

from quantdask.errors import SpecError
from quantdask.run.sweep import run_sweep
from quantdask.store.run_store import read_frame
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import calibration_file
from tests.test_search import search_sweep

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

REFINE = {"generations": 2, "offspring": 3, "windows": 12}


def refine_sweep(calibration: str, **search) -> dict:
    """The search of tests/test_search.py scored by fisher and refined: b2, b4 and keep per
    linear at 7 bits per weight, 16 windows, one candidate, on 16 eval windows."""
    data = search_sweep(calibration, **{
        "formats": {"b2": {"bits": 2}, "b4": {"bits": 4}, "keep": None},
        "budget": {"bits_per_weight": 7.0}, "frontier": [], "candidates": 1, "windows": 16,
        "cells_per_task": 30, "tie": [], "sensitivity": "fisher", "fisher_tokens": 512,
        "refine": REFINE, **search})
    data["eval"].update(samples=16)
    return data


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> str:
    return calibration_file(tmp_path_factory, 300, seed=12)


@pytest.fixture(scope="module")
def refined(cluster, calibration, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("refine") / "run"
    results = run_sweep(sweep_from_dict(refine_sweep(calibration)), run_dir, cluster.client)
    return run_dir, results


def tasks_of(run_dir) -> dict[str, int]:
    frame = read_frame(run_dir, "worker_tasks")
    return dict(frame.group_by("kind").len().iter_rows())


def test_fisher_scores_every_cell_from_one_pass_per_batch(refined):
    run_dir, _ = refined
    counts = tasks_of(run_dir)
    assert counts["fisher pass"] == 2  # 16 windows in batches of 8
    cells = read_frame(run_dir, "sensitivity").filter(pl.col("format") != "rest")
    units = cells.filter(pl.col("unit") != "(all)")
    assert units.height == 28 * 3 and set(units["method"]) == {"fisher"}
    assert units["score"].is_not_null().all() and units["kl"].is_not_null().all()
    whole = cells.filter(pl.col("unit") == "(all)")
    assert set(whole["method"]) == {"kl"} and whole.height == 2
    for row in whole.iter_rows(named=True):
        # the fit: a format's fitted cells add up to its measured whole-model KL
        fitted = units.filter(pl.col("format") == row["format"])["kl"].sum()
        assert fitted == pytest.approx(row["kl"], rel=1e-9)
    assert (units.filter(pl.col("format") == "keep")["kl"] == 0).all()


def test_offspring_are_tasks_of_their_own_within_the_budget(refined):
    run_dir, results = refined
    frame = read_frame(run_dir, "refinement")
    assert frame.filter(pl.col("generation") == 0).height == 1
    assert 1 <= frame["generation"].max() <= REFINE["generations"]
    per = frame.filter(pl.col("generation") > 0).group_by("generation").len()
    assert (per["len"] <= REFINE["offspring"]).all()
    assert tasks_of(run_dir)["offspring"] == frame.height
    allocation = read_frame(run_dir, "allocation")
    budget = allocation.filter(pl.col("role") == "mixed")["budget_bytes"][0]
    assert (frame["bytes"] <= budget).all()
    assert frame.unique(["generation", "mix"]).height == frame.height
    assert set(frame["measured_in"]) == {"torch"}
    assert all(len(json.loads(w)) == REFINE["windows"] for w in frame["window_kl"])
    # each generation's parent is the best of the one before
    for generation in range(1, int(frame["generation"].max()) + 1):
        before = frame.filter(pl.col("generation") == generation - 1)
        parent = before.sort("kl")["mix"][0] if generation > 1 else before["mix"][0]
        assert set(frame.filter(pl.col("generation") == generation)["parent"]) == {parent}


def test_the_refined_mix_is_verified_beside_the_one_shot_mix(refined):
    """The refinement's best mix is a job (the one-shot mix's own where no offspring beat
    it: one job id for both), measured on the eval windows, its bytes as predicted."""
    run_dir, results = refined
    allocation = read_frame(run_dir, "allocation")
    roles = set(allocation["role"])
    assert {"mixed", "refined", "uniform", "equal-bytes"} <= roles
    frame = read_frame(run_dir, "refinement")
    best = frame.sort("kl")["formats"][0] if frame["generation"].max() > 1 else None
    job_id = allocation.filter(pl.col("role") == "refined")["job_id"][0]
    row = results.filter(pl.col("job_id") == job_id).row(0, named=True)
    assert row["status"] == "done" and row["size_bytes"] == row["predicted_bytes"]
    budget = allocation.filter(pl.col("role") == "mixed")["budget_bytes"][0]
    assert row["size_bytes"] <= budget
    assert "fisher" in row["predicted_in"]
    chosen = dict(allocation.filter(pl.col("role") == "refined").select("unit", "format")
                  .iter_rows())
    if best is not None:
        assert chosen == json.loads(best)


def test_a_rerun_scores_nothing_again(refined, cluster, calibration):
    run_dir, results = refined
    before = tasks_of(run_dir)
    frames = {name: read_frame(run_dir, name).height for name in ("sensitivity", "refinement")}
    again = run_sweep(sweep_from_dict(refine_sweep(calibration)), run_dir, cluster.client)
    after = tasks_of(run_dir)
    for kind in ("fisher pass", "probe", "offspring"):
        assert after[kind] == before[kind], kind
    assert {name: read_frame(run_dir, name).height for name in frames} == frames
    assert set(again["job_id"]) == set(results["job_id"])


def test_offspring_whose_worker_is_killed_are_rerun_nothing_lost_or_duplicated(
        cluster, calibration, tmp_path, caplog):
    data = refine_sweep(calibration, refine={"generations": 1, "offspring": 2, "windows": 8},
                        formats={"b2": {"bits": 2}, "b4": {"bits": 4}}, granularity="block",
                        windows=8, fisher_tokens=128, budget={"bits_per_weight": 7.6})
    data.update(retries=2, faults=[{"config": "search:mix:refine", "kind": "kill",
                                    "attempt": 1}])
    run_dir = tmp_path / "run"
    with caplog.at_level("WARNING", logger="quantdask.driver"):
        run_sweep(sweep_from_dict(data), run_dir, cluster.client)
    frame = read_frame(run_dir, "refinement")
    assert frame.height == 1 + frame.filter(pl.col("generation") == 1).height >= 2
    assert frame.unique(["generation", "mix"]).height == frame.height
    # every scored mix lost its first attempt with its worker, and was scored on the next
    killed = [r.getMessage() for r in caplog.records
              if "refinement generation" in r.getMessage() and "attempt 1: worker_lost"
              in r.getMessage()]
    assert len(killed) == frame.height
    # each killed attempt that had begun has its time in the account, marked lost: from the
    # start its worker told to when the driver saw the worker gone (the rerun's own row beside
    # it, done; an attempt queued behind it on the same worker never began: no time to count)
    tasks = read_frame(run_dir, "worker_tasks").filter(pl.col("kind") == "offspring")
    lost = tasks.filter(pl.col("status") == "lost")
    assert 1 <= lost.height <= frame.height and set(lost["error_class"]) == {"worker lost"}
    assert all(key.endswith("-a1") for key in lost["key"])
    assert (lost["finished_at"] >= lost["started_at"]).all()
    assert tasks.filter(pl.col("status") == "done").height == frame.height
    from quantdask.store.readers import read_attempts, read_sessions
    from quantdask.store.summary import sweep_summary

    summary = sweep_summary(read_attempts(run_dir), read_sessions(run_dir),
                            read_frame(run_dir, "worker_tasks")).row(-1, named=True)
    assert summary["tasks"] == read_frame(run_dir, "worker_tasks").height  # lost ones too


@pytest.mark.parametrize("change, field", [
    ({"sensitivity": "gradients"}, "sensitivity"),
    ({"refine": {"generations": 0}}, "refine.generations"),
    ({"refine": {"offspring": 0}}, "refine.offspring"),
    ({"refine": {"rounds": 2}}, "refine.rounds"),
])
def test_bad_refinements_are_refused_naming_the_field(calibration, change, field):
    with pytest.raises(SpecError, match=rf"{field.replace('.', '[.]')}"):
        sweep_from_dict(refine_sweep(calibration, **change))


def test_refine_windows_beyond_the_calibration_text_are_refused_before_any_task(
        cluster, calibration, tmp_path):
    data = refine_sweep(calibration, refine={"windows": 100_000})
    with pytest.raises(SpecError, match=r"refine\.windows.*calibration text"):
        run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client)
    assert not (tmp_path / "run" / "worker_tasks").exists() or read_frame(
        tmp_path / "run", "worker_tasks").height == 0


def test_refine_on_a_backend_without_a_runtime_scorer_is_refused(calibration):
    import dataclasses

    from quantdask.backends import get_backend, register_backend
    from quantdask.backends.capabilities import Searchable

    hqq = get_backend("hqq")
    searchable = hqq.has(Searchable)
    unscored = dataclasses.replace(hqq, name="hqq-unscored", capabilities=tuple(
        dataclasses.replace(c, refine_why="its mixes run in no runtime here")
        if c is searchable else c for c in hqq.capabilities))
    register_backend(unscored)
    with pytest.raises(SpecError, match="refine: hqq-unscored has no runtime scorer"):
        sweep_from_dict(refine_sweep(calibration, backend="hqq-unscored"))


def test_a_budget_below_the_least_is_refused_before_any_task(cluster, calibration, tmp_path):
    """The bytes follow from the shapes: 2 bits per unit weight at least, the embeddings and
    head in float32, refused before the units are read or a cell probed."""
    data = refine_sweep(calibration, budget={"bits_per_weight": 3.0}, refine=None)
    with pytest.raises(SpecError, match=r"searches\[0\]\.budget: 3 bits per weight is below "
                                        r"the least demo can take"):
        run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client)
    tasks = tmp_path / "run" / "worker_tasks"
    assert not tasks.exists() or read_frame(tmp_path / "run", "worker_tasks").height == 0
