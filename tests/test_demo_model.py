"""The demo model recipe still builds a loadable model (a few steps here; 600 when committed)."""

from __future__ import annotations

import pytest

from quantdask.demo_model import generate_text

pytestmark = pytest.mark.timeout(180)


def test_generated_text_is_deterministic_and_seed_dependent():
    assert generate_text(50, seed=3) == generate_text(50, seed=3)
    assert generate_text(50, seed=3) != generate_text(50, seed=4)


def test_recipe_builds_a_model_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantdask.demo_model import build_demo_model

    out = build_demo_model(str(tmp_path / "model"), str(tmp_path / "eval.txt"), steps=2,
                           log=lambda line: None)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "llama"
    assert len(tokenizer("the red fox")["input_ids"]) > 0
    assert (tmp_path / "eval.txt").stat().st_size > 10_000
