"""Log-probs a slice of positions at a time: the same numbers as a plain forward on every
architecture, bounded memory, and a fallback that says why."""

from __future__ import annotations

import logging

import pytest

from tests.tiny_families import FAMILIES, build_tiny

pytestmark = pytest.mark.timeout(120)


def plain_log_probs(model, windows):
    import torch

    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=windows).logits[:, :-1].float(), dim=-1)


def sliced(model, windows, batch_size: int, budget_bytes: int):
    import torch

    from quantdask.measure.logits import sliced_log_probs

    out = torch.full((windows.size(0), windows.size(1) - 1, model.config.vocab_size), float("nan"))
    pieces = []
    for piece in sliced_log_probs(model, windows, batch_size, "cpu", budget_bytes=budget_bytes):
        out[piece.rows, piece.positions] = piece.log_probs
        pieces.append(piece.log_probs.shape)
    return out, pieces


def gemma2_soft_capped():
    """A tiny Gemma 2 whose logits are soft-capped at 5 (after its head, in its forward), with
    weights scaled so that the cap changes them a lot."""
    import torch
    import transformers as t

    torch.manual_seed(0)
    config = t.Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, final_logit_softcapping=5.0, sliding_window=64)
    model = t.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(40)
    return model


@pytest.fixture(scope="module")
def windows():
    import torch

    return torch.randint(4, 300, (5, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_sliced_log_probs_are_a_plain_forwards_on_every_family(family, windows, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny(family, tmp_path / family)).eval()
    vocab = model.config.vocab_size
    # A budget of 14 window-positions: batches of 2, 2 and 1 window, in slices of 7, 7 and 14
    # of the 39 positions.
    out, pieces = sliced(model, windows, 2, 2 * 7 * vocab * 4)
    assert out.isfinite().all()
    assert (out - plain_log_probs(model, windows)).abs().max() < 1e-5
    assert [shape[:2] for shape in pieces] == [(2, 7)] * 5 + [(2, 4)] + [(2, 7)] * 5 + [
        (2, 4), (1, 14), (1, 14), (1, 11)]


def test_what_an_architecture_does_after_its_head_is_applied(windows, caplog):
    import torch

    model = gemma2_soft_capped()
    plain = plain_log_probs(model, windows)
    with torch.inference_mode():
        uncapped = torch.log_softmax(model.get_output_embeddings()(
            model.get_decoder()(input_ids=windows).last_hidden_state)[:, :-1], dim=-1)
    assert (uncapped - plain).abs().max() > 1  # the cap matters here
    caplog.set_level(logging.WARNING, logger="quantdask.logits")
    out, _ = sliced(model, windows, 2, 2 * 5 * 512 * 4)
    assert (out - plain).abs().max() < 1e-5
    assert "whole-batch" not in caplog.text


def test_a_model_the_sliced_head_does_not_fit_falls_back_and_says_why(windows, tmp_path,
                                                                       caplog):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny("llama", tmp_path / "m")).eval()
    forward = model.forward

    def scaled(*args, **kwargs):  # something after the head that the sliced path cannot see
        output = forward(*args, **kwargs)
        if kwargs.get("logits_to_keep") is None or isinstance(kwargs["logits_to_keep"], int):
            output.logits = output.logits * 2
        return output

    model.forward = scaled
    caplog.set_level(logging.WARNING, logger="quantdask.logits")
    out, pieces = sliced(model, windows, 2, 2 * 7 * 1024 * 4)
    assert "whole-batch logits (the sliced head differs from a plain forward" in caplog.text
    with torch.inference_mode():
        expected = torch.log_softmax(model(input_ids=windows).logits[:, :-1].float(), dim=-1)
    assert (out - expected).abs().max() < 1e-5
    assert max(rows * positions for rows, positions, _ in pieces) == 14  # still sliced


def test_slices_fit_the_budget_and_one_position_is_the_least(windows, tmp_path):
    from transformers import AutoModelForCausalLM

    from quantdask.measure.logits import positions_per_slice

    assert positions_per_slice(batch=4, vocab=1000, budget_bytes=4 * 1000 * 4 * 10) == 10
    assert positions_per_slice(batch=4, vocab=1000, budget_bytes=1) == 1
    model = AutoModelForCausalLM.from_pretrained(build_tiny("llama", tmp_path / "m")).eval()
    _, pieces = sliced(model, windows, 5, 1)
    assert {shape[:2] for shape in pieces} == {(5, 1)} and len(pieces) == 39


@pytest.mark.timeout(60)
def test_the_head_computes_only_its_slices_positions_and_they_tile_each_batch_once(demo_model):
    """A forward hook on the demo model's output head sees each slice's positions only (never
    the whole window), and per batch of windows the slices cover positions 0..seq_len-2
    exactly once."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantdask.measure.logits import PROBE_TOKENS, sliced_log_probs

    model = AutoModelForCausalLM.from_pretrained(demo_model).eval()
    vocab, seq_len = model.config.vocab_size, 40
    windows = torch.randint(4, vocab, (5, seq_len), generator=torch.Generator().manual_seed(1))
    seen: list[tuple[int, int]] = []  # (batch, positions) of each input the head computed on
    handle = model.get_output_embeddings().register_forward_hook(
        lambda module, inputs, output: seen.append(tuple(inputs[0].shape[:2])))
    covered: dict[tuple[int, int], list[int]] = {}
    try:
        for number, piece in enumerate(sliced_log_probs(model, windows, 2, "cpu",
                                                        budget_bytes=2 * 6 * vocab * 4)):
            rows = (piece.rows.start, piece.rows.stop)
            length = piece.positions.stop - piece.positions.start
            if number == 0:  # the first slice comes after the sliced head's check on a probe
                *probe, head = seen
                assert probe and all(batch == 1 and positions <= PROBE_TOKENS
                                     for batch, positions in probe)
            else:
                [head] = seen  # one head call per slice
            assert head == (rows[1] - rows[0], length) and length < seq_len - 1
            assert piece.log_probs.shape[:2] == head
            covered.setdefault(rows, []).extend(range(piece.positions.start,
                                                      piece.positions.stop))
            seen.clear()
    finally:
        handle.remove()
    assert list(covered) == [(0, 2), (2, 4), (4, 5)]
    for positions in covered.values():
        assert positions == list(range(seq_len - 1))  # each once, in order
