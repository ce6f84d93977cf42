"""The demo model recipe still builds a loadable model (a few steps here; 600 when committed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantdask.demo_model import DEMO_CALIBRATION_NAME, DEMO_SWEEP, generate_text
from quantdask.sweepfile.sweep_file import load_sweep

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
    assert model.config.vocab_size == len(tokenizer)
    # The eval text is the recipe's seed + 1 text, and its tokens are what the demo sweep reads.
    text = (tmp_path / "eval.txt").read_text(encoding="utf-8")
    assert text == generate_text(1_500, seed=1)
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text  # lossless
    assert max(ids) < len(tokenizer) and tokenizer.unk_token_id not in ids
    # Trained merges: well under one token per byte (about one per two bytes here).
    assert len(ids) < 0.75 * len(text.encode("utf-8"))
    demo = load_sweep(DEMO_SWEEP).eval
    assert len(ids) >= demo.samples * demo.seq_len  # enough for the demo sweep's windows
    # The demo search's calibration text: the seed + 2 text, as shipped beside the eval text.
    calibration = (tmp_path / DEMO_CALIBRATION_NAME).read_text(encoding="utf-8")
    assert calibration == generate_text(300, seed=2) == Path(
        load_sweep(DEMO_SWEEP).calibration.text_path).read_text(encoding="utf-8")


def test_the_demo_without_hqq_drops_its_search_and_says_what_it_needs(monkeypatch, capsys):
    """A bare wheel has no hqq (an extra): the demo drops its search, and the calibration
    block only the search reads, before anything runs, says in one line what adds it, and
    keeps every config."""
    import sys

    from quantdask.demo_model import load_demo_sweep
    from quantdask.sweepfile.sweep import expand_grid

    shipped = load_demo_sweep()
    assert [s.name for s in shipped.searches] == ["mix"] and shipped.calibration is not None
    capsys.readouterr()
    for module in ("hqq", "hqq.core", "hqq.core.quantize"):  # its import raises ImportError
        monkeypatch.setitem(sys.modules, module, None)
    sweep = load_demo_sweep()
    assert not sweep.searches and sweep.calibration is None
    said = [line for line in capsys.readouterr().out.splitlines() if "hqq" in line]
    assert said == ["quantdask: the demo's search (the mix of HQQ formats to ship under a size) "
                    "needs hqq: pip install 'quantdask[hqq]'; the demo runs without it"]
    assert [j.id for j in expand_grid(sweep)] == [j.id for j in expand_grid(shipped)]
