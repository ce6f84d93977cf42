"""A sweep's mixed-precision search end to end on a real 2-slot cluster: probes on every
worker, the sensitivity and allocation frames, the verifying jobs beside the uniform configs,
predictions against measurements, and a rerun that probes nothing again."""

from __future__ import annotations

import time

import polars as pl
import pytest

from quantdask.demo_model import DEMO_MODEL_DIR
from quantdask.errors import SpecError
from quantdask.run.progress import SweepProgress
from quantdask.run.sweep import run_sweep, submit_sweep
from quantdask.store.readers import read_results
from quantdask.store.run_store import read_frame
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import calibration_file, sweep_dict

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def search_sweep(calibration: str, **search) -> dict:
    data = sweep_dict(calibration={"text": calibration, "samples": 8, "seq_len": 32})
    data["eval"].update(samples=32)
    data.pop("backends")
    data["searches"] = [{
        "name": "mix", "model": "demo", "backend": "hqq", "base": {"group_size": 32},
        "formats": {"b2": {"bits": 2}, "b3": {"bits": 3}, "b4": {"bits": 4}, "keep": None},
        # The demo model stores 6.69 bits per weight at 2 bits, 7.79 at 3 (its embeddings and
        # head stay float32).
        "budget": {"bits_per_weight": 7.2}, "frontier": [7.5], "candidates": 2,
        "windows": 32, "cells_per_task": 10,
        "tie": [["q_proj", "k_proj", "v_proj"]], "sensitivity": "kl", **search}]
    return data


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> str:
    return calibration_file(tmp_path_factory, 300, seed=11)


@pytest.fixture(scope="module")
def search_run(cluster, calibration, tmp_path_factory):
    """The search run through a handle, as from a notebook: the handle at once, the progress
    updates it sent, its results."""
    run_dir = tmp_path_factory.mktemp("search") / "run"
    updates: list[SweepProgress] = []
    handle = submit_sweep(sweep_from_dict(search_sweep(calibration)), run_dir, cluster.client,
                          on_progress=updates.append)
    at_once = (handle.done(), handle.progress.total)
    return run_dir, handle.wait(), updates, at_once, handle


@pytest.fixture(scope="module")
def searched(search_run):
    return search_run[:2]


def test_the_handle_returns_at_once_and_shows_the_probing(search_run):
    _, results, updates, (done, total), handle = search_run
    assert not done and total == 1  # the probes run behind the handle: the baseline alone
    probing = [u.probing["mix"] for u in updates if u.probing]
    assert probing and probing[0][1] == 28 * 4 + 3  # every unit x format, and (all) x 3
    assert [p for p, _ in probing] == sorted(p for p, _ in probing)  # cells counted up
    events = [e["text"] for e in updates[-1].events]
    assert "search  mix: 115 cells, 0 recorded earlier, 115 to probe" in events
    assert "search  mix: 115 of 115 cells probed" in events
    assert updates[-1].total == results.height and not updates[-1].probing
    assert "probing" not in handle.summary()


def test_every_cell_is_probed_once_on_the_workers(searched, cluster):
    run_dir, _ = searched
    frame = read_frame(run_dir, "sensitivity")
    cells = frame.filter((pl.col("format") != "rest") & (pl.col("unit") != "(all)"))
    units = cells["unit"].unique().to_list()
    assert len(units) == 28  # the demo model's 4 layers x 7 linears
    assert cells.height == len(units) * 4 and cells.select("unit", "format").is_unique().all()
    probed = cells.filter(pl.col("format") != "keep")
    assert (probed["kl"] > 0).all() and (probed["kl_se"] > 0).all()
    assert set(cells["worker"]) <= set(cluster.client.scheduler_info()["workers"])
    # Fewer bits, more KL and fewer bytes, unit by unit.
    wide = cells.pivot(on="format", index="unit", values=["kl", "bytes"])
    assert (wide["kl_b2"] > wide["kl_b3"]).all() and (wide["kl_b3"] > wide["kl_b4"]).all()
    assert (wide["bytes_b2"] < wide["bytes_b3"]).all()
    assert (wide["bytes_b4"] < wide["bytes_keep"]).all()


