"""Artifacts: done jobs' quantized models saved, digested, reloaded and checked; the Pareto
frontier kept and the rest deleted; failures recorded without losing a result."""

from __future__ import annotations

import hashlib
import os

import polars as pl
import pytest

from quantdask.backends import get_backend
from quantdask.cli.main import main
from quantdask.demo_model import DEMO_MODEL_DIR
from quantdask.driver.sweep import run_sweep
from quantdask.errors import SpecError
from quantdask.spec.sweep import expand_grid
from quantdask.spec.sweep_file import sweep_from_dict
from quantdask.worker.job import run_job
from quantdask.worker.reference import compute_reference
from tests.conftest import sweep_dict

pytestmark = pytest.mark.timeout(300)

BNB = [{"bits": 4, "quant_type": "nf4"}, {"bits": 4, "quant_type": "fp4"},
       {"bits": 4, "quant_type": "nf4", "double_quant": True}, {"bits": 8}]


def artifact_sweep(to, **artifacts) -> dict:
    return sweep_dict(backends=[{"backend": "bitsandbytes", "configs": BNB}],
                      artifacts={"keep": "done", "to": str(to), "verify": True, **artifacts})


def manifest_digest(directory) -> tuple[str, int]:
    """The README's recipe, computed here: sha256 of sorted "<path> <sha256>" lines."""
    lines, size = [], 0
    for base, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                data = f.read()
            lines.append(f"{os.path.relpath(path, directory)} {hashlib.sha256(data).hexdigest()}\n")
            size += len(data)
    return hashlib.sha256("".join(sorted(lines)).encode()).hexdigest(), size


def test_artifact_settings_are_checked_and_not_part_of_the_ids(tmp_path):
    for bad, field in (({"keep": "best"}, "artifacts.keep"), ({}, "artifacts.to"),
                       ({"verify": "yes"}, "artifacts.verify"),
                       ({"colour": 1}, "artifacts.colour")):
        data = artifact_sweep(tmp_path, **bad)
        if not bad:
            del data["artifacts"]["to"]
        with pytest.raises(SpecError) as err:
            sweep_from_dict(data)
        assert err.value.field == field
    with_artifacts = [j.id for j in expand_grid(sweep_from_dict(artifact_sweep(tmp_path)))]
    without = sweep_dict(backends=[{"backend": "bitsandbytes", "configs": BNB}])
    assert with_artifacts == [j.id for j in expand_grid(sweep_from_dict(without))]


