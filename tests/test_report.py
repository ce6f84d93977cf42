"""Reports: summaries, charts, scaling runs, notebooks executed for real, HTML in a real browser."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import math
import re
import shutil
from pathlib import Path

import nbformat
import polars as pl
import pytest

from quantdask import report
from quantdask.cli.main import main
from quantdask.errors import RunDirError, SpecError
from quantdask.report.charts import LARGEST
from quantdask.report.html import NOTEBOOKS_DIR, ReportError, execute_notebook, write_report
from quantdask.run.scaling import (
    NO_SPEEDUP,
    read_scaling,
    scale_sweep,
    scaling_frame,
    scaling_summary,
)
from quantdask.run.sweep import run_sweep
from quantdask.store.readers import (
    read_attempts,
    read_device_samples,
    read_layers,
    read_results,
    read_sessions,
)
from quantdask.store.summary import sweep_summary
from quantdask.sweepfile.sweep_file import load_sweep, sweep_from_dict
from tests.browser import inspect_page, require_chromium
from tests.conftest import sweep_dict

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

CHARTS_IN_REPORT = 8  # quality, task accuracy, speed, timeline, memory, time per job,
# per-layer error, scaling


def mixed_sweep():
    """Every outcome: done, done after a failed attempt, failed twice, skipped (unsupported)."""
    return sweep_from_dict(sweep_dict(
        name="mixed",
        backends=[{"backend": "bitsandbytes", "grid": {"bits": [4, 8]}},
                  {"backend": "torchao", "configs": [{"mode": "int4_weight_only",
                                                     "group_size": 256}]}],
        retries=1,
        faults=[{"config": "nf4", "attempt": 1, "kind": "raise"},
                {"config": "int8 t=6", "attempt": 1, "kind": "raise"},
                {"config": "int8 t=6", "attempt": 2, "kind": "raise"}],
    ))


def small_sweep():
    return sweep_from_dict(sweep_dict(name="small"))  # the baseline and nf4


@pytest.fixture(scope="module")
def mixed_run(cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("mixed-run")
    run_sweep(mixed_sweep(), run_dir, cluster.client)
    # The report shows a scaling run kept in RUN_DIR/scaling.
    scale_sweep(small_sweep(), run_dir / "scaling", [1, 2], use_gpus=False, repeats=2)
    return run_dir


def frames(run_dir):
    return (read_results(run_dir), read_layers(run_dir), read_attempts(run_dir),
            read_device_samples(run_dir), read_sessions(run_dir))


def chart_rows(chart) -> list[dict]:
    """Every data row an Altair chart carries (all its inline datasets)."""
    spec = chart.to_dict()
    return [row for rows in spec.get("datasets", {}).values() for row in rows]


def test_the_mixed_run_has_every_outcome(mixed_run):
    results = read_results(mixed_run)
    assert dict(results.select("config_label", "status").iter_rows()) == {
        "baseline": "done", "nf4": "done", "int8 t=6": "failed", "ao int4wo g256": "skipped"}


def test_sweep_summary_matches_a_hand_computation_on_real_attempts(mixed_run):
    attempts, sessions = read_attempts(mixed_run), read_sessions(mixed_run)
    summary = sweep_summary(attempts, sessions)
    assert summary.height == 1
    row = summary.row(0, named=True)
    started = [a for a in attempts.to_dicts() if a["started_at"] is not None]
    durations = [(a["finished_at"] - a["started_at"]).total_seconds() for a in started]
    makespan = (max(a["finished_at"] for a in started)
                - min(a["started_at"] for a in started)).total_seconds()
    assert row["attempts"] == len(started) == 6  # 1 + 2 + 2 + 1
    assert row["jobs"] == 4 and row["done"] == 2
    assert row["workers"] == 2 and row["slots"] == 2
    assert row["makespan_s"] == pytest.approx(makespan, abs=1e-6)
    assert row["work_s"] == pytest.approx(sum(durations), abs=1e-6)
    assert row["lower_bound_s"] == pytest.approx(max(max(durations), sum(durations) / 2),
                                                 abs=1e-6)
    assert row["speedup"] == pytest.approx(sum(durations) / makespan, rel=1e-6)
    assert row["efficiency"] == pytest.approx(sum(durations) / makespan / 2, rel=1e-6)
    session = sessions.row(0, named=True)
    assert session["completed"] and session["jobs_run"] == 4
    wall = (session["finished_at"] - session["started_at"]).total_seconds()
    assert row["wall_s"] == pytest.approx(wall, abs=1e-6) and wall >= makespan
    assert row["throughput_jobs_per_min"] == pytest.approx(4 / wall * 60, rel=1e-6)
    assert row["makespan_vs_lower_bound"] == pytest.approx(
        makespan / max(max(durations), sum(durations) / 2), rel=1e-6)


def _attempt(job, worker, start, end, status="done"):
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    return {"run_id": "r", "job_id": job, "attempt": 1, "key": job, "worker": worker,
            "device": "cpu", "started_at": t0 + dt.timedelta(seconds=start),
            "finished_at": t0 + dt.timedelta(seconds=end), "status": status,
            "failure_class": None, "error_class": None, "error_message": None}


def test_sweep_summary_on_a_known_schedule():
    # Two slots: a 4 s job on one, 2 s + 1 s on the other. Work 7 s, makespan 4 s, the lower
    # bound max(4, 7/2) = 4 s: a perfect packing.
    from quantdask.store.schema import ATTEMPT_SCHEMA

    attempts = pl.DataFrame([_attempt("a", "0", 0, 4), _attempt("b", "1", 0, 2),
                             _attempt("c", "1", 2, 3, "failed")], schema=ATTEMPT_SCHEMA)
    row = sweep_summary(attempts).row(0, named=True)
    assert (row["makespan_s"], row["work_s"], row["lower_bound_s"]) == (4.0, 7.0, 4.0)
    assert row["speedup"] == 1.75 and row["efficiency"] == 0.875
    assert row["makespan_vs_lower_bound"] == 1.0 and row["done"] == 2 and row["jobs"] == 3
    assert row["wall_s"] == 4.0  # no session recorded: the makespan stands in
    # One slot doing the same work takes 7 s at best; 4 s is then impossible.
    one_slot = attempts.with_columns(pl.lit("0").alias("worker"))
    assert sweep_summary(one_slot).row(0, named=True)["lower_bound_s"] == 7.0


def _task(kind, worker, start, end, status="done"):
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    return {"run_id": "r", "key": f"{kind}-{start}-r", "kind": kind, "label": "demo",
            "worker": worker, "device": "cpu", "started_at": t0 + dt.timedelta(seconds=start),
            "finished_at": t0 + dt.timedelta(seconds=end), "status": status,
            "error_class": None if status == "done" else "RuntimeError"}


def test_the_time_account_on_a_known_schedule_counts_every_task_and_each_phase():
    # Two slots. A search probes first: units 1 s on slot 0, its reference 2 s on slot 1,
    # then probes of 3 s (slot 0, 1-4 s) and 4 s (slot 1, 2-6 s; failed, counted too). Then
    # the model's reference 1 s (slot 0, 6-7) and jobs of 2 s and 3 s (7-9 on 0, 7-10 on 1).
    from quantdask.store.schema import ATTEMPT_SCHEMA, WORKER_TASK_SCHEMA

    attempts = pl.DataFrame([_attempt("a", "0", 7, 9), _attempt("b", "1", 7, 10)],
                            schema=ATTEMPT_SCHEMA)
    tasks = pl.DataFrame([_task("search units", "0", 0, 1), _task("search reference", "1", 0, 2),
                          _task("probe", "0", 1, 4), _task("probe", "1", 2, 6, "failed"),
                          _task("reference", "0", 6, 7)], schema=WORKER_TASK_SCHEMA)
    row = sweep_summary(attempts, None, tasks).row(0, named=True)
    assert row["work_s"] == 1 + 2 + 3 + 4 + 1 + 2 + 3  # every task's time, 16 s
    assert (row["makespan_s"], row["attempts"], row["tasks"], row["jobs"]) == (10.0, 2, 5, 2)
    assert row["longest_task_s"] == 4.0 and row["lower_bound_s"] == 8.0  # max(4, 16 / 2)
    assert row["speedup"] == 1.6 and row["efficiency"] == 0.8
    # The probing phase: 10 s of work over 0-6 s; the jobs' phase: 6 s over 6-10 s.
    assert (row["search_work_s"], row["search_makespan_s"]) == (10.0, 6.0)
    assert row["search_speedup"] == pytest.approx(10 / 6)
    assert (row["jobs_work_s"], row["jobs_makespan_s"], row["jobs_speedup"]) == (6.0, 4.0, 1.5)
    # Without the worker tasks: the jobs alone, and no search phase.
    alone = sweep_summary(attempts).row(0, named=True)
    assert (alone["work_s"], alone["makespan_s"], alone["tasks"]) == (5.0, 3.0, 0)
    assert alone["search_work_s"] is None
    # Per device: slot 0 busy 1 + 3 + 1 + 2 = 7 s of the 10 s window; slot 1 2 + 4 + 3 = 9 s.
    from quantdask.store.summary import device_summary

    results = pl.DataFrame({"job_id": ["a", "b"], "model": ["demo"] * 2,
                            "config_label": ["nf4", "int8"], "backend": ["bitsandbytes"] * 2,
                            "config": ["{}"] * 2, "worker": ["0", "1"], "device": ["cpu"] * 2,
                            "peak_device_mem_bytes": [1, 2]})
    devices = {r["worker"]: r for r in device_summary(results, attempts=attempts,
                                                      worker_tasks=tasks).to_dicts()}
    assert (devices["0"]["busy_s"], devices["0"]["idle_s"], devices["0"]["tasks"]) == (7, 3, 3)
    assert (devices["1"]["busy_s"], devices["1"]["utilization"]) == (9.0, 0.9)
    # The timeline draws every task, coloured by its kind, the failed probe outlined.
    bars = chart_rows(report.timeline_chart(attempts, results, tasks))
    assert sorted(b["kind"] for b in bars) == sorted(
        ["job", "job", "search units", "search reference", "probe", "probe", "reference"])
    assert [b["unfinished"] for b in bars if b["kind"] == "probe"] == [False, True]
    assert {b["config_label"] for b in bars if b["kind"] != "job"} == {
        "search units", "search reference", "probe", "reference"}


def test_slots_never_fewer_than_the_workers_that_ran_jobs():
    # An external cluster whose workers joined after the session started: 0 slots recorded.
    from quantdask.store.schema import ATTEMPT_SCHEMA, SESSION_SCHEMA

    attempts = pl.DataFrame([_attempt("a", "0", 0, 4), _attempt("b", "1", 0, 2)],
                            schema=ATTEMPT_SCHEMA)
    t0 = attempts["started_at"].min()
    sessions = pl.DataFrame([{"run_id": "r", "sweep": "s", "started_at": t0,
                              "finished_at": t0 + dt.timedelta(seconds=5), "completed": True,
                              "workers": 0, "slots": 0, "jobs_planned": 2, "jobs_run": 2}],
                            schema=SESSION_SCHEMA)
    row = sweep_summary(attempts, sessions).row(0, named=True)
    assert row["slots"] == 2 and row["workers"] == 2 and row["wall_s"] == 5.0
    assert row["efficiency"] == pytest.approx(6 / 4 / 2) and row["lower_bound_s"] == 4.0


def test_pareto_frontier_keeps_only_undominated_configs():
    results = pl.DataFrame({
        "model": ["m"] * 5, "status": ["done"] * 5,
        "config_label": ["base", "a", "b", "c", "d"],
        "bits_per_weight": [32.0, 8.0, 8.0, 4.0, 4.0],
        "kl_divergence": [0.0, 0.001, 0.002, 0.01, 0.02]})
    frontier = report.pareto_frontier(results)
    assert dict(frontier.select("config_label", "pareto").iter_rows()) == {
        "base": True, "a": True, "b": False, "c": True, "d": False}


def test_the_frontier_ranks_by_the_bytes_that_ship():
    """nf4 of a 1.5B bf16 checkpoint with a 151,936-token vocabulary, as measured on one:
    4.5 bits per quantized weight, but its embeddings and head stay bfloat16 (a 1.6 GiB file,
    KL 0.054); GGUF Q4_K_M quantizes them too (5.0 bits per quantized weight, a 1.0 GiB file,
    KL 0.026). On the bytes that ship, Q4_K_M dominates nf4: smaller and closer."""
    gib = 2**30
    params = 1_543_714_304
    results = pl.DataFrame({
        "model": ["m"] * 3, "status": ["done"] * 3, "backend": ["none", "bitsandbytes", "gguf"],
        "config_label": ["baseline", "nf4", "Q4_K_M"],
        "size_bytes": [int(3.09 * gib), int(1.6 * gib), int(1.0 * gib)],
        "bits_per_quantized_weight": [None, 4.5, 5.0],
        "kl_divergence": [0.0, 0.054, 0.026], "kl_se": [0.0, 0.001, 0.001]}).with_columns(
        (8 * pl.col("size_bytes") / params).alias("bits_per_weight"))
    frontier = dict(report.pareto_frontier(results).select("config_label", "pareto").rows())
    assert frontier == {"baseline": True, "nf4": False, "Q4_K_M": True}
    # (by bits per quantized weight, the old axis, nf4 was on it: 4.5 left of 5.0)
    old = report.pareto_frontier(results.with_columns(
        pl.coalesce("bits_per_quantized_weight", "bits_per_weight").alias("cost")), cost="cost")
    assert dict(old.select("config_label", "pareto").rows())["nf4"]


def test_configs_within_their_noise_are_tied_not_ranked():
    # nf4 and nf4 dq as in the demo: 0.005934 against 0.005904, each +- 0.0002, dq smaller.
    results = pl.DataFrame({
        "model": ["m"] * 5 + ["other"], "status": ["done"] * 6,
        "config_label": ["base", "nf4", "nf4 dq", "int8", "fp4", "nf4"],
        "bits_per_weight": [32.0, 4.5, 4.13, 8.0, 4.5, 4.5],
        "kl_divergence": [0.0, 0.005934, 0.005904, 0.0003, 0.0080, 0.005904],
        "kl_se": [0.0, 0.0002, 0.0002, 0.00002, 0.0002, 0.0002]})
    frontier = {(r["model"], r["config_label"]): r for r in
                report.pareto_frontier(results).iter_rows(named=True)}
    # nf4 is larger than nf4 dq and not better by more than 2 * sqrt(2) * 0.0002: off it.
    assert not frontier[("m", "nf4")]["pareto"] and frontier[("m", "nf4 dq")]["pareto"]
    assert frontier[("m", "nf4")]["tied_with"] == "nf4 dq"
    assert frontier[("m", "nf4 dq")]["tied_with"] == "nf4"
    # fp4 is as large as nf4 and 10 standard errors worse: dominated, tied with nothing.
    assert not frontier[("m", "fp4")]["pareto"] and frontier[("m", "fp4")]["tied_with"] is None
    assert frontier[("m", "int8")]["pareto"] and frontier[("m", "base")]["pareto"]
    assert frontier[("other", "nf4")]["pareto"]  # another model's configs are not compared
    ties = report.kl_ties(results)
    assert ties.select("model", "config", "tied_with").rows() == [("m", "nf4 dq", "nf4")]
    assert ties["difference"][0] == pytest.approx(0.00003)
    assert ties["margin"][0] == pytest.approx(2 * math.sqrt(2) * 0.0002)
    # Without standard errors every difference counts, as before.
    plain = report.pareto_frontier(results.drop("kl_se"))
    assert dict(plain.filter(pl.col("model") == "m").select("config_label", "pareto")
                .iter_rows()) == {"base": True, "nf4": False, "nf4 dq": True, "int8": True,
                                  "fp4": False}
    assert report.kl_ties(results.drop("kl_se")).is_empty()


def test_ties_are_judged_on_the_windows_both_configs_were_measured_on():
    # Two configs whose KLs swing together from window to window (hard windows are hard for
    # both): unpaired their errors swamp a difference of 0.001; paired, b is the higher on
    # every window and the difference is far past its noise. c tracks a within the noise.
    import numpy as np

    hardness = np.linspace(0.001, 0.02, 16)
    wobble = np.tile([1e-4, -1e-4], 8)
    per_window = {"a": hardness, "b": hardness + 0.001, "c": hardness + wobble}
    windows = pl.DataFrame([{"job_id": job, "window": w, "kl": float(v)}
                            for job, values in per_window.items() for w, v in enumerate(values)])
    se = float(hardness.std(ddof=1) / 4)
    results = pl.DataFrame({
        "job_id": ["a", "b", "c"], "model": ["m"] * 3, "status": ["done"] * 3,
        "config_label": ["a", "b", "c"], "bits_per_weight": [4.0, 4.0, 4.5],
        "kl_divergence": [float(v.mean()) for v in per_window.values()], "kl_se": [se] * 3})
    unpaired = report.kl_ties(results)
    assert set(unpaired.select("config", "tied_with").rows()) == {
        ("a", "c"), ("a", "b"), ("c", "b")}
    paired = report.kl_ties(results, windows)
    assert paired.select("config", "tied_with").rows() == [("a", "c")]
    differences = per_window["c"] - per_window["a"]
    assert paired["margin"][0] == pytest.approx(2 * differences.std(ddof=1) / 4)
    frontier = report.pareto_frontier(results, windows=windows)
    assert dict(frontier.select("config_label", "pareto").iter_rows()) == {
        "a": True, "b": False, "c": False}


def test_figures_are_shown_with_their_error_and_a_bound_as_a_bound():
    import doctest

    import quantdask.store.figures
    import quantdask.store.frontier
    from quantdask.store.figures import with_quality_text

    for module in (quantdask.store.figures, quantdask.store.frontier):
        failed, attempted = doctest.testmod(module)
        assert attempted >= 2 and failed == 0, module
    frame = pl.DataFrame({
        "perplexity": [1.56391, 1.6, None], "ln_ppl_se": [0.00787, None, None],
        "kl_divergence": [0.005934, 0.000114, None], "kl_se": [0.000121, 0.00001, None],
        "kl_kind": ["estimate", "lower_bound", None], "kl_tail_mass": [0.1, 0.992, None],
        "top1_agreement": [0.96431, 0.9, None], "top1_agreement_se": [0.00213, 0.01, None],
        "ln_ppl_ratio": [0.0086, 0.01, None], "ln_ppl_ratio_se": [0.0012, None, None],
        "delta_p_mean": [-0.0021, 0.0, None], "delta_p_se": [0.0004, None, None]})
    shown = with_quality_text(frame).select("ppl", "kl", "top1").rows()
    assert with_quality_text(frame).select("vs_baseline", "delta_p").rows() == [
        ("0.0086 ± 0.0012", "-0.00210 ± 0.00040"), ("0.01", "0"), (None, None)]
    assert shown == [("1.564 ± 0.012", "0.00593 ± 0.00012", "0.9643 ± 0.0021"),
                     ("1.6", "≥ 0.000114 (tail 99%)", "0.900 ± 0.010"), (None, None, None)]


def test_every_chart_carries_every_job(mixed_run):
    results, layers, attempts, samples, _ = frames(mixed_run)
    done = set(results.filter(pl.col("status") == "done")["job_id"])
    started = attempts.filter(pl.col("started_at").is_not_null())
    assert {r["job_id"] for r in chart_rows(report.quality_chart(results))} == done
    timeline = chart_rows(report.timeline_chart(attempts, results))
    assert len(timeline) == started.height == 6
    assert {r["status"] for r in timeline} == {"done", "failed", "skipped"}
    breakdown = chart_rows(report.time_breakdown_chart(results))
    assert len(breakdown) == 7 * len(done)  # load, calibrate, quantize, eval, tasks, speed, other
    heat = chart_rows(report.layer_error_heatmap(results, layers))
    assert {r["job_id"] for r in heat} == set(layers["job_id"])
    assert sum(r["linear"] != LARGEST for r in heat) == 2 * layers.height
    memory = chart_rows(report.memory_chart(results, samples))
    assert {r["job_id"] for r in memory if r.get("memory") == "device MiB"} == done
    assert sum(1 for r in memory if "time" in r) == samples.height
    done_rows = results.filter(pl.col("status") == "done").to_dicts()
    expected = {**{(r["job_id"], "device MiB"): r["peak_device_mem_bytes"] / 2**20
                   for r in done_rows},
                **{(r["job_id"], "host RSS MiB"): r["peak_host_rss_bytes"] / 2**20
                   for r in done_rows}}
    assert {(r["job_id"], r["memory"]): r["MiB"] for r in memory if "memory" in r} \
        == pytest.approx(expected, rel=1e-9)
    assert sorted(r["MiB"] for r in memory if "time" in r) == pytest.approx(
        sorted(b / 2**20 for b in samples["memory_used_bytes"]), rel=1e-9)


def test_failures_table_lists_failed_and_skipped_jobs_with_reasons(mixed_run):
    table = report.failures_table(read_results(mixed_run))
    rows = {r["config_label"]: r for r in table.to_dicts()}
    assert set(rows) == {"int8 t=6", "ao int4wo g256"}
    assert rows["int8 t=6"]["failure_class"] == "job_error" and rows["int8 t=6"]["attempts"] == 2
    assert "injected fault on attempt 2" in rows["int8 t=6"]["reason"]
    assert rows["ao int4wo g256"]["failure_class"] == "unsupported"
    assert "256" in rows["ao int4wo g256"]["reason"]


def test_several_models_keep_their_jobs_apart(mixed_run):
    # Every model has a "baseline": the per-job charts must not stack two models' jobs in one.
    results = read_results(mixed_run)
    two = pl.concat([results, results.with_columns(
        pl.lit("other").alias("model"), (pl.col("job_id") + "-other").alias("job_id"))])
    breakdown = chart_rows(report.time_breakdown_chart(two))
    assert {r["job"] for r in breakdown} == {"demo · baseline", "demo · nf4",
                                             "other · baseline", "other · nf4"}
    memory = chart_rows(report.job_memory_chart(two))
    assert len({r["job"] for r in memory}) == 4
    quality = report.quality_chart(two).to_dict()
    assert len(quality["vconcat"]) == 2  # one row of panels per model


def test_a_big_model_with_thousands_of_layer_rows_still_charts(mixed_run):
    results, layers = read_results(mixed_run), read_layers(mixed_run)
    many = pl.concat([layers.with_columns(pl.col("layer") + f".copy{i}",
                                          pl.col("position") + i * 1000) for i in range(120)])
    assert many.height > 3000  # 2 metrics each: past Altair's default 5000-row limit
    heat = chart_rows(report.layer_error_heatmap(results, many))
    assert sum(r["linear"] != LARGEST for r in heat) == 2 * many.height


def _exploded(results: pl.DataFrame) -> pl.DataFrame:
    """``results`` with a 2-bit config whose perplexity exploded (a real model's: 828,605)."""
    nf4 = results.filter(pl.col("config_label") == "nf4")
    return pl.concat([results, nf4.with_columns(
        pl.lit("2-bit").alias("config_label"), (pl.col("job_id") + "-2bit").alias("job_id"),
        pl.lit(828_605.0).alias("perplexity"), pl.lit(9.5).alias("kl_divergence"),
        pl.col("bits_per_quantized_weight") / 2)])


def _y_scales(spec: dict) -> dict[str, dict]:
    """Each quality panel's points: their field -> the y scale they are drawn on."""
    return {layer["encoding"]["y"]["field"]: layer["encoding"]["y"].get("scale", {})
            for row in spec["vconcat"] for panel in row["hconcat"] for layer in panel["layer"]
            if layer.get("mark", {}).get("type") == "point"}


def test_one_exploded_config_leaves_every_other_readable(mixed_run):
    results = read_results(mixed_run)
    calm = _y_scales(report.quality_chart(results).to_dict())
    assert calm["perplexity"].get("type") != "log" and calm["kl_divergence"].get("type") != "log"
    spec = report.quality_chart(_exploded(results)).to_dict()
    scales = _y_scales(spec)
    # Values over decades: log scales, so the baseline and nf4 stay apart from each other.
    assert scales["perplexity"]["type"] == "log" and scales["kl_divergence"]["type"] == "log"
    rows = [r for r in chart_rows(report.quality_chart(_exploded(results)))
            if "kl_divergence_lo" in r]
    assert all(r["kl_divergence_lo"] > 0 for r in rows if r["kl_divergence"] > 0)
    # The size axis is the whole model's bits as stored, bits per quantized weight in the
    # tooltip; the baseline is its rule, no point (its 32 bits would stretch the axis).
    panel = spec["vconcat"][0]["hconcat"][0]["layer"][-1]["encoding"]
    assert panel["x"]["field"] == "size_bits" and "whole model as stored" in panel["x"]["title"]
    assert "bits_per_quantized_weight" in {t["field"] for t in panel["tooltip"]}
    nf4 = next(r for r in rows if r["config_label"] == "nf4")
    assert nf4["size_bits"] == nf4["bits_per_weight"] > nf4["bits_per_quantized_weight"]
    drawn = [r for r in chart_rows(report.quality_chart(results))
             if r.get("kind") in ("Pareto frontier", "dominated")]
    assert drawn and "baseline" not in {r["config_label"] for r in drawn}
    assert max(r["size_bits"] for r in drawn) < 20  # the axis fits them, not the 32 bits


LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def _deep_layers(results: pl.DataFrame) -> list[dict]:
    """Layer rows of an 80-block model (7 linears a block, and a head) for nf4's job."""
    job = results.filter(pl.col("config_label") == "nf4")["job_id"][0]
    rows = [{"job_id": job, "position": 7 * block + i, "layer": f"model.layers.{block}.{name}",
             "in_features": 64, "out_features": 64, "weight_rel_error": 0.01 * (i + 1),
             "weight_sqnr_db": 30.0, "output_rel_error": None}
            for block in range(80) for i, name in enumerate(LINEARS)]
    return [*rows, {**rows[0], "position": 560, "layer": "lm_head", "weight_rel_error": 0.5}]


def test_the_layer_heatmap_fits_one_screen_at_80_blocks(mixed_run):
    results = read_results(mixed_run)
    rows, linears = _deep_layers(results), LINEARS
    spec = report.layer_error_heatmap(results, pl.DataFrame(rows)).to_dict()
    heatmap = spec["vconcat"][0]
    assert heatmap["height"]["step"] * (80 + 1) <= 800  # 80 blocks and the head: one screen
    picker = next(p for p in spec["params"] if p["name"] == "block_linear")
    assert picker["bind"]["options"] == [LARGEST, *linears] and picker["value"] == LARGEST
    drawn = chart_rows(report.layer_error_heatmap(results, pl.DataFrame(rows)))
    largest = [r for r in drawn if r["linear"] == LARGEST]
    assert len(largest) == 80 and all(r["error"] == pytest.approx(0.07) for r in largest)
    assert {r["row"] for r in drawn} == {f"block {b}" for b in range(80)} | {"lm_head"}


def test_empty_frames_draw_a_message_not_an_error(mixed_run):
    results = read_results(mixed_run).filter(pl.col("status") != "done")
    for chart in (report.quality_chart(results), report.time_breakdown_chart(results),
                  report.layer_error_heatmap(results, read_layers(mixed_run).clear())):
        assert chart_rows(chart)[0]["message"]


def test_scaling_run_records_every_count(mixed_run):
    scaling = read_scaling(mixed_run / "scaling")
    assert scaling["workers"].to_list() == [1, 1, 2, 2] and scaling["repeat"].to_list() == [
        1, 2, 1, 2]
    assert scaling["slots"].to_list() == [1, 1, 2, 2]
    assert (scaling["done"] == 2).all() and (scaling["jobs"] == 2).all()
    # Interleaved: 1, 2, 1, 2 (each run's session after the one before it)
    started = {(r["workers"], r["repeat"]): read_sessions(r["run_dir"])["started_at"][0]
               for r in scaling.to_dicts()}
    assert sorted(started, key=started.get) == [(1, 1), (2, 1), (1, 2), (2, 2)]
    # Throughput worked out from each run's own session (jobs tried per minute of the
    # driver's wall time), then speedup and efficiency against the 1-worker run of the same
    # repeat; the machine's load beside each.
    throughput = {}
    for row in scaling.to_dicts():
        session = read_sessions(row["run_dir"]).row(0, named=True)
        wall = (session["finished_at"] - session["started_at"]).total_seconds()
        key = (row["workers"], row["repeat"])
        throughput[key] = read_results(row["run_dir"]).height / wall * 60
        assert row["throughput_jobs_per_min"] == pytest.approx(throughput[key], rel=1e-6)
        assert row["load_average"] >= 0 and 0 <= row["other_cpu_share"] <= 1
    for row in scaling.to_dicts():
        speedup = throughput[(row["workers"], row["repeat"])] / throughput[(1, row["repeat"])]
        assert row["scaling_speedup"] == pytest.approx(speedup, rel=1e-6)
        assert row["scaling_efficiency"] == pytest.approx(speedup / row["workers"], rel=1e-6)
    for row in scaling.to_dicts():  # each run ran every job fresh, in its own run dir
        assert read_results(row["run_dir"]).height == 2
        assert read_sessions(row["run_dir"])["workers"].to_list() == [row["workers"]]
    chart = chart_rows(report.scaling_chart(scaling))
    assert {r["workers"] for r in chart if "workers" in r} == {1, 2}
    # Each phase's own speedup: the jobs' (their attempts and the model's reference); no
    # search ran, so no probing phase.
    base = {r["repeat"]: r for r in scaling.filter(pl.col("workers") == 1).to_dicts()}
    for row in scaling.to_dicts():
        assert row["jobs_scaling_speedup"] == pytest.approx(
            base[row["repeat"]]["jobs_makespan_s"] / row["jobs_makespan_s"], rel=1e-9)
        assert row["search_scaling_speedup"] is None and row["tasks"] >= 2  # the reference
    summary = scaling_summary(scaling).row(1, named=True)
    two = sorted(scaling.filter(pl.col("workers") == 2)["scaling_speedup"].to_list())
    assert summary["runs"] == 2 and summary["scaling_speedup"] == pytest.approx(sum(two) / 2)
    assert (summary["scaling_speedup_min"], summary["scaling_speedup_max"]) == tuple(two)
    assert {r["phase"] for r in chart if "phase" in r} == {"jobs (attempts, references)",
                                                          "ideal"}


def test_a_noisy_run_makes_the_verdict_no_measurable_speedup():
    """Planted: two runs at 2 workers measure 1.6x, a third (the machine busy) 0.65x: the
    median is 1.6x, but the spread covers 1.0, and the verdict says so; where every run agrees
    it says faster, or slower."""
    def runs(speedups):
        rows = []
        for repeat, speedup in enumerate(speedups, start=1):
            for workers, seconds in ((1, 60.0), (2, 60.0 / speedup)):
                rows.append({"workers": workers, "repeat": repeat, "run_dir": f"r{repeat}",
                             "throughput_jobs_per_min": 10 * 60 / seconds,
                             "jobs_makespan_s": seconds, "search_makespan_s": None,
                             "load_average": 1.0, "other_cpu_share": 0.1})
        return scaling_frame(rows)

    noisy = scaling_summary(runs([1.6, 0.65, 1.62])).row(1, named=True)
    assert noisy["scaling_speedup"] == pytest.approx(1.6)
    assert (noisy["scaling_speedup_min"], noisy["scaling_speedup_max"]) == pytest.approx(
        (0.65, 1.62))
    assert noisy["scaling_verdict"] == noisy["jobs_scaling_verdict"] == NO_SPEEDUP
    assert noisy["search_scaling_verdict"] is None  # no search ran
    assert scaling_summary(runs([1.6, 1.5, 1.7])).row(1, named=True)["scaling_verdict"] == "faster"
    assert scaling_summary(runs([0.7, 0.8, 0.9])).row(1, named=True)["scaling_verdict"] == "slower"
    assert scaling_summary(runs([1.6])).row(1, named=True)["scaling_verdict"] == (
        "one run: no spread")
    assert scaling_summary(runs([1.6, 0.65])).row(0, named=True)["scaling_verdict"] is None
    from quantdask.cli.commands import scaling_lines

    assert scaling_lines(scaling_summary(runs([1.6, 0.65, 1.62])), searched=False) == [
        "scaling: 2 workers, throughput: 1.60x median (0.65-1.62 over 3 runs): no measurable "
        "speed-up", "scaling: 2 workers, jobs: 1.60x median (0.65-1.62 over 3 runs): no "
        "measurable speed-up"]


def test_scaling_refuses_bad_counts_and_a_used_directory_before_running(mixed_run, tmp_path):
    for counts, field in (([0, 2], "workers"), ([2, 2], "workers"), ([], "workers")):
        with pytest.raises(SpecError) as error:
            scale_sweep(small_sweep(), tmp_path / "new", counts)
        assert error.value.field == field
    assert not (tmp_path / "new").exists()
    used = mixed_run / "scaling"
    before = {p: p.stat().st_mtime_ns for p in used.rglob("*") if p.is_file()}
    with pytest.raises(RunDirError, match="not empty"):
        scale_sweep(small_sweep(), used, [1])
    assert {p: p.stat().st_mtime_ns for p in used.rglob("*") if p.is_file()} == before


@pytest.fixture(scope="module")
def chromium():
    return require_chromium()


@pytest.fixture(scope="module")
def report_command(mixed_run, tmp_path_factory):
    """`quantdask report RUN_DIR -o FILE` into folders it makes first: (its status, FILE, what
    it printed). The report every test here reads: one run of the report notebook for all."""
    out = tmp_path_factory.mktemp("report") / "shared" / "new" / "report.html"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["report", str(mixed_run), "-o", str(out)])
    return status, out, printed.getvalue()


