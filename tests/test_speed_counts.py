"""The speed frame's figures against an independent count: a tiny model whose every greedy
token is end-of-text still gets exactly ``new_tokens`` real tokens per prompt (no row stops
and is padded), and ``decode_tokens_per_s`` is batch / the median decode step, so one stray
slow step does not move it as it would a mean.

The model's forward pass is watched by a hook that counts each call (one prefill over the
prompt, then one decode call of one token per prompt per step) and drives a fake clock in
place of ``time.perf_counter``: each step's duration is exactly what the hook says, so the
expected figures are computed here from the hook's own record, not from the code under test.
"""

from __future__ import annotations

import statistics
import types

import pytest
import torch

from quantdask.sweepfile.speed import SpeedSettings

pytestmark = pytest.mark.timeout(120)

EOS = 5
PREFILL_S = 0.5
DECODE_S = (0.010, 0.012, 0.011, 0.013)  # cycled over decode calls: a median to find
SLOW_S = 0.2  # the stray step's extra time


def eos_first_model():
    """A tiny random Llama whose head always puts end-of-text first (its weights zero, its
    bias 10 on EOS): greedy generation would end every prompt after one token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS,
                         pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    head = torch.nn.Linear(16, 64, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(-0.01 * torch.arange(64, dtype=torch.float32))  # then token 0, 1, ...
        head.bias[EOS] = 10.0
    model.lm_head = head
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = None
    return model


class Watched:
    """``model`` with each ``generate`` call recorded (its output) and each forward call
    counted and timed on a fake clock (``slow_call``: the decode call, counted from 0 over
    the whole test, that takes ``SLOW_S`` more)."""

    def __init__(self, model, slow_call: int | None = None):
        self.model, self.slow_call = model, slow_call
        self.now, self.decode_calls = 0.0, 0
        self.runs: list[dict] = []
        generate = model.generate

        def recorded_generate(prompts, *args, **kwargs):
            self.runs.append({"prompt": prompts, "prefills": 0, "steps": []})
            out = generate(prompts, *args, **kwargs)
            self.runs[-1]["out"] = out
            return out

        model.generate = recorded_generate
        model.register_forward_pre_hook(self._forward, with_kwargs=True)

    def _forward(self, module, args, kwargs):
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        run = self.runs[-1]
        assert ids.shape[0] == run["prompt"].shape[0]
        if ids.shape[1] > 1:  # the prefill, over the whole prompt
            run["prefills"] += 1
            self.now += PREFILL_S
            return
        seconds = DECODE_S[self.decode_calls % len(DECODE_S)]
        if self.decode_calls == self.slow_call:
            seconds += SLOW_S
        self.decode_calls += 1
        self.now += seconds
        run["steps"].append(seconds)

    def clock(self) -> float:
        return self.now


def measure(monkeypatch, watched: Watched, settings: SpeedSettings) -> list[dict]:
    from quantdask.measure import speed

    monkeypatch.setattr(speed, "time", types.SimpleNamespace(perf_counter=watched.clock))
    windows = torch.arange(10, 60).reshape(2, 25)
    return speed.measure_speed(watched.model, windows, settings, cuda=False, pad_token_id=None,
                               device_label="cpu", whole_device=True)


def timed_runs(watched: Watched, settings: SpeedSettings, batch: int) -> list[dict]:
    """The runs of ``batch`` that were timed (its warm-up runs come first)."""
    per_batch = settings.warmup + settings.repeats
    at = list(settings.batch_sizes).index(batch) * per_batch
    return watched.runs[at + settings.warmup:at + per_batch]


def test_a_row_counts_exactly_new_tokens_for_a_model_that_ends_its_text_at_once(monkeypatch):
    settings = SpeedSettings(prompt_length=6, new_tokens=5, batch_sizes=[1, 3], warmup=1,
                             repeats=2)
    model = eos_first_model()
    prompt = torch.arange(10, 16).reshape(1, 6)
    with torch.inference_mode():  # plain greedy generation ends the text at once
        plain = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert plain[0, 6:].tolist() == [EOS]
    watched = Watched(model)
    rows = measure(monkeypatch, watched, settings)
    assert len(watched.runs) == len(settings.batch_sizes) * (settings.warmup + settings.repeats)
    assert [row.batch_size for row in rows] == [1, 3]
    for row in rows:
        batch = row.batch_size
        steps = []
        for run in timed_runs(watched, settings, batch):
            made = run["out"][:, settings.prompt_length:]
            # Every prompt got new_tokens real tokens: none is end-of-text or its padding.
            assert made.shape == (batch, settings.new_tokens)
            assert not (made == EOS).any(), made
            # One prefill, then one decode call per further token of every prompt.
            assert run["prefills"] == 1
            assert len(run["steps"]) == settings.new_tokens - 1
            assert made.numel() == batch * (1 + len(run["steps"]))
            steps += run["steps"]
        assert row.new_tokens == settings.new_tokens
        assert row.ttft_s == pytest.approx(PREFILL_S)
        assert row.prefill_tokens_per_s == pytest.approx(
            batch * settings.prompt_length / PREFILL_S)
        assert row.decode_s_p50 == pytest.approx(statistics.median(steps))
        # A decode step makes one token for each prompt of the batch.
        assert row.decode_tokens_per_s == pytest.approx(batch / statistics.median(steps))


def test_one_stray_slow_decode_step_does_not_move_decode_tokens_per_s(monkeypatch):
    settings = SpeedSettings(prompt_length=6, new_tokens=6, batch_sizes=[2], warmup=1,
                             repeats=3)
    steady = Watched(eos_first_model())
    (plain,) = measure(monkeypatch, steady, settings)
    # The slow call: the third decode step of the second timed run (after warm-up's 5 and the
    # first timed run's 5).
    slowed = Watched(eos_first_model(), slow_call=5 + 5 + 2)
    (row,) = measure(monkeypatch, slowed, settings)
    steps = [s for run in timed_runs(slowed, settings, 2) for s in run["steps"]]
    assert len(steps) == settings.repeats * (settings.new_tokens - 1)
    assert max(steps) > SLOW_S and sum(s > SLOW_S for s in steps) == 1  # exactly one, timed
    assert row.decode_tokens_per_s == pytest.approx(2 / statistics.median(steps))
    assert row.decode_tokens_per_s == pytest.approx(plain.decode_tokens_per_s, rel=0.1)
    # A mean would have moved: by more than half.
    steady_steps = [s for run in timed_runs(steady, settings, 2) for s in run["steps"]]
    assert 2 / statistics.mean(steps) < 0.6 * (2 / statistics.mean(steady_steps))
    assert row.decode_s_p90 < SLOW_S  # the p90 is no max either