def test_the_time_account_holds_the_probes_beside_the_jobs(searched, cluster):
    """Every task the search ran on a worker is recorded (worker_tasks frame) and counted in
    the sweep's and each device's time; the probes' spans hold the seconds each cell's probe
    measured inside them (the sensitivity frame's, timed apart on the worker)."""
    from quantdask.store.readers import read_attempts, read_sessions, read_worker_tasks
    from quantdask.store.summary import device_summary, sweep_summary

    run_dir, results = searched
    tasks, attempts = read_worker_tasks(run_dir), read_attempts(run_dir)
    kinds = tasks.group_by("kind").len().sort("kind")
    # The units, the search's reference, 12 chunks of at most 10 of the 112 unit cells and
    # one per whole format (3), and the model's reference for its jobs (its windows part and
    # the task joining the parts).
    counts = dict(kinds.iter_rows())
    assert (counts["search units"], counts["search reference"], counts["probe"]) == (1, 1, 15)
    assert counts["reference"] >= 2 and set(tasks["status"]) == {"done"}
    names = {str(w["name"]) for w in cluster.client.scheduler_info()["workers"].values()}
    assert set(tasks["worker"]) <= names
    assert (tasks["finished_at"] >= tasks["started_at"]).all()
    seconds = (tasks["finished_at"] - tasks["started_at"]).dt.total_microseconds() / 1e6
    probes = seconds.filter(tasks["kind"] == "probe").sum()
    cells = read_frame(run_dir, "sensitivity")["seconds"].sum()
    assert 0 < cells <= probes
    row = sweep_summary(attempts, read_sessions(run_dir), tasks).row(-1, named=True)
    tried = (attempts["finished_at"] - attempts["started_at"]).dt.total_microseconds() / 1e6
    assert row["work_s"] == pytest.approx(tried.sum() + seconds.sum(), rel=1e-9)
    assert row["tasks"] == tasks.height and row["attempts"] == attempts.height
    searching = tasks["kind"].is_in(["search units", "search reference", "probe"])
    assert row["search_work_s"] == pytest.approx(seconds.filter(searching).sum(), rel=1e-9)
    assert row["search_speedup"] > 0 and row["jobs_speedup"] > 0
    # The probing ends before the jobs start: the makespan spans both phases, one after the other.
    assert row["makespan_s"] >= row["search_makespan_s"] + row["jobs_makespan_s"] - 1e-6
    devices = device_summary(results, None, attempts, tasks)
    assert devices["tasks"].sum() == tasks.height
    assert devices["busy_s"].sum() >= row["search_work_s"] / 2  # probes share no worker


def test_the_verifying_jobs_keep_their_budget_and_their_prediction(searched):
    run_dir, results = searched
    ours = results.filter(pl.col("search") == "mix")
    assert set(ours["status"]) == {"done"}, ours.select("config_label", "error_message").rows()
    roles = dict(ours.group_by("search_role").len().rows())
    assert roles["uniform"] == 3 and roles["mixed"] == 4  # 2 budgets x 2 candidates
    for row in ours.to_dicts():
        # The stored size is what the probes predicted, byte for byte, within the budget.
        assert row["size_bytes"] == row["predicted_bytes"], row["config_label"]
        assert row["bits_per_weight"] <= row["search_budget_bits_per_weight"] + 1e-9
    mixed = ours.filter(pl.col("search_role") == "mixed").sort("search_budget_bits_per_weight",
                                                                "search_candidate")
    assert mixed.select("search_budget_bits_per_weight", "search_candidate").rows() == [
        (7.2, 1), (7.2, 2), (7.5, 1), (7.5, 2)]
    for budget in (7.2, 7.5):  # the second candidate is another allocation, predicted worse
        first, second = mixed.filter(pl.col("search_budget_bits_per_weight") == budget
                                     ).to_dicts()
        assert first["job_id"] != second["job_id"]
        assert first["predicted_kl"] <= second["predicted_kl"]
    # Predicted (calibration windows) and measured (eval windows) agree within 30 %.
    for row in ours.filter(pl.col("search_role") != "uniform").to_dicts():
        assert row["predicted_kl"] == pytest.approx(row["kl_divergence"], rel=0.3), row
    allocation = read_frame(run_dir, "allocation")
    assert set(allocation["job_id"]) == set(ours["job_id"])
    tied = allocation.filter(pl.col("unit").str.contains(r"\.(q|k|v)_proj$"))
    per_layer = tied.with_columns(pl.col("unit").str.extract(r"layers\.(\d+)").alias("layer"))
    assert (per_layer.group_by("job_id", "layer").agg(pl.col("format").n_unique())
            ["format"] == 1).all()
    # how well the predictions held, and what the mix ships as (hqq: why no file)
    from quantdask.report.search import agreement_table

    [agreement] = agreement_table(results).to_dicts()
    assert agreement["jobs"] == ours.height and agreement["spearman"] > 0.8
    assert not agreement["proxy"] and agreement["measured_in"] == "torch"
    assert agreement["file"].startswith("not saved as a file") and "tag" in agreement["file"]
    assert set(allocation["predicted_in"]) == {"torch"}