@pytest.fixture(scope="module")
def html_report(report_command):
    return report_command[1]


def test_report_html_is_self_contained(html_report, mixed_run):
    html = html_report.read_text(encoding="utf-8")
    # Nothing is fetched: no script, style or image comes from elsewhere.
    assert not re.findall(r"""<(?:script|link|img|iframe)[^>]+(?:src|href)=["']?https?:""",
                          html)
    assert html.count('class="quantdask-chart"') == CHARTS_IN_REPORT
    assert "Traceback" not in html  # no cell failed, and nothing printed a warning:
    assert 'data-mime-type="application/vnd.jupyter.stderr"' not in html
    for job_id in read_results(mixed_run)["job_id"]:
        assert job_id in html  # the report includes every job
    assert html_report.with_suffix(".ipynb").exists()  # the executed notebook, beside it


def test_report_renders_every_chart_offline_in_chromium(html_report, chromium, mixed_run):
    screenshot = mixed_run / "report.png"
    page = inspect_page(html_report, screenshot=screenshot, chromium=chromium)
    assert page.console_errors == [] and page.console_warnings == []
    assert page.network_requests == []
    assert len(page.charts) == CHARTS_IN_REPORT
    for chart in page.charts:
        assert chart["state"] == "rendered", chart
        assert chart["marks"] > 0 and chart["width"] > 100 and chart["height"] > 40, chart
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 50_000
    for heading in ("Which config to ship", "Task accuracy", "Generation speed", "Every job",
                    "Failed and skipped jobs", "Timeline",
                    "Memory", "Time per job", "Per-layer error", "Scaling"):
        assert heading in page.text
    # The jobs table holds every job, formatted for people: sizes in binary units, shares in
    # %, no Polars repr (its shape line and dtype row).
    every_job = page.text.split("Every job", 1)[1].split("Failed and skipped jobs", 1)[0]
    for label in ("baseline", "nf4", "int8 t=6", "ao int4wo"):
        assert label in every_job
    assert re.search(r"\d(\.\d)? (KiB|MiB|GiB)", every_job) and "%" in every_job
    assert "shape:" not in page.text and not DTYPE_ROW.search(page.text)
    print(f"screenshot: {screenshot}")


