"""Bad sweeps and arguments: exit code 2 within 20 s, one line naming the field, nothing created
or changed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from quantdask.cli.main import main
from tests.conftest import REPO, sweep_dict

pytestmark = pytest.mark.timeout(60)

BNB = "bitsandbytes"

BAD_SWEEPS = {
    "not yaml": ("name: [unclosed\n  models: {", "sweep"),
    "not a mapping": ("- just\n- a list\n", "sweep"),
    "binary file": (b"\x00\xff\xfe garbage", "sweep"),
    "python object tag": ("!!python/object/apply:os.system ['echo pwned']\n", "sweep"),
    "unknown top-level key": (sweep_dict(workers=3), "workers"),
    "missing models": ({k: v for k, v in sweep_dict().items() if k != "models"}, "models"),
    "models not a list": (sweep_dict(models={"path": "x"}), "models"),
    "missing model path": (sweep_dict(models=[{"path": "/nonexistent/model"}]), "models[0].path"),
    "unknown model key": (sweep_dict(models=[{"paht": "x"}]), "models[0].paht"),
    "unknown backend": (sweep_dict(backends=[{"backend": "exl2", "grid": {"bits": [4]}}]),
                        "backends[0].backend"),
    "unknown option": (sweep_dict(backends=[{"backend": BNB, "grid": {"bits": [4],
                                                                       "group": [64]}}]),
                       "backends[0].grid.group"),
    "3-bit": (sweep_dict(backends=[{"backend": BNB, "grid": {"bits": [3]}}]),
              "backends[0].grid.bits"),
    "bits as string": (sweep_dict(backends=[{"backend": BNB, "configs": [{"bits": "four"}]}]),
                       "backends[0].configs[0].bits"),
    "empty grid": (sweep_dict(backends=[{"backend": BNB, "grid": {}}]), "backends[0].grid"),
    "empty grid values": (sweep_dict(backends=[{"backend": BNB, "grid": {"bits": []}}]),
                          "backends[0].grid.bits"),
    "grid value not a list": (sweep_dict(backends=[{"backend": BNB, "grid": {"bits": 4}}]),
                              "backends[0].grid.bits"),
    "8-bit with quant_type": (sweep_dict(backends=[{"backend": BNB, "configs": [
        {"bits": 8, "quant_type": "nf4"}]}]), "backends[0].configs[0].quant_type"),
    "negative threshold": (sweep_dict(backends=[{"backend": BNB, "configs": [
        {"bits": 8, "int8_threshold": -1}]}]), "backends[0].configs[0].int8_threshold"),
    "missing eval text": (sweep_dict(eval={"text": "x.txt", "seq_len": 8}), "eval.text"),
    "bad seq_len": (sweep_dict(eval={**sweep_dict()["eval"], "seq_len": "long"}), "eval.seq_len"),
    "zero samples": (sweep_dict(eval={**sweep_dict()["eval"], "samples": 0}), "eval.samples"),
    "kl_top_k zero": (sweep_dict(eval={**sweep_dict()["eval"], "kl_top_k": 0}), "eval.kl_top_k"),
    "kl_top_k a word": (sweep_dict(eval={**sweep_dict()["eval"], "kl_top_k": "most"}),
                        "eval.kl_top_k"),
    "negative retries": (sweep_dict(retries=-2), "retries"),
    "layer_stats not a bool": (sweep_dict(layer_stats="yes"), "layer_stats"),
    "seed out of range": (sweep_dict(seed=2**64), "seed"),
    "timeout not finite": (sweep_dict(timeout_s=float("nan")), "timeout_s"),
    "fault on no job": (sweep_dict(faults=[{"config": "nf8", "kind": "raise"}]),
                        "faults[0].config"),
    "unknown fault kind": (sweep_dict(faults=[{"config": "nf4", "kind": "segfault"}]),
                           "faults[0].kind"),
    "fault attempt zero": (sweep_dict(faults=[{"config": "nf4", "kind": "raise",
                                               "attempt": 0}]), "faults[0].attempt"),
    "negative backoff": (sweep_dict(retry_backoff_s=-1), "retry_backoff_s"),
    "timeout not a number": (sweep_dict(timeout_s="soon"), "timeout_s"),
    "bad dtype": (sweep_dict(models=[{"path": sweep_dict()["models"][0]["path"],
                                      "dtype": "int3"}]), "models[0].dtype"),
    # a module the model does not have (a typo), named before any job (the meta model's)
    "hqq module unknown": (sweep_dict(backends=[{"backend": "hqq", "configs": [
        {"bits": 4, "group_size": 32, "modules": {"model.layers.0.self_attn.q_prj": {
            "bits": 8}}}]}]), "modules.model.layers.0.self_attn.q_prj"),
    "gguf module unknown": (sweep_dict(backends=[{"backend": "gguf", "configs": [
        {"type": "Q4_K_M", "modules": {"model.layers.9.mlp.down_proj": {
            "tensor_type": "Q6_K"}}}]}]), "modules.model.layers.9.mlp.down_proj"),
    # the bytes follow from the shapes: below 2 bits per unit weight, whatever the probes say
    "search budget below the least": (sweep_dict(searches=[{
        "name": "mix", "model": "demo", "backend": "hqq", "base": {"group_size": 32},
        "formats": {"b2": {"bits": 2}, "b4": {"bits": 4}}, "sensitivity": "kl",
        "budget": {"bits_per_weight": 3.0}}], calibration={
            "text": sweep_dict()["eval"]["text"], "samples": 4, "seq_len": 32}),
        "searches[0].budget"),
}


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case", list(BAD_SWEEPS), ids=list(BAD_SWEEPS))
def test_bad_sweep_exits_2_naming_the_field(case, command, tmp_path, capsys, monkeypatch):
    content, field = BAD_SWEEPS[case]
    path = tmp_path / "sweep.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        import yaml

        path.write_text(yaml.safe_dump(content))
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "out"  # a run directory already there is left as it was
    run_dir.mkdir()
    (run_dir / "results.txt").write_text("recorded before")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir())
    args = [command, str(path), "--run-dir", str(run_dir)]
    began = time.monotonic()
    assert main(args) == 2
    assert time.monotonic() - began < 20
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"quantdask: error: {field}:"), lines[0]
    assert "Traceback" not in err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.iterdir()) == before
    assert not (tmp_path / "runs").exists()


def exit_code(args: list[str]) -> int:
    """``quantdask ARGS`` in this process; argparse's own errors exit through SystemExit."""
    try:
        return main(args)
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("args, expected", [
    (["run", "SWEEP", "--workers", "0"], "--workers"),
    (["run", "SWEEP", "--workers", "two"], "--workers"),
    (["run", "SWEEP", "--workers", "2", "--gpus", "0"], "--gpus"),
    (["run", "SWEEP", "--gpus", "a,b"], "gpus"),
    (["run", "SWEEP", "--gpus", "99"], "gpus"),
    (["run", "SWEEP", "--run-dir", "FILE"], "--run-dir"),
    (["run", "/nonexistent/sweep.yaml"], "sweep"),
    (["status", "/nonexistent/run"], "no run directory"),
    (["frobnicate"], "argument command"),
])
def test_bad_arguments_exit_2(args, expected, write_sweep, tmp_path, capsys, monkeypatch):
    sweep = write_sweep()
    (tmp_path / "FILE").write_text("not a directory")
    monkeypatch.chdir(tmp_path)
    args = [{"SWEEP": sweep, "FILE": str(tmp_path / "FILE")}.get(a, a) for a in args]
    assert exit_code(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "runs").exists()