def test_mixed_is_never_worse_than_uniform_at_equal_bytes(searched):
    run_dir, results = searched
    by_id = {row["job_id"]: row for row in results.to_dicts()}
    allocation = read_frame(run_dir, "allocation")
    equal = allocation.filter(pl.col("role") == "equal-bytes")
    uniform = allocation.filter(pl.col("role") == "uniform")
    assert equal["budget_bytes"].n_unique() == uniform["job_id"].n_unique() == 3
    for budget in uniform["budget_bytes"].unique().to_list():
        [plain] = uniform.filter(pl.col("budget_bytes") == budget)["job_id"].unique()
        [mixed] = equal.filter(pl.col("budget_bytes") == budget)["job_id"].unique()
        plain_row, mixed_row = by_id[plain], by_id[mixed]  # the same job where it chose so
        assert mixed_row["size_bytes"] <= plain_row["size_bytes"] == budget
        assert mixed_row["predicted_kl"] <= plain_row["predicted_kl"] + 1e-12
        # Measured on the eval windows: not worse beyond the two error bars.
        slack = 2 * (mixed_row["kl_se"] ** 2 + plain_row["kl_se"] ** 2) ** 0.5
        assert mixed_row["kl_divergence"] <= plain_row["kl_divergence"] + slack


def test_a_rerun_probes_only_what_is_missing_and_picks_the_same_allocation(
        searched, cluster, calibration):
    run_dir, results = searched
    before = read_frame(run_dir, "sensitivity")
    again = run_sweep(sweep_from_dict(search_sweep(calibration)), run_dir, cluster.client)
    assert read_frame(run_dir, "sensitivity").equals(before)  # nothing probed again
    assert sorted(again["job_id"]) == sorted(results["job_id"])
    # A search stopped mid-probing leaves some chunks written whole and others not at all.
    parts = sorted((run_dir / "sensitivity").glob("mix-*.parquet"))
    lost, kept = parts[:2], parts[2:]
    stamps = {p: p.stat().st_mtime_ns for p in kept}
    missing = pl.concat([pl.read_parquet(p) for p in lost]).select("unit", "format")
    for part in lost:
        part.unlink()
    rerun = run_sweep(sweep_from_dict(search_sweep(calibration)), run_dir, cluster.client)
    assert {p: p.stat().st_mtime_ns for p in kept} == stamps
    after = read_frame(run_dir, "sensitivity")
    new = set(after.select("unit", "format").rows()) - set(
        before.join(missing, on=["unit", "format"], how="anti").select("unit", "format").rows())
    assert new == set(missing.rows())
    assert after.height == before.height
    assert sorted(rerun["job_id"]) == sorted(results["job_id"])
    assert read_results(run_dir).height == results.height