DTYPE_ROW = re.compile(r"^\s*(str|f64|i64|bool|datetime\[[^\]]*\])(\s+(str|f64|i64|bool|"
                       r"datetime\[[^\]]*\]))+\s*$", re.MULTILINE)


def test_every_table_of_the_report_is_formatted_for_people(html_report):
    """Each table of the exported report is a Great Tables table: no dtype row, no quotes
    around strings, labels in words, sizes in binary units and times with their unit."""
    html = html_report.read_text(encoding="utf-8")
    tables = re.findall(r'<table class="gt_table".*?</table>', html, re.DOTALL)
    assert len(tables) >= 5  # ties, every job, failures, the sweep, per device, ...
    assert "shape: (" not in html and '<table class="dataframe"' not in html
    for table in tables:
        cells = re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", table, re.DOTALL)
        assert not {"str", "f64", "i64", "bool"} & {c.strip() for c in cells}, table[:300]
        assert not any(c.strip().startswith('"') for c in cells), table[:300]
    jobs = next(t for t in tables if "bits / weight" in t)
    assert re.search(r"\d(\.\d)? (KiB|MiB|GiB)<", jobs) and re.search(r"\d+\.\d%<", jobs)
    assert re.search(r"\d(\.\d+)? (s|min)<", jobs)  # wall time with its unit