def test_real_command_exit_code_and_single_line(write_sweep, tmp_path):
    sweep = write_sweep(sweep_dict(backends=[{"backend": BNB, "grid": {"bits": [3]}}]))
    proc = subprocess.run([sys.executable, "-m", "quantdask.cli", "plan", sweep],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "quantdask: error: backends[0].grid.bits: must be 4 or 8, got 3")
    assert proc.stdout == ""


def damaged_copy(tmp_path, damage) -> str:
    """A copy of the demo model with ``damage(directory)`` done to it."""
    import shutil

    from quantdask.demo_model import DEMO_MODEL_DIR

    copy = tmp_path / "damaged-model"
    shutil.copytree(DEMO_MODEL_DIR, copy)
    damage(copy)
    return str(copy)


def truncate_weights(directory) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])


def cut_header(directory) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])


def break_config(directory) -> None:
    (directory / "config.json").write_text('{"model_type": "llama", ')


def lose_a_shard(directory) -> None:
    (directory / "model.safetensors.index.json").write_text(
        '{"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}')


BROKEN_MODELS = {
    "truncated weights": (truncate_weights, r"model\.safetensors holds 100,000 bytes, but its "
                                            r"tensors need [\d,]+ \(truncated\); the file is "
                                            r"damaged or incomplete: copy or download it again"),
    "cut header": (cut_header, r"model\.safetensors its header claims [\d,]+ bytes but the file "
                               r"holds 40 \(incomplete metadata\)"),
    "config not json": (break_config, r"config\.json is not valid JSON \(.*\); restore the "
                                      r"model's config\.json"),
    "missing shard": (lose_a_shard, r"model\.safetensors\.index\.json lists "
                                    r"model-00002-of-00002\.safetensors, which is not in .*; copy "
                                    r"the whole checkpoint"),
}


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case", list(BROKEN_MODELS), ids=list(BROKEN_MODELS))
def test_a_broken_model_is_refused_before_anything_runs(case, command, tmp_path, capsys,
                                                        monkeypatch):
    import re

    import yaml

    damage, message = BROKEN_MODELS[case]
    model = damaged_copy(tmp_path, damage)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep_dict(models=[{"name": "broken", "path": model}])))
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "out"
    assert main([command, str(path), "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("quantdask: error: models[0].path: "), lines[0]
    assert re.search(message, lines[0]), lines[0]
    assert not run_dir.exists()


def test_the_same_model_under_two_names_is_refused(tmp_path, capsys, monkeypatch):
    """Its jobs would have the same ids and run once: say so instead of dropping one quietly."""
    import yaml

    demo = sweep_dict()["models"][0]["path"]
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep_dict(models=[{"name": "a", "path": demo},
                                                      {"name": "b", "path": demo}])))
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "quantdask: error: models[1]: is the same model as models[0] ('a': the same files and "
        "dtype), so its jobs would run only once; remove one")