@pytest.fixture(scope="module")
def pareto_run(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    sweep = sweep_from_dict(artifact_sweep(root / "models", keep="pareto"))
    results = run_sweep(sweep, root / "run", cluster.client)
    return root / "models", results, root / "run"


def test_pareto_keeps_exactly_the_undominated_artifacts(pareto_run):
    models, results, _ = pareto_run
    assert set(results["status"]) == {"done"} and results.height == len(BNB) + 1
    rows = results.to_dicts()
    # Dominated, computed here: another job no larger and no worse, better in one.
    dominated = {r["job_id"] for r in rows if any(
        o["size_bytes"] <= r["size_bytes"] and o["kl_divergence"] <= r["kl_divergence"]
        and (o["size_bytes"] < r["size_bytes"] or o["kl_divergence"] < r["kl_divergence"])
        for o in rows)}
    assert dominated and len(dominated) < len(rows)  # the test means something
    assert {r["job_id"] for r in rows if not r["artifact_kept"]} == dominated
    assert sorted(os.listdir(models)) == sorted(r["job_id"] for r in rows
                                                if r["job_id"] not in dominated)
    for row in rows:  # what was made stays on record, kept or not
        assert row["artifact_uri"] == str(models / row["job_id"])
        assert row["artifact_error"] is None and len(row["artifact_sha256"]) == 64


def test_a_kept_artifact_is_what_the_result_says_and_reloads_the_same(pareto_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    models, results, _ = pareto_run
    for row in results.filter(pl.col("artifact_kept")).to_dicts():
        directory = models / row["job_id"]
        assert manifest_digest(directory) == (row["artifact_sha256"], row["artifact_bytes"])
        assert abs(row["reload_kl_delta"]) < 1e-4  # the reloaded model measures the same
        assert (directory / "tokenizer.json").exists()
    kept = results.filter(pl.col("artifact_kept") & (pl.col("backend") == "bitsandbytes"))
    assert kept.height  # the frontier holds a quantized config: load it as a user would
    row = kept.row(0, named=True)
    model = AutoModelForCausalLM.from_pretrained(models / row["job_id"])
    config = model.config.quantization_config
    assert (config.load_in_4bit, config.load_in_8bit) == (row["config_label"] != "int8 t=6",
                                                          row["config_label"] == "int8 t=6")
    # The tokenizer saved beside it is the model's own: the same ids for the same text.
    saved = AutoTokenizer.from_pretrained(models / row["job_id"])
    original = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    text = "The quick brown fox jumps over the lazy dog."
    assert saved.vocab_size == original.vocab_size
    assert saved(text)["input_ids"] == original(text)["input_ids"]


def test_the_report_shows_each_saved_model_and_its_reload_check(pareto_run):
    from quantdask import report
    from quantdask.report.html import write_report

    _, results, run_dir = pareto_run
    table = report.artifacts_table(results)
    assert table.height == results.height  # every done job made one
    assert table["reload_kl_delta"].null_count() == 0
    assert table.filter(~pl.col("artifact_kept"))["job_id"].len() > 0
    html = write_report(run_dir).read_text()
    assert "Saved models" in html and "reload_kl_delta" in html
    assert all(job_id in html for job_id in table["job_id"])


@pytest.fixture(scope="module")
def hqq_job_and_reference(tmp_path_factory):
    data = sweep_dict(backends=[{"backend": "hqq", "configs": [{"bits": 4}]}])
    job = expand_grid(sweep_from_dict(data))[1]
    return data, compute_reference(job.model, job.eval, job.eval.read_text())


def test_a_failed_save_keeps_the_result_unless_artifacts_are_required(tmp_path,
                                                                      hqq_job_and_reference):
    data, reference = hqq_job_and_reference
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    data = {**data, "backends": [{"backend": "bitsandbytes", "configs": [BNB[0]]}],
            "artifacts": {"keep": "done", "to": str(blocked / "models")}}
    job = expand_grid(sweep_from_dict(data))[1]
    outcome = run_job(job, get_backend(job.backend), reference=reference)
    record = outcome.record
    assert record["status"] == "done" and record["perplexity"] > 1
    assert record["artifact_error"].startswith(("NotADirectoryError", "FileExistsError"))
    assert "artifact not kept" in outcome.log
    data["artifacts"]["required"] = True
    job = expand_grid(sweep_from_dict(data))[1]
    record = run_job(job, get_backend(job.backend), reference=reference).record
    assert (record["status"], record["failure_class"]) == ("failed", "job_error")


def test_a_backend_without_a_save_format_says_so(tmp_path, hqq_job_and_reference):
    data, reference = hqq_job_and_reference
    job = expand_grid(sweep_from_dict({**data, "artifacts": {"keep": "done",
                                                             "to": str(tmp_path)}}))[1]
    record = run_job(job, get_backend("hqq"), reference=reference).record
    assert record["status"] == "done"
    assert record["artifact_error"] == ("RuntimeError: hqq models have no save format "
                                        "quantdask can reload yet")
    assert os.listdir(tmp_path) == []


def test_a_local_artifact_path_with_a_scheduler_is_refused_unless_shared(write_sweep, tmp_path,
                                                                         capsys):
    sweep = write_sweep(artifact_sweep(tmp_path / "models"))
    assert main(["run", sweep, "--scheduler", "tcp://127.0.0.1:9", "--run-dir",
                 str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "artifacts.to" in err and "artifacts.shared: true" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "models").exists()