def test_the_answer_is_the_mix_that_measured_least_beside_the_uniform_within_its_budget(
        searched):
    """``search.answer`` from the run's records: per budget, the verified mix that measured
    the least KL, the largest uniform format within the budget and the mix at its bytes (at
    b2's, the least a unit takes, that is b2 everywhere: the uniform job itself), and why the
    hqq mix is no file; the terminal's lines say the same."""
    from quantdask.cli.summary import answer_lines
    from quantdask.search.answer import search_answers

    run_dir, results = searched
    answers = search_answers(results, read_frame(run_dir, "allocation"), run_dir)
    assert answers["budget_bits_per_weight"].to_list() == [7.2, 7.5]
    by_id = {row["job_id"]: row for row in results.to_dicts()}
    for row in answers.to_dicts():
        mixed = results.filter((pl.col("search_role") == "mixed") & (
            pl.col("search_budget_bits_per_weight") == row["budget_bits_per_weight"]))
        assert mixed.height == 2 and row["ship_kl"] == mixed["kl_divergence"].min()
        ship = by_id[row["ship_job_id"]]
        assert (row["ship_label"], row["ship_kl_se"]) == (ship["config_label"], ship["kl_se"])
        assert row["ship_bits_per_weight"] <= row["budget_bits_per_weight"]
        # b3 stores 7.79 bits per weight, b2 6.69: b2 is the largest uniform within both
        uniform = by_id[row["uniform_job_id"]]
        assert (row["uniform_format"], row["uniform_config"]) == ("b2", "hqq 2b g32")
        assert (row["uniform_label"], row["uniform_kl"]) == ("mix uniform b2",
                                                             uniform["kl_divergence"])
        assert row["equal_job_id"] == row["uniform_job_id"]
        assert row["file"].startswith("not saved as a file") and "tag" in row["file"]
    lines = answer_lines(run_dir, results)
    assert len(lines) == 2 * 3 and lines[0].startswith(
        "answer: at 7.2 bits/weight (whole model; search mix, demo), ship mix 7.2b #")
    assert lines[1].startswith("  uniform b2 (hqq 2b g32), the largest within the budget: KL ")
    assert lines[2].startswith("  its file: not saved as a file: ")