def test_a_chart_that_cannot_draw_is_caught_by_the_browser_check(tmp_path, chromium):
    # The check itself must fail on a broken chart, or a green test would mean nothing.
    from quantdask.report.html import _chart_html

    bundle = _chart_html({"$schema": "https://vega.github.io/schema/vega-lite/v5.json",
                          "mark": "bar"})["text/html"]
    page_path = tmp_path / "broken.html"
    page_path.write_text(f"<html><body>{bundle}</body></html>")  # no inline_charts() bundle
    page = inspect_page(page_path, chromium=chromium)
    assert [c["state"] for c in page.charts] == ["failed"]
    assert any("chart library not loaded" in e for e in page.console_errors)


def test_text_that_looks_like_html_cannot_break_a_chart_out_of_its_script(tmp_path, chromium):
    import vl_convert

    from quantdask.report.html import _chart_html

    nasty = "</script><script>window.broken = 1</script><!-- \" ' & done"
    chart = _chart_html({"$schema": "https://vega.github.io/schema/vega-lite/v6.json",
                         "title": nasty, "data": {"values": [{"a": nasty, "b": 1}]},
                         "mark": "bar", "encoding": {"x": {"field": "a", "type": "nominal"},
                                                     "y": {"field": "b", "type": "quantitative"}}})
    bundle = vl_convert.javascript_bundle()
    page_path = tmp_path / "nasty.html"
    page_path.write_text(f"<html><body><script>{bundle}</script>{chart['text/html']}"
                         "</body></html>")
    page = inspect_page(page_path, chromium=chromium)
    # Had the text ended the script, the chart's code would be cut short (a syntax error, the
    # chart never drawn); instead it is drawn, with the text shown as text.
    assert [c["state"] for c in page.charts] == ["rendered"]
    assert page.console_errors == []
    assert "</script><script>window.broken = 1</script>" in page.text