def _tasks(**settings) -> dict:
    from quantdask.demo_model import DEMO_TASKS_DIR

    return {"names": ["demo_facts"], "include_path": DEMO_TASKS_DIR, **settings}


# Lengths past the demo model's 256 positions (max_position_embeddings in its config.json):
# each ran before it was refused here, the speed prompt for minutes.
TOO_LONG = {
    "eval windows": (lambda: sweep_dict(eval={**sweep_dict()["eval"], "seq_len": 4096,
                                               "samples": 2}), "eval.seq_len", "4,096 tokens"),
    "speed prompt": (lambda: sweep_dict(speed={"prompt_length": 100_000, "new_tokens": 64,
                                               "batch_sizes": [1]}),
                     "speed.prompt_length", "prompt_length + new_tokens = 100,000 + 64 = "
                                            "100,064 tokens"),
    "speed new tokens": (lambda: sweep_dict(speed={"prompt_length": 200, "new_tokens": 300,
                                                   "batch_sizes": [1]}),
                         "speed.new_tokens", "prompt_length + new_tokens = 200 + 300 = 500 "
                                             "tokens"),
    "task length": (lambda: sweep_dict(tasks=_tasks(max_length=100_000)), "tasks.max_length",
                    "100,000 tokens"),
    "calibration windows": (lambda: sweep_dict(
        backends=[{"backend": "autoround", "configs": [{"bits": 4, "group_size": 32,
                                                         "iters": 0}]}],
        calibration={"text": sweep_dict()["eval"]["text"], "samples": 2}),  # seq_len 2048
        "calibration.seq_len", "2,048 tokens"),
}
LIMIT = "but model 'demo' takes at most 256 positions (max_position_embeddings in its config.json)"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case", list(TOO_LONG), ids=list(TOO_LONG))
def test_a_length_past_the_models_positions_is_refused_before_anything_runs(
        case, command, tmp_path, capsys, monkeypatch):
    import time

    import yaml

    import quantdask.cluster.local

    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started for a sweep that cannot run")

    data, field, asked = TOO_LONG[case]
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data()))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(quantdask.cluster.local, "start_cluster", no_cluster)
    run_dir = tmp_path / "out"
    began = time.monotonic()
    assert main([command, str(path), "--run-dir", str(run_dir)]) == 2
    assert time.monotonic() - began < 10
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"quantdask: error: {field}: {asked}, {LIMIT}: give 256 or "
                               "fewer"), lines[0]
    assert not run_dir.exists() and not (tmp_path / "runs").exists()


