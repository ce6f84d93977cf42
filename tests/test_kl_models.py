"""The three KL test models have the regimes they claim, and the exact harness is sound.

The models (tests/kl_models.py): flat (random init, near-uniform predictions), peaked (the demo
model) and realistic (trained on Zipfian text: perplexity >= 20, long tails). The harness is
checked on what it must get right whatever the model: the unquantized model against itself has
KL 0 and top-1 agreement 1, a 4-bit model has KL > 0, and the top-64-plus-one-bucket KL never
exceeds the exact KL.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

from tests.kl_models import (
    DEMO_EVAL_TEXT,
    PEAKED_MODEL,
    REALISTIC_EVAL_TEXT,
    REALISTIC_MODEL,
    REGIMES,
    eval_windows_like_quantdask,
    exact_quality,
    flat_model,
)

SEQ_LEN, SAMPLES = 128, 16


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory) -> dict[str, tuple[str, str]]:
    return {"flat": (flat_model(tmp_path_factory.mktemp("flat")), DEMO_EVAL_TEXT),
            "peaked": (PEAKED_MODEL, DEMO_EVAL_TEXT),
            "realistic": (REALISTIC_MODEL, REALISTIC_EVAL_TEXT)}


@pytest.fixture(scope="module")
def windows(model_and_text):
    @functools.cache
    def of(regime: str):
        path, text = model_and_text[regime]
        return eval_windows_like_quantdask(path, text, SEQ_LEN, SAMPLES)
    return of


@pytest.fixture(scope="module")
def against_itself(model_and_text, windows):
    """The exact quality of each unquantized model against itself (computed once a regime)."""
    import torch
    from transformers import AutoModelForCausalLM

    @functools.cache
    def of(regime: str) -> dict:
        path = model_and_text[regime][0]
        fp = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return exact_quality(path, fp, windows(regime))
    return of


@pytest.mark.timeout(60)
def test_windows_are_the_texts_first_tokens(model_and_text, windows):
    from transformers import AutoTokenizer

    path, text = model_and_text["realistic"]
    ids = AutoTokenizer.from_pretrained(path)(Path(text).read_text(encoding="utf-8"))["input_ids"]
    assert windows("realistic").shape == (SAMPLES, SEQ_LEN)
    assert windows("realistic").flatten().tolist() == ids[:SAMPLES * SEQ_LEN]
    assert len(ids) >= 64 * SEQ_LEN  # the committed eval text holds 64 windows of 128
    assert 0 not in ids  # no <unk>: the tokenizer covers the text


@pytest.mark.timeout(60)
def test_flat_model_is_flat(against_itself):
    result = against_itself("flat")
    assert result["top_k_mass"] < 0.1
    assert result["perplexity_unquantized"] > 1000


@pytest.mark.timeout(60)
def test_peaked_model_is_peaked(against_itself):
    result = against_itself("peaked")
    assert result["perplexity_unquantized"] < 3
    assert result["top_k_mass"] > 0.99


@pytest.mark.timeout(60)
def test_realistic_model_is_uncertain_with_a_long_tail(against_itself):
    result = against_itself("realistic")
    assert result["perplexity_unquantized"] >= 20
    assert 0.6 <= result["top_k_mass"] <= 0.97
    # Long tails somewhere (content words, sentence starts), near certainty elsewhere.
    assert np.quantile(result["top_k_mass_p"], 0.1) < 0.7
    assert np.quantile(result["top_k_mass_p"], 0.9) > 0.99


@pytest.mark.timeout(60)
@pytest.mark.parametrize("regime", REGIMES)
def test_a_model_against_itself_has_no_divergence(against_itself, regime):
    result = against_itself(regime)
    shape = (SAMPLES, SEQ_LEN - 1)
    assert all(result[name].shape == shape and result[name].dtype == np.float64
               for name in ("kl", "kl_top_k_bound", "nll_p", "nll_q", "top1_agree",
                            "p_correct_p", "p_correct_q", "top_k_mass_p"))
    assert np.abs(result["kl"]).max() < 1e-12
    assert np.abs(result["kl_top_k_bound"]).max() < 1e-12
    assert result["top1_agreement"] == 1.0
    assert result["perplexity"] == result["perplexity_unquantized"]
    np.testing.assert_allclose(result["p_correct_p"], np.exp(-result["nll_p"]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("regime", REGIMES)
def test_nf4_diverges_and_the_top_k_bound_stays_below(model_and_text, windows, regime):
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    path = model_and_text[regime][0]
    nf4 = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32)).eval()
    result = exact_quality(path, nf4, windows(regime))
    assert result["kl_divergence"] > 0
    assert (result["kl"] > -1e-12).all()  # KL is never negative (up to rounding)
    assert 0 <= result["kl_top_k_lower_bound"] <= result["kl_divergence"]
    assert (result["kl_top_k_bound"] <= result["kl"] + 1e-12).all()  # per position too
