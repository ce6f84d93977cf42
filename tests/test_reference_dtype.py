"""A 16-bit checkpoint's reference in float32 (issue 69): the reference's own rounding never
lands in a KL, every row says what the reference was computed in, and the baseline row (the
model in its own dtype against that reference) is its dtype's noise floor, checked against
the two dtypes' distributions computed here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gguf_models import large_vocab_model
from tests.kl_models import eval_windows_like_quantdask

pytestmark = pytest.mark.timeout(240)

SEQ_LEN, SAMPLES = 32, 4


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    return large_vocab_model(tmp_path_factory.mktemp("bf16") / "model", vocab=1024, hidden=128,
                             ffn=256, layers=2)


def _sweep(model: Path, reference_dtype: str | None = None):
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    evaluation = {"text": str(model / "eval.txt"), "seq_len": SEQ_LEN, "samples": SAMPLES,
                  "batch_size": SAMPLES, "kl_top_k": "all", "bos": "never"}
    if reference_dtype is not None:
        evaluation["reference_dtype"] = reference_dtype
    return sweep_from_dict({
        "name": "bf16", "models": [{"name": "bf16", "path": str(model)}],
        "backends": [{"backend": "bitsandbytes", "configs": [{"bits": 8}]}],
        "eval": evaluation, "seed": 0, "retries": 0})


def _noise_floor(model: Path) -> tuple[float, float]:
    """(KL of the bfloat16 model against the float32 one, the bfloat16 model's perplexity) on
    the sweep's windows, all positions but each window's last."""
    from transformers import AutoModelForCausalLM

    windows = eval_windows_like_quantdask(model, model / "eval.txt", SEQ_LEN, SAMPLES)
    with torch.no_grad():
        log_p = [AutoModelForCausalLM.from_pretrained(model, dtype=dtype)(windows).logits[:, :-1]
                 .float().log_softmax(-1) for dtype in (torch.float32, torch.bfloat16)]
    kl = (log_p[0].exp() * (log_p[0] - log_p[1])).sum(-1).mean().item()
    nll = -log_p[1].gather(-1, windows[:, 1:, None]).mean().item()
    return kl, float(torch.tensor(nll).exp())


def test_a_bf16_models_reference_is_float32_and_its_baseline_is_the_noise_floor(
        bf16_model, cluster, tmp_path):
    """Default: the reference in float32; the baseline's KL is the bfloat16 model's own
    against it (not 0), its perplexity the bfloat16 model's; every row names the reference's
    dtype. With ``reference_dtype: model`` the reference is the model's own (KL 0 at the
    baseline) and the jobs have other ids."""
    import quantdask as qd

    kl, perplexity = _noise_floor(bf16_model)
    assert kl > 1e-6  # bfloat16's rounding is measurable on this model
    results = qd.run_sweep(_sweep(bf16_model), tmp_path / "f32", cluster.client)
    assert set(results["status"]) == {"done"}, results["error_message"].to_list()
    assert set(results["reference_dtype"]) == {"float32"}
    baseline = results.filter(config_label="baseline").row(0, named=True)
    assert baseline["kl_divergence"] == pytest.approx(kl, rel=1e-3)
    assert baseline["perplexity"] == pytest.approx(perplexity, rel=1e-3)

    own = qd.run_sweep(_sweep(bf16_model, "model"), tmp_path / "own", cluster.client)
    assert set(own["reference_dtype"]) == {"bfloat16"}
    assert own.filter(config_label="baseline")["kl_divergence"].item() == 0
    assert own.filter(config_label="baseline")["perplexity"].item() == pytest.approx(
        perplexity, rel=1e-3)
    assert not set(own["job_id"]) & set(results["job_id"])


def test_only_a_16_bit_models_ids_carry_the_reference_dtype(bf16_model, tmp_path):
    """A float32 model's reference is float32 either way: its job ids are what they were
    before the setting; a 16-bit model's float32 reference is part of its jobs' ids."""
    import dataclasses
    import json

    from quantdask.sweepfile.sweep import expand_grid

    f32 = tmp_path / "f32"
    f32.mkdir()
    for file in bf16_model.iterdir():
        (f32 / file.name).write_bytes(file.read_bytes())
    config = json.loads((f32 / "config.json").read_text())
    (f32 / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    f32_sweep = _sweep(f32)
    assert [job.id for job in expand_grid(f32_sweep)] == [
        job.id for job in expand_grid(_sweep(f32, "model"))]
    assert not any(job.eval.reference_float32 for job in expand_grid(f32_sweep))
    bf16 = expand_grid(_sweep(bf16_model))
    assert all(job.eval.reference_float32 for job in bf16)
    assert all("reference_dtype" in json.dumps(job.eval.identity()) for job in bf16)
    cast = dataclasses.replace(_sweep(bf16_model).models[0], dtype="float32")
    assert cast.loaded_dtype() == "float32"


def test_reference_dtype_must_be_float32_or_model(bf16_model):
    from quantdask.errors import SpecError

    with pytest.raises(SpecError, match="reference_dtype: must be float32 or model"):
        _sweep(bf16_model, "bfloat16")
