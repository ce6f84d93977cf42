"""Artifacts: done jobs' quantized models saved, digested, reloaded and checked; the Pareto
frontier kept and the rest deleted; failures recorded without losing a result."""

from __future__ import annotations

import hashlib
import math
import os
import re
import shlex
import shutil
import subprocess

import polars as pl
import pytest

from quantdask.backends import get_backend
from quantdask.cli.main import main
from quantdask.demo_model import DEMO_MODEL_DIR
from quantdask.errors import SpecError
from quantdask.job.job import run_job
from quantdask.measure.reference import compute_reference
from quantdask.run.sweep import run_sweep
from quantdask.sweepfile.sweep import expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import REPO, sweep_dict

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
    # Dominated, computed here by docs/quality.md's rule (tied configs are not ranked).
    dominated = off_frontier(rows)
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


def test_the_workers_rule_refuses_only_a_local_unshared_path(tmp_path):
    local = sweep_from_dict(artifact_sweep(tmp_path / "models"))
    local.check_workers(None)  # every worker on this machine: any path
    with pytest.raises(SpecError) as refused:
        local.check_workers("the scheduler at tcp://127.0.0.1:9")
    assert refused.value.field == "artifacts.to"
    assert "tcp://127.0.0.1:9" in str(refused.value)
    assert "artifacts.shared: true" in str(refused.value)
    sweep_from_dict(artifact_sweep(tmp_path / "models", shared=True)).check_workers("--scheduler")
    sweep_from_dict(artifact_sweep("memory://models")).check_workers("--scheduler")


@pytest.mark.timeout(60)
def test_submit_sweep_on_a_scheduler_reached_by_address_refuses_a_local_path(cluster, tmp_path):
    """A notebook's client of a scheduler it did not start (by address, loopback or not) may
    have workers on other machines: the same rule as ``quantdask run --scheduler``, before
    anything is written. The session's own ``cluster.client`` (a LocalCluster of this process)
    saves to local paths in the tests above."""
    from distributed import Client

    import quantdask as qd

    sweep = sweep_from_dict(artifact_sweep(tmp_path / "models"))
    with Client(cluster.client.scheduler.address) as client:
        with pytest.raises(SpecError) as refused:
            qd.submit_sweep(sweep, tmp_path / "run", client)
    assert refused.value.field == "artifacts.to"
    assert f"the scheduler at {cluster.client.scheduler.address}" in str(refused.value)
    assert "artifacts.shared: true" in str(refused.value)
    assert not (tmp_path / "run").exists() and not (tmp_path / "models").exists()


# The reload check on a different model --------------------------------------------------------

def exact_kl(model, windows, reference_log_probs, compared: int | None = None) -> float:
    """KL(reference || model) per predicted token, in float64 over the whole vocabulary, on
    the first ``compared`` of ``windows`` (all by default; all go through the model in one
    batch: LLM.int8's output depends on what shares it)."""
    import torch

    with torch.inference_mode():
        log_q = torch.log_softmax(model(input_ids=windows).logits[:, :-1].double(), dim=-1)
    p = reference_log_probs.exp()
    return (p * (reference_log_probs - log_q)).sum(-1)[:compared].mean().item()


