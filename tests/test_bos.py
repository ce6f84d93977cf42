"""A BOS token per eval window (``eval.bos``), checked against a computation of our own.

The model whose tokenizer adds a BOS is the demo model with a Llama-3/Gemma-style tokenizer.json
(a ``TemplateProcessing`` post-processor puts ``<s>`` before every plain encode), built here.
The independent side uses plain transformers only: the text encoded without special tokens,
cut into windows of ``seq_len - 1`` tokens, each behind the BOS; the fp4 model through
transformers' own ``BitsAndBytesConfig``; perplexity and KL(fp || fp4) in float64 over every
position but the BOS's target (nothing predicts the BOS).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from quantdask.backends import get_backend
from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR
from quantdask.errors import SpecError
from quantdask.job.job import run_job
from quantdask.sweepfile.bos import window_bos
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.settings import EvalSettings
from quantdask.sweepfile.sweep import BackendBlock, Sweep, expand_grid, job_identity
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import sweep_dict
from tests.test_quality_independent import fp_and_fp4_log_probs
from tests.tiny_families import demo_model_with_bos

pytestmark = pytest.mark.timeout(180)

SEQ_LEN, SAMPLES = 48, 6
REL = 1e-4  # float32 logits (quantdask) against float64 sums (here)


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory) -> str:
    return demo_model_with_bos(tmp_path_factory.mktemp("bos") / "llama3-style")


def _sweep(path: str, bos: str = "auto", **eval_options) -> Sweep:
    return Sweep(name="bos", models=[ModelSpec(path=path)],
                 backends=[BackendBlock("bitsandbytes", configs=[{"bits": 4,
                                                                  "quant_type": "fp4"}])],
                 eval=EvalSettings(text=DEMO_EVAL_TEXT, seq_len=SEQ_LEN, samples=SAMPLES,
                                   kl_top_k="all", bos=bos, **eval_options))


def test_auto_follows_the_tokenizer_and_always_needs_a_bos_token(bos_model, tmp_path):
    assert window_bos("auto", ModelSpec(path=bos_model)) == 1  # its tokenizer adds <s>
    assert window_bos("auto", ModelSpec(path=DEMO_MODEL_DIR)) is None  # has <s>, never adds it
    assert window_bos("always", ModelSpec(path=DEMO_MODEL_DIR)) == 1
    assert window_bos("never", ModelSpec(path=bos_model)) is None
    qwen_style = demo_model_with_bos(tmp_path / "no-bos", adds_bos=False, has_bos=False)
    assert window_bos("auto", ModelSpec(path=qwen_style)) is None
    with pytest.raises(SpecError) as refused:  # before anything runs: when the jobs are made
        expand_grid(_sweep(qwen_style, bos="always"))
    assert refused.value.field == "eval.bos" and "bos_token_id is None" in str(refused.value)
    with pytest.raises(SpecError) as unknown:
        sweep_from_dict(sweep_dict(eval={"text": DEMO_EVAL_TEXT, "bos": "yes"}))
    assert unknown.value.field == "eval.bos" and "auto, always, never" in str(unknown.value)
    with pytest.raises(SpecError) as resolved_only:  # resolved per model, never written
        sweep_from_dict(sweep_dict(eval={"text": DEMO_EVAL_TEXT, "bos_token_id": 1}))
    assert resolved_only.value.field == "eval.bos_token_id"


def test_a_model_without_a_bos_keeps_its_ids_and_one_with_it_gets_new_ones(bos_model):
    plain = _sweep(DEMO_MODEL_DIR)
    for job in expand_grid(plain):  # as before eval.bos existed: the sweep's own eval
        old = job_identity(job.model, job.backend, job.options, plain.eval, plain.seed)
        assert job.eval.bos_token_id is None and job.eval.identity() == plain.eval.identity()
        assert "bos_token_id" not in old["eval"]
    with_bos = _sweep(bos_model)
    never = _sweep(bos_model, bos="never")
    ids = {job.id for job in expand_grid(with_bos)}
    assert ids.isdisjoint(job.id for job in expand_grid(never))
    assert {job.eval.bos_token_id for job in expand_grid(with_bos)} == {1}
    # A retry's smaller batch measures the same windows.
    job = expand_grid(with_bos)[0]
    assert dataclasses.replace(job.eval, batch_size=1).bos_token_id == 1


@pytest.fixture(scope="module")
def independent(bos_model):
    """Windows, and float64 log-probs of the fp and the fp4 model, from transformers alone."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(bos_model)
    with open(DEMO_EVAL_TEXT, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = SEQ_LEN - 1
    windows = torch.tensor([[tokenizer.bos_token_id] + ids[i * body:(i + 1) * body]
                            for i in range(SAMPLES)])
    log_p, log_q = fp_and_fp4_log_probs(bos_model, windows)
    targets = windows[:, 1:].unsqueeze(-1)  # every text token; the BOS is never a target
    nll_p = -log_p.gather(-1, targets).squeeze(-1)
    nll_q = -log_q.gather(-1, targets).squeeze(-1)
    return {"windows": windows, "text_ids": ids,
            "baseline_perplexity": math.exp(nll_p.mean().item()),
            "perplexity": math.exp(nll_q.mean().item()),
            "kl_divergence": (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()}


@pytest.fixture(scope="module")
def measured(bos_model):
    from quantdask.measure.reference import compute_reference

    jobs = {job.config_label: job for job in expand_grid(_sweep(bos_model))}
    baseline = jobs["baseline"]
    with open(DEMO_EVAL_TEXT, encoding="utf-8") as f:
        reference = compute_reference(baseline.model, baseline.eval, f.read())
    records = {label: run_job(job, get_backend(job.backend), reference=reference).record
               for label, job in jobs.items()}
    return reference, records


def test_every_window_starts_with_the_bos_and_the_figures_match_plain_transformers(
        independent, measured):
    import torch

    reference, records = measured
    assert torch.equal(reference.windows, independent["windows"])
    assert {r["status"] for r in records.values()} == {"done"}
    baseline, fp4 = records["baseline"], records["fp4"]
    assert baseline["eval_bos_token_id"] == fp4["eval_bos_token_id"] == 1
    assert baseline["eval_tokens"] == SAMPLES * (SEQ_LEN - 1)  # the BOS position is not scored
    assert baseline["perplexity"] == pytest.approx(independent["baseline_perplexity"], rel=REL)
    assert fp4["perplexity"] == pytest.approx(independent["perplexity"], rel=REL)
    assert fp4["kl_divergence"] == pytest.approx(independent["kl_divergence"], rel=1e-3)


def test_never_cuts_the_text_as_tokenized_and_measures_otherwise(bos_model, independent):
    from transformers import AutoTokenizer

    from quantdask.measure.reference import compute_reference

    job = expand_grid(_sweep(bos_model, bos="never"))[0]
    with open(DEMO_EVAL_TEXT, encoding="utf-8") as f:
        text = f.read()
    reference = compute_reference(job.model, job.eval, text)
    tokenized = AutoTokenizer.from_pretrained(bos_model)(text)["input_ids"]  # <s> once, first
    assert reference.windows.flatten().tolist() == tokenized[:SEQ_LEN * SAMPLES]
    assert reference.windows[1:, 0].tolist() != [1] * (SAMPLES - 1)
    assert reference.baseline.perplexity != pytest.approx(independent["baseline_perplexity"],
                                                          rel=1e-3)


def test_calibration_windows_and_speed_prompts_start_with_one_bos(independent):
    import torch

    from quantdask.measure.calibration import calibration_windows
    from quantdask.measure.speed import prompt_ids

    ids = independent["text_ids"]
    cut = calibration_windows(ids, 16, 5, seed=3, bos_token_id=1)
    assert cut.shape == (5, 16) and cut[:, 0].tolist() == [1] * 5
    text = "," + ",".join(map(str, ids)) + ","
    for row in cut[:, 1:].tolist():  # 15 consecutive text tokens, no BOS among them
        assert "," + ",".join(map(str, row)) + "," in text
    assert torch.equal(calibration_windows(ids, 16, 5, seed=3),
                       calibration_windows(ids, 16, 5, seed=3, bos_token_id=None))
    prompts = prompt_ids(independent["windows"], 3, 10, bos_token_id=1)
    assert prompts[:, 0].tolist() == [1, 1, 1]
    assert prompts[:, 1:].flatten().tolist() == ids[:27]  # the text, the windows' BOS left out


def test_the_references_calibration_windows_start_with_the_bos_as_its_eval_windows_do(
        bos_model, tmp_path):
    """The windows a reference cuts for the calibrated jobs (``measure.reference``) begin with
    the model's BOS where ``eval.bos`` gives one, and its text follows, as tokenized without
    special tokens; with ``bos: never`` they are the text alone."""
    from transformers import AutoTokenizer

    from quantdask.measure.reference import compute_reference
    from quantdask.sweepfile.settings import CalibrationSettings

    with open(DEMO_EVAL_TEXT) as f:
        text = f.read()
    (tmp_path / "calibration.txt").write_text(text)
    calibration = CalibrationSettings(text=str(tmp_path / "calibration.txt"), samples=4,
                                      seq_len=24, seed=5)
    ids = AutoTokenizer.from_pretrained(bos_model)(text, add_special_tokens=False)["input_ids"]
    joined = "," + ",".join(map(str, ids)) + ","
    for bos, first in (("auto", 1), ("never", None)):
        [job] = [j for j in expand_grid(_sweep(bos_model, bos)) if j.config_label == "baseline"]
        assert job.eval.bos_token_id == first
        reference = compute_reference(job.model, job.eval, text, calibration=calibration)
        windows = reference.calibration
        assert windows.shape == (4, 24)
        body = windows[:, 1:] if first is not None else windows
        if first is not None:
            assert windows[:, 0].tolist() == [first] * 4
        for row in body.tolist():
            assert "," + ",".join(map(str, row)) + "," in joined


def test_a_searchs_probe_windows_follow_the_same_rule(bos_model, tmp_path_factory):
    from quantdask.search.identity import probe_settings, search_key
    from tests.conftest import calibration_file
    from tests.test_search import search_sweep

    def settings_of(path: str, bos: str):
        data = search_sweep(calibration_file(tmp_path_factory, 50, seed=1))
        data["models"][0]["path"] = path
        data["eval"]["bos"] = bos
        sweep = sweep_from_dict(data)
        return probe_settings(sweep, sweep.searches[0]), search_key(sweep, sweep.searches[0])

    (auto, auto_key), (never, never_key) = settings_of(bos_model, "auto"), settings_of(
        bos_model, "never")
    assert (auto.bos_token_id, never.bos_token_id) == (1, None) and auto_key != never_key
    assert settings_of(DEMO_MODEL_DIR, "auto")[0].bos_token_id is None


def test_the_plan_says_how_each_models_windows_begin(bos_model, write_sweep, capsys):
    from quantdask.cli.main import main

    data = sweep_dict()
    data["models"].append({"name": "bos", "path": bos_model})
    assert main(["plan", write_sweep(data)]) == 0
    out = capsys.readouterr().out
    assert ("eval windows of demo (eval.bos: auto): the text cut as tokenized, no BOS per "
            "window") in out
    assert "eval windows of bos (eval.bos: auto): a BOS (token 1) at the start of every window" \
        in out