def timed_run(sweep: str, cwd) -> tuple[subprocess.CompletedProcess, float]:
    import time

    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "quantdask.cli", "run", sweep, "--run-dir",
                           "out"], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc, time.monotonic() - began


@pytest.mark.timeout(300)
def test_quantdask_run_refuses_a_length_as_a_command_before_anything_starts(write_sweep,
                                                                            tmp_path):
    """The command as a user runs it, its imports included: refused with one line naming the
    field, nothing written, and no wait (a generous hang guard; how fast, against a sweep
    refused while it is read, is not a test: two measured durations move apart on a loaded
    machine). One length as a command: each of them is refused before a cluster, in process,
    above."""
    for case in ("eval windows",):
        data, field, _ = TOO_LONG[case]
        proc, took = timed_run(write_sweep(data()), tmp_path)
        assert proc.returncode == 2, (case, proc.stderr)
        assert proc.stderr.startswith(f"quantdask: error: {field}: "), proc.stderr
        assert LIMIT in proc.stderr and proc.stdout == ""
        assert took < 60, (case, took)
        assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_lengths_at_the_models_limit_run_and_one_past_is_refused(tmp_path):
    """Both sides of the boundary, on a model of 128 positions: a window of exactly 128 tokens
    and a prompt + new tokens of exactly 128 are measured; one more of either is refused."""
    from quantdask.backends import get_backend
    from quantdask.demo_model import DEMO_EVAL_TEXT
    from quantdask.errors import LengthError
    from quantdask.job.job import run_job
    from quantdask.measure.reference import compute_reference
    from quantdask.plan.lengths import check_lengths
    from quantdask.sweepfile.model import ModelSpec
    from quantdask.sweepfile.settings import EvalSettings
    from quantdask.sweepfile.speed import SpeedSettings
    from quantdask.sweepfile.sweep import BackendBlock, Sweep, expand_grid
    from tests.tiny_families import build_tiny_llama

    path = build_tiny_llama(tmp_path / "tiny", 32, 64)  # max_position_embeddings: 128

    def sweep(seq_len: int, prompt_length: int) -> Sweep:
        return Sweep(name="edge", models=[ModelSpec(path=path)],
                     backends=[BackendBlock("bitsandbytes", configs=[{"bits": 8}])],
                     eval=EvalSettings(text=DEMO_EVAL_TEXT, seq_len=seq_len, samples=2,
                                       batch_size=2),
                     speed=SpeedSettings(prompt_length=prompt_length, new_tokens=8, warmup=0,
                                         repeats=1))

    at_limit = sweep(128, 120)
    assert check_lengths(at_limit)["tiny"].positions == 128
    baseline = expand_grid(at_limit)[0]
    reference = compute_reference(baseline.model, baseline.eval, baseline.eval.read_text())
    outcome = run_job(baseline, get_backend(baseline.backend), reference=reference)
    assert outcome.record["status"] == "done", outcome.record.get("error_message")
    assert outcome.record["eval_tokens"] == 2 * 127
    assert [(r["prompt_tokens"], r["new_tokens"]) for r in outcome.rows["speed"]] == [(120, 8)]
    for past in (sweep(129, 120), sweep(128, 121)):
        with pytest.raises(LengthError) as refused:
            check_lengths(past)
        assert "takes at most 128 positions" in str(refused.value)