def test_log_scaled_quality_and_a_deep_heatmap_draw_in_chromium(tmp_path, chromium, mixed_run):
    """The exploded config's log scales (a zero KL has no place on them) and the 80-block
    heatmap draw in the report's browser without an error or a warning."""
    import vl_convert

    from quantdask.report.html import _chart_html

    results = read_results(mixed_run)
    charts = [_chart_html(chart.to_dict())["text/html"] for chart in (
        report.quality_chart(_exploded(results)),
        report.layer_error_heatmap(results, pl.DataFrame(_deep_layers(results))))]
    page_path = tmp_path / "charts.html"
    page_path.write_text(f"<html><body><script>{vl_convert.javascript_bundle()}</script>"
                         f"{''.join(charts)}</body></html>")
    page = inspect_page(page_path, chromium=chromium)
    assert [c["state"] for c in page.charts] == ["rendered", "rendered"]
    assert page.console_errors == [] and page.console_warnings == []
    assert all(chart["marks"] > 0 for chart in page.charts)
    assert page.charts[1]["height"] < 1100  # 81 rows, the pickers and the axis: one screen


NOTEBOOK_PARAMETERS = {
    "report": lambda run: {"run_dir": str(run)},
    "memory": lambda run: {"run_dir": str(run)},
    "quality": lambda run: {"run_dir": str(run)},
    "scaling": lambda run: {"scaling_dir": str(run / "scaling")},
    "compare": lambda run: {"run_a": str(run), "run_b": str(run)},  # (tests/test_compare.py)
}


