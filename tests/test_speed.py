"""Generation speed (the speed block): settings and refusals, the timing against a hand-timed
greedy loop in plain transformers, the speed frame of a sweep on a real cluster, and a job that
times generation holding its device alone even where jobs are packed."""

from __future__ import annotations

import polars as pl
import pytest
import torch

import quantdask as qd
from quantdask.cli import main
from quantdask.demo_model import DEMO_MODEL_DIR
from quantdask.errors import SpecError
from quantdask.sweepfile.sweep import expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import sweep_dict

pytestmark = pytest.mark.timeout(300)

SPEED = {"prompt_length": 16, "new_tokens": 8, "batch_sizes": [1, 2], "warmup": 1, "repeats": 2}


@pytest.mark.parametrize("speed, field, words", [
    ({"new_tokens": 0}, "speed.new_tokens", "positive number of tokens"),
    ({"prompt_length": 0}, "speed.prompt_length", "positive number of tokens"),
    ({"batch_sizes": []}, "speed.batch_sizes", "is empty"),
    ({"batch_sizes": [1, 0]}, "speed.batch_sizes[1]", "positive batch size"),
    ({"batch_sizes": [2, 2]}, "speed.batch_sizes", "twice"),
    ({"repeats": 0}, "speed.repeats", "positive number of timed runs"),
    ({"warmup": -1}, "speed.warmup", ">= 0"),
    ({"tokens": 4}, "speed.tokens", "unknown key"),
])
def test_bad_speed_settings_are_refused_naming_the_field(speed, field, words, write_sweep,
                                                         capsys):
    data = sweep_dict(speed={**SPEED, **speed})
    with pytest.raises(SpecError) as error:
        sweep_from_dict(data)
    assert error.value.field == field and words in error.value.message
    assert main(["plan", write_sweep(data)]) == 2
    assert capsys.readouterr().err.startswith(f"quantdask: error: {field}: ")


def test_speed_is_part_of_the_ids_and_gives_every_job_its_whole_device():
    plain = expand_grid(sweep_from_dict(sweep_dict(jobs_per_gpu=2)))
    timed = expand_grid(sweep_from_dict(sweep_dict(jobs_per_gpu=2, speed=SPEED)))
    longer = expand_grid(sweep_from_dict(sweep_dict(speed={**SPEED, "new_tokens": 9})))
    assert {j.gpu_share for j in plain} == {0.5} and {j.gpu_share for j in timed} == {1.0}
    ids = [{j.id for j in jobs} for jobs in (plain, timed, longer)]
    assert not ids[0] & ids[1] and not ids[1] & ids[2]


def test_generate_makes_exactly_the_tokens_a_hand_written_greedy_loop_makes():
    """The same prompt, in-process: quantdask's timed generate makes as many tokens as a
    hand-written greedy loop, and stamps each decode step. How their step times compare is a
    benchmark (benchmarks/speed_vs_hand_loop.py), not a test: two measured durations move
    apart on a loaded machine."""
    from transformers import AutoModelForCausalLM

    from benchmarks.speed_vs_hand_loop import hand_timed_greedy
    from quantdask.measure.speed import generate_timed, prompt_ids

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    prompt = prompt_ids(torch.arange(4, 300).reshape(2, -1), 1, 32)
    made, ttft, steps = generate_timed(model, prompt, 24, cuda=False, pad_token_id=3)
    count, loop_steps = hand_timed_greedy(model, prompt, 24, model.generation_config.eos_token_id)
    assert made == count == 24 and len(steps) == len(loop_steps) == 23
    assert ttft > 0 and all(step > 0 for step in steps)


@pytest.mark.slow
def test_a_sweep_records_the_speed_of_the_baseline_and_every_config(cluster, tmp_path):
    sweep = sweep_from_dict(sweep_dict(
        speed=SPEED, backends=[{"backend": "bitsandbytes", "grid": {"bits": [4, 8]}}]))
    results = qd.run_sweep(sweep, tmp_path / "run", cluster.client)
    assert results["status"].to_list() == ["done"] * 3
    assert (results["speed_s"] > 0).all()
    speed = qd.read_speed(tmp_path / "run").join(
        results.select("job_id", "config_label"), on="job_id")
    assert speed.height == 3 * 2 and set(speed["batch_size"]) == {1, 2}
    assert set(speed["device"]) == {"cpu"} and speed["exclusive"].all()
    assert speed["other_slots_busy"].is_not_null().all()  # 2 slots share the machine's cores
    assert (speed["new_tokens"] == 8).all() and (speed["decode_tokens_per_s"] > 0).all()
    baseline = speed.filter(pl.col("config_label") == "baseline")
    assert baseline["decode_speedup"].to_list() == [1.0, 1.0]
    ratio = speed["decode_tokens_per_s"] / speed["baseline_decode_tokens_per_s"]
    assert speed["decode_speedup"].to_list() == pytest.approx(ratio.to_list())
    assert (speed["ttft_s"] > 0).all() and (speed["decode_s_p90"] >= speed["decode_s_p50"]).all()
    # The report draws it.
    chart = qd.report.speed_chart(results, qd.read_speed(tmp_path / "run")).to_dict()
    assert "batch 1 on cpu" in str(chart) and "batch 2 on cpu" in str(chart)


@pytest.mark.slow
def test_a_job_timing_generation_holds_its_device_alone_where_jobs_are_packed(tmp_path):
    """One worker that runs two jobs at once (jobs_per_gpu 2; test_sweep_cluster.py shows it
    packing them): with a speed block no two attempts overlap there, and every row says the
    device was its own."""
    sweep = sweep_from_dict(sweep_dict(
        jobs_per_gpu=2, speed={**SPEED, "batch_sizes": [1]},
        backends=[{"backend": "bitsandbytes", "grid": {"bits": [4, 8]}}]))
    with qd.start_cluster(workers=1, jobs_per_worker=2) as cluster:
        results = qd.run_sweep(sweep, tmp_path / "run", cluster.client)
    assert results["status"].to_list() == ["done"] * 3
    spans = sorted((r["started_at"], r["finished_at"])
                   for r in qd.read_attempts(tmp_path / "run").to_dicts())
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), spans
    assert qd.read_speed(tmp_path / "run")["exclusive"].to_list() == [True] * 3