def fragile_model(directory) -> str:
    """The demo model with one fragile unit made without changing its function (the design
    note's construction): in layer 2's MLP, one input column of down_proj per group of 32 times
    64, and the matching output row of up_proj divided by 64. The logits stay the same; the
    group that column falls in is quantized 64 times coarser."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.tiny_families import copy_demo_tokenizer

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR)
    probe = torch.arange(40).reshape(2, 20) + 5
    with torch.no_grad():
        before = model(input_ids=probe).logits
        mlp = model.model.layers[2].mlp
        columns = torch.arange(0, mlp.down_proj.in_features, 32)
        mlp.down_proj.weight[:, columns] *= 64
        mlp.up_proj.weight[columns, :] /= 64
        assert torch.allclose(model(input_ids=probe).logits, before, rtol=1e-4, atol=1e-4)
    model.save_pretrained(directory)
    copy_demo_tokenizer(directory)
    return str(directory)


@pytest.fixture(scope="module")
def fragile(cluster, calibration, tmp_path_factory):
    root = tmp_path_factory.mktemp("fragile")
    data = search_sweep(calibration, model="fragile", tie=[],
                        formats={"b2": {"bits": 2}, "b3": {"bits": 3}, "b4": {"bits": 4},
                                 "b8": {"bits": 8}})
    data["models"] = [{"name": "fragile", "path": fragile_model(root / "model")}]
    results = run_sweep(sweep_from_dict(data), root / "run", cluster.client)
    return root / "run", results


def test_a_fragile_unit_ranks_first_gets_more_bits_and_halves_the_kl(fragile):
    run_dir, results = fragile
    unit = "model.layers.2.mlp.down_proj"
    cells = read_frame(run_dir, "sensitivity").filter(pl.col("layer") >= 0)
    for label in ("b2", "b3"):
        ranked = cells.filter(pl.col("format") == label).sort("kl", descending=True)
        assert ranked["unit"][0] == unit, ranked.head(3)
    allocation = read_frame(run_dir, "allocation")
    by_id = {row["job_id"]: row for row in results.to_dicts()}
    for label in ("b3", "b4"):
        uniform = allocation.filter((pl.col("role") == "uniform")
                                    & (pl.col("format") == label))
        [plain] = uniform["job_id"].unique()
        budget = by_id[plain]["size_bytes"]
        mixed = allocation.filter((pl.col("role") == "equal-bytes")
                                  & (pl.col("budget_bytes") == budget))
        formats = dict(mixed.select("unit", "format").rows())
        bits = {"b2": 2, "b3": 3, "b4": 4, "b8": 8}
        assert bits[formats[unit]] > bits[label]  # the fragile unit gets more bits
        mixed_row, plain_row = by_id[mixed["job_id"][0]], by_id[plain]
        assert mixed_row["size_bytes"] <= budget  # the budget held
        assert mixed_row["kl_divergence"] <= 0.5 * plain_row["kl_divergence"], label
        # Not a tie: apart by more than twice their joint standard error.
        gap = plain_row["kl_divergence"] - mixed_row["kl_divergence"]
        assert gap > 2 * (mixed_row["kl_se"] ** 2 + plain_row["kl_se"] ** 2) ** 0.5


def test_plan_says_what_the_search_will_do(calibration, write_sweep, capsys):
    from quantdask.cli.main import main

    assert main(["plan", write_sweep(search_sweep(calibration))]) == 0
    shown = capsys.readouterr().out
    assert ("search mix: demo, hqq formats b2, b3, b4, keep per linear unit, on 32 calibration "
            "windows; budget 7.2 bits per weight (frontier: 7.5), 2 candidate(s) each") in shown


def test_bad_searches_are_refused_naming_the_field(calibration):
    for bad, field in (({"formats": {"b5": {"bits": 5}}}, "searches[0].formats.b5.bits"),
                       ({"budget": {"bits_per_weight": -1}}, "searches[0].budget.bits_per_weight"),
                       ({"model": "nope"}, "searches[0].model"),
                       ({"granularity": "block"}, "searches[0].tie"),
                       ({"backend": "bitsandbytes"}, "searches[0].backend")):
        with pytest.raises(SpecError) as error:
            sweep_from_dict(search_sweep(calibration, **bad))
        assert error.value.field == field, (bad, error.value.field)
    data = search_sweep(calibration)
    data.pop("calibration")
    with pytest.raises(SpecError, match="add a calibration block"):
        sweep_from_dict(data)
    assert DEMO_MODEL_DIR


def small_search(calibration: str, faults: list[dict]) -> dict:
    """A search of 9 cells in 3 chunks (4 blocks x b4 and keep, and b4 everywhere) with
    ``faults`` injected into its probe chunks."""
    data = search_sweep(calibration, formats={"b4": {"bits": 4}, "keep": None},
                        granularity="block", tie=[], budget={"bits_per_weight": 12},
                        frontier=[], candidates=1, windows=8, cells_per_task=4)
    data.update(retries=1, retry_backoff_s=0.05, faults=faults)
    data["eval"].update(samples=8)
    return data


def test_probe_failures_are_retried_by_class_and_past_the_retries_stop_the_search(
        cluster, calibration, tmp_path, caplog):
    from quantdask.search.probe_runs import ProbeFailed

    run_dir = tmp_path / "run"
    raising = [{"config": "search:mix", "kind": "raise", "attempt": n} for n in (1, 2)]
    with pytest.raises(ProbeFailed, match=r"search mix: probe chunk \d of 3 failed 2 times, "
                                          "last as job_error: RuntimeError: injected fault"):
        run_sweep(sweep_from_dict(small_search(calibration, raising)), run_dir, cluster.client)
    assert read_results(run_dir).height == 0  # no job ran; the directory is free again
    oom = [{"config": "search:mix", "kind": "oom", "attempt": 1}]
    with caplog.at_level("WARNING", logger="quantdask.driver"):
        results = run_sweep(sweep_from_dict(small_search(calibration, oom)), run_dir,
                            cluster.client)
    retried = [r.getMessage() for r in caplog.records if "out_of_memory" in r.getMessage()]
    assert len(retried) == 3 and all("attempt 1" in line for line in retried)
    cells = read_frame(run_dir, "sensitivity").filter(pl.col("format") != "rest")
    assert cells.height == 9 and cells["kl"].is_not_null().all()
    assert (results["status"] == "done").all() and results.height >= 2


def test_a_search_cancelled_while_probing_stops_there_and_runs_no_job(
        cluster, calibration, tmp_path):
    slow = [{"config": "search:mix", "kind": "slow", "attempt": 1}]
    handle = submit_sweep(sweep_from_dict(small_search(calibration, slow)), tmp_path / "run",
                          cluster.client)
    while not handle.progress.probing and not handle.done():
        time.sleep(0.05)
    assert handle.cancel() == []
    progress = handle.progress
    assert progress.finished and not progress.completed and progress.running == {}
    assert read_results(tmp_path / "run").height == 0
    probed = read_frame(tmp_path / "run", "sensitivity").filter(pl.col("format") != "rest")
    assert probed.height < 9  # stopped before the last chunk; a rerun probes the rest


def test_a_torchao_search_verifies_its_mix_as_predicted(cluster, calibration, tmp_path):
    data = small_search(calibration, [])
    data["searches"][0].update(
        backend="torchao", base={},
        formats={"i8": {"mode": "int8_weight_only"},
                 "i4": {"mode": "int4_weight_only", "group_size": 32}, "keep": None},
        budget={"bits_per_weight": 8.6}, granularity="linear", cells_per_task=16, windows=32)
    data["eval"].update(samples=32)
    results = run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client)
    assert (results["status"] == "done").all()
    mixed = results.filter(pl.col("search_role") == "mixed").to_dicts()
    [row] = mixed
    assert row["config_label"] == "mix 8.6b #1"
    assert row["size_bytes"] <= row["search_budget_bits_per_weight"] * row["param_count"] / 8
    assert row["kl_divergence"] == pytest.approx(row["predicted_kl"], rel=0.3)  # 2% here
    assert row["size_bytes"] == row["predicted_bytes"]  # the cells' bytes add up exactly
    allocation = read_frame(tmp_path / "run", "allocation").filter(pl.col("role") == "mixed")
    assert set(allocation["format"]) >= {"i8", "i4"}  # a real mix at this budget
    # its int4 layers cannot be saved on the CPU: the export says why, writing nothing
    from quantdask.search.export import export_allocation

    with pytest.raises(SpecError, match="torchao cannot write this allocation.*int4 on the CPU"):
        export_allocation(tmp_path / "run", "mix", 8.6, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_torchao_mix_of_int8_and_kept_modules_exports_as_a_checkpoint_transformers_loads(
        tmp_path):
    """torchao's per-module configs (FqnToConfig) through transformers' quantizer: the saved
    checkpoint reloads with plain from_pretrained to the model the job measures, logit for
    logit; int4 on the CPU is refused with the reason (torchao cannot save it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantdask.backends import get_backend
    from quantdask.backends.torchao import INT4_UNSAVED, export_mix, quantize_torchao
    from quantdask.errors import UnsupportedHere
    from quantdask.process.model_source import load_model_source
    from quantdask.sweepfile.sweep import expand_grid

    torchao = get_backend("torchao")
    [job] = [j for j in expand_grid(sweep_from_dict(sweep_dict())) if j.is_baseline]
    layers = [f"model.layers.{i}.{part}" for i in range(4)
              for part in ("self_attn.q_proj", "mlp.down_proj")]
    options = torchao.normalize({"mode": "int8_weight_only", "modules": {
        **{name: None for name in layers[::2]}}}, "options")
    written = export_mix(job.model, options, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(written.parent, device_map="cpu").eval()
    in_memory = quantize_torchao(load_model_source(job.model), options, "cpu").eval()
    windows = torch.randint(0, 200, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(reloaded(windows).logits, in_memory(windows).logits)
    kept = reloaded.get_submodule(layers[0]).weight
    assert type(kept) is torch.nn.Parameter  # a kept module stays in full precision
    assert type(reloaded.get_submodule(layers[1]).weight).__name__ == "Int8Tensor"
    mixed = torchao.normalize({"mode": "int8_weight_only", "modules": {
        layers[1]: {"mode": "int4_weight_only", "group_size": 32}}}, "options")
    with pytest.raises(UnsupportedHere, match="int4 on the CPU"):
        export_mix(job.model, mixed, tmp_path / "int4")
    assert INT4_UNSAVED.startswith("torchao's int4")