def _outputs(nb) -> list[dict]:
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]


def test_every_notebook_is_tested():
    shipped = {p.stem for p in NOTEBOOKS_DIR.glob("*.ipynb")}
    assert shipped == set(NOTEBOOK_PARAMETERS) | {"quickstart"}


@pytest.mark.parametrize("name", sorted(NOTEBOOK_PARAMETERS))
def test_notebook_runs_green(name, mixed_run, html_report, tmp_path):
    if name == "report":  # the report command ran it on the same run (html_report), kept it
        nb = nbformat.read(html_report.with_suffix(".ipynb"), as_version=4)
    else:
        nb = execute_notebook(name, NOTEBOOK_PARAMETERS[name](mixed_run), cwd=tmp_path,
                              output=tmp_path / f"{name}.ipynb")
        assert nbformat.read(tmp_path / f"{name}.ipynb", as_version=4).cells
    outputs = _outputs(nb)
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if o.get("name") == "stderr"], "a warning was printed"
    charts = [o for o in outputs if "quantdask-chart" in o.get("data", {}).get("text/html", "")]
    assert charts, f"{name} drew no chart"


def test_quickstart_notebook_runs_a_sweep_on_its_own_cluster(tmp_path, write_sweep, cluster):
    """A real Jupyter kernel through the quickstart: the cell after submit_sweep completes
    while jobs still run (it shows fewer finished jobs than the sweep has), and the results
    the notebook waits for equal those of a blocking run of the same sweep."""
    run_dir = tmp_path / "quickstart"
    # A sweep file of its own (the baseline and nf4; the demo sweep's 7 jobs by default).
    sweep_file = write_sweep()
    nb = execute_notebook("quickstart", {"run_dir": str(run_dir), "workers": 2,
                                         "sweep_file": sweep_file}, cwd=tmp_path)
    assert not [o for o in _outputs(nb) if o.output_type == "error"]
    results = read_results(run_dir)
    assert results.height == 2 and (results["status"] == "done").all()
    text = json.dumps(nbformat.writes(nb))
    assert "2 jobs, 2 done." in text and "127.0.0.1" in text
    [partial] = re.findall(r"(\d+) of (\d+) jobs finished so far; still running: (\w+)", text)
    assert int(partial[0]) < int(partial[1]) == 2 and partial[2] == "True"
    blocking = run_sweep(load_sweep(sweep_file), tmp_path / "blocking", cluster.client)
    metrics = ["job_id", "status", "perplexity", "kl_divergence", "top1_agreement"]
    assert blocking.select(metrics).sort("job_id").equals(results.select(metrics).sort("job_id"))