@pytest.mark.timeout(120)
def test_the_reload_check_of_a_different_saved_model_reports_that_models_difference(
        tmp_path, monkeypatch):
    """Where the saved directory holds another model than the one in memory, ``reload_kl_delta``
    is that model's KL minus the in-memory one's (computed here with plain transformers, exact
    float64 KL), not 0: the check looks at what was saved."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    import quantdask.job.artifacts as artifacts
    from quantdask.job.artifacts import VERIFY_WINDOWS

    data = sweep_dict(backends=[{"backend": "bitsandbytes", "configs": [BNB[0], BNB[3]]}],
                      artifacts={"keep": "done", "to": str(tmp_path / "models"),
                                 "verify": True})
    data["eval"]["kl_top_k"] = "all"
    jobs = {job.config_label: job for job in expand_grid(sweep_from_dict(data))}
    nf4, int8 = jobs["nf4"], jobs["int8 t=6"]
    text = nf4.eval.read_text()
    reference = compute_reference(nf4.model, nf4.eval, text)
    # int8 first, as the sweep would: its artifact is what nf4's reload is then pointed at.
    honest = run_job(int8, get_backend("bitsandbytes"), reference=reference).record
    assert honest["status"] == "done" and abs(honest["reload_kl_delta"]) < 1e-4
    other = tmp_path / "models" / int8.id
    publish = artifacts.publish

    def publish_then_swap(local, settings, job_id):
        publish(local, settings, job_id)
        return str(other)  # the reload now reads int8's saved model

    monkeypatch.setattr(artifacts, "publish", publish_then_swap)
    record = run_job(nf4, get_backend("bitsandbytes"), reference=reference).record
    assert record["status"] == "done", record.get("error_message")

    # The same difference, independently: plain transformers, the demo model's own log-probs,
    # on the first VERIFY_WINDOWS windows, which go through the models in the eval's first
    # batch (8 windows) as the score phase put them.
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    ids = tokenizer(text)["input_ids"][:nf4.eval.seq_len * nf4.eval.samples]
    assert nf4.eval.batch_size >= VERIFY_WINDOWS
    windows = torch.tensor(ids).view(nf4.eval.samples, nf4.eval.seq_len)[:nf4.eval.batch_size]
    fp32 = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    with torch.inference_mode():
        reference_log_probs = torch.log_softmax(fp32(input_ids=windows).logits[:, :-1].double(),
                                                dim=-1)
    in_memory = AutoModelForCausalLM.from_pretrained(
        DEMO_MODEL_DIR, dtype=torch.float32, device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32)).eval()
    reloaded = AutoModelForCausalLM.from_pretrained(other, device_map="cpu").eval()
    expected = (exact_kl(reloaded, windows, reference_log_probs, VERIFY_WINDOWS)
                - exact_kl(in_memory, windows, reference_log_probs, VERIFY_WINDOWS))
    assert abs(expected) > 1e-3  # int8 and nf4 differ far beyond the tolerance below
    assert record["reload_kl_delta"] == pytest.approx(expected, rel=1e-3, abs=1e-5)
    # And nf4's own artifact (saved before the swap) is the model it measured: a save must not
    # change it (bitsandbytes' CPU repacking, undone wrongly, once did, in memory too).
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / nf4.id,
                                                 device_map="cpu").eval()
    assert exact_kl(saved, windows, reference_log_probs) == pytest.approx(
        exact_kl(in_memory, windows, reference_log_probs), rel=1e-4)


# keep: pareto with two models ------------------------------------------------------------------

def off_frontier(rows: list[dict], per_model: bool = True) -> set[str]:
    """Job ids off the size/KL frontier, by docs/quality.md's rule: another job (of the same
    model, with ``per_model``) is no larger and lower in KL by more than their tie margin,
    2 sqrt(se_a^2 + se_b^2), or smaller and not higher by more than it (no ``kl_se``: every
    difference counts)."""
    def margin(a, b) -> float:
        return 2 * math.sqrt((a.get("kl_se") or 0.0) ** 2 + (b.get("kl_se") or 0.0) ** 2)

    return {a["job_id"] for a in rows if any(
        b is not a and (not per_model or b["model"] == a["model"]) and (
            (b["size_bytes"] <= a["size_bytes"]
             and b["kl_divergence"] < a["kl_divergence"] - margin(a, b))
            or (b["size_bytes"] < a["size_bytes"]
                and b["kl_divergence"] <= a["kl_divergence"] + margin(a, b)))
        for b in rows)}


@pytest.mark.timeout(300)
def test_with_two_models_each_keeps_its_own_frontier(cluster, tmp_path):
    """The demo model and a tiny Llama, smaller and flatter (lower KL) in every config: pooled,
    the tiny model's jobs would push every demo job off the frontier; kept per model, each
    model keeps exactly its own frontier, computed here from the results."""
    from tests.tiny_families import build_tiny

    data = sweep_dict(models=[{"name": "demo", "path": DEMO_MODEL_DIR},
                              {"name": "tiny", "path": str(build_tiny("llama",
                                                                      tmp_path / "tiny"))}],
                      backends=[{"backend": "bitsandbytes", "configs": [BNB[0], BNB[1], BNB[3]]}],
                      artifacts={"keep": "pareto", "to": str(tmp_path / "models")})
    results = run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client)
    assert set(results["status"]) == {"done"} and results.height == 8
    rows = results.to_dicts()
    kept = {r["job_id"] for r in rows if r["artifact_kept"]}
    for model in ("demo", "tiny"):
        own = [r for r in rows if r["model"] == model]
        frontier = {r["job_id"] for r in own} - off_frontier(own)
        assert {r["job_id"] for r in own if r["artifact_kept"]} == frontier, model
        assert frontier, model
    assert sorted(os.listdir(tmp_path / "models")) == sorted(kept)
    # The test means something: a frontier over both models would drop kept jobs (all of the
    # demo model's), and the models' frontiers differ from it.
    pooled_off = off_frontier(rows, per_model=False)
    demo_kept = {r["job_id"] for r in rows if r["model"] == "demo" and r["artifact_kept"]}
    assert demo_kept and demo_kept <= pooled_off


# The docs' recipe for artifact_sha256 -----------------------------------------------------------

DIGEST_RECIPE = re.compile(r"`(cd DIR && [^`]*sha256sum)`")


def installed_locale(name: str) -> bool:
    found = subprocess.run(["locale", "-a"], capture_output=True, text=True, check=False)
    wanted = name.lower().replace("-", "")
    return any(line.lower().replace("-", "") == wanted for line in found.stdout.split())


@pytest.mark.timeout(300)
def test_the_docs_recipe_recomputes_the_digest_under_a_non_c_locale(pareto_run):
    """docs/sweep-files.md's shell recipe, run as written (under en_US.UTF-8, whose collation
    orders ``tokenizer_config.json`` before ``tokenizer.json``: unlike C's and Python's) on a
    kept artifact, prints its ``artifact_sha256``."""
    if shutil.which("sha256sum") is None or not installed_locale("en_US.utf8"):
        pytest.skip("needs sha256sum and the en_US.UTF-8 locale (Debian: apt-get install "
                    "locales; localedef -i en_US -f UTF-8 en_US.UTF-8)")
    text = (REPO / "docs" / "sweep-files.md").read_text(encoding="utf-8")
    [recipe] = DIGEST_RECIPE.findall(text)
    models, results, _ = pareto_run
    row = results.filter(pl.col("artifact_kept")).row(0, named=True)
    directory = models / row["job_id"]
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(directory))
    command = " ".join(recipe.split()).replace("cd DIR", f"cd {shlex.quote(str(directory))}")
    env = {**os.environ, "LC_ALL": "en_US.UTF-8"}
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env,
                          check=True, timeout=60)
    assert done.stdout.split()[0] == row["artifact_sha256"], (command, done.stderr)