def test_a_failing_notebook_names_the_cell(tmp_path, monkeypatch):
    import tempfile

    import psutil

    # The system's temporary folder, for this test (short: the kernel's sockets are in it)
    temporary = Path(tempfile.mkdtemp())
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    with pytest.raises(ReportError, match="holds no results"):
        execute_notebook("report", {"run_dir": str(tmp_path)}, cwd=tmp_path)
    # The kernel's sockets, its stderr and its connection file went with it, and so did the
    # kernel itself.
    assert list(temporary.iterdir()) == []
    temporary.rmdir()
    assert not [p for p in psutil.Process().children(recursive=True)
                if "quantdask.report.kernel" in " ".join(p.cmdline())]
    with pytest.raises(ReportError, match="no notebook 'nope'"):
        execute_notebook("nope")


def test_report_command_writes_the_html_where_asked(report_command, tmp_path, capsys):
    status, out, printed = report_command  # into folders it made first
    assert status == 0
    assert out.exists() and f"report: {out}" in printed
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no run directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    assert "not a run directory" in capsys.readouterr().err


@pytest.mark.parametrize("counts", ["0", "1,x", ""])
def test_scale_command_refuses_bad_worker_counts(counts, tmp_path, write_sweep, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["scale", write_sweep(), "--workers", counts, "--out", str(tmp_path / "s")])
    assert stop.value.code == 2
    assert "--workers" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_write_report_refuses_a_directory_without_results(tmp_path):
    with pytest.raises(ReportError, match="not a run directory"):
        write_report(tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_report_of_a_copied_run_dir_still_finds_its_scaling_runs(mixed_run, tmp_path):
    # Only the copy may exist while it is read: with the original still in place, a stale
    # absolute path to it would lead to real directories and pass.
    original = mixed_run / "scaling"
    moved = tmp_path / "moved"
    shutil.copytree(original, moved)
    aside = tmp_path / "original-moved-away"
    original.rename(aside)
    try:
        scaling = read_scaling(moved)
        assert scaling["workers"].to_list() == [1, 1, 2, 2]
        for row in scaling.to_dicts():
            assert Path(row["run_dir"]) == moved / f"workers-{row['workers']}-run-{row['repeat']}"
            assert read_results(row["run_dir"]).height == 2  # the baseline and nf4
            assert read_sessions(row["run_dir"])["workers"].to_list() == [row["workers"]]
    finally:
        aside.rename(original)  # the module's other tests read it


IRI_CHECK = """
import json, sys
from quantdask.report.kernel import leave_out_iri_checker
leave_out_iri_checker()
import altair as alt, jsonschema, nbformat
nbformat.validate(nbformat.read(sys.argv[1], as_version=4))
chart = alt.Chart(alt.Data(values=[{"x": 1}])).mark_point().encode(x="x:Q")
print(json.dumps({"chart": chart.to_dict()["mark"]["type"],
                  "iri_parser": sys.modules.get("rfc3987_syntax") is not None,
                  "format_checker": "date-time" in jsonschema.FormatChecker.checkers}))
"""


def test_the_iri_format_checker_is_left_out_and_notebooks_and_charts_still_validate():
    # quantdask's own processes (the command, the report kernel, the tests) skip the 2-4 s
    # import of rfc3987-syntax; jsonschema's other format checkers and altair's and nbformat's
    # validation work as before.
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", IRI_CHECK, str(NOTEBOOKS_DIR / "report.ipynb")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"chart": "point", "iri_parser": False,
                                      "format_checker": True}


def test_the_vega_bundle_is_built_once_per_vl_convert_version_and_kept_whole(tmp_path,
                                                                             monkeypatch):
    from importlib.metadata import version

    import vl_convert

    from quantdask.report.html import vega_bundle

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = []
    monkeypatch.setattr(vl_convert, "javascript_bundle",
                        lambda: built.append(1) or 'var a = "</script>";')
    assert vega_bundle() == 'var a = "<\\/script>";' == vega_bundle()  # a closing tag escaped
    assert built == [1]  # the second read the cache
    [cached] = (tmp_path / "quantdask").iterdir()
    assert version("vl-convert-python") in cached.name
    cached.write_text('var a = "cut sho')  # not a whole bundle (no end mark): built again
    assert vega_bundle() == 'var a = "<\\/script>";' and built == [1, 1]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))
    (tmp_path / "file").write_text("")  # a cache folder that cannot be made: built each time
    assert vega_bundle() == 'var a = "<\\/script>";' and built == [1, 1, 1]
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(Path, "home", lambda: (_ for _ in ()).throw(RuntimeError("no home")))
    assert vega_bundle() == 'var a = "<\\/script>";' and built == [1, 1, 1, 1]  # none kept
