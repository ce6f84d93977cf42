"""Sweep specs: grid expansion, the baseline, and deterministic job ids."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys

import pytest

from quantdask.backends import get_backend
from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR
from quantdask.errors import SpecError
from quantdask.resources import demo_sweep
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.settings import DEFAULT_KL_TAIL_SAMPLES, DEFAULT_KL_TOP_K, EvalSettings
from quantdask.sweepfile.sweep import BackendBlock, Sweep, expand_grid, plan_rows
from quantdask.sweepfile.sweep_file import load_sweep, sweep_from_dict
from tests.tiny_families import copy_demo_tokenizer

pytestmark = pytest.mark.timeout(60)


def make_sweep(**overrides) -> Sweep:
    fields = dict(
        name="s",
        models=[ModelSpec(path=DEMO_MODEL_DIR)],
        backends=[BackendBlock("bitsandbytes", grid={"bits": [4], "quant_type": ["nf4", "fp4"],
                                                      "double_quant": [False, True]})],
        eval=EvalSettings(text=DEMO_EVAL_TEXT, seq_len=32, samples=4),
    )
    fields.update(overrides)
    return Sweep(**fields)


def test_grid_is_cartesian_product_plus_explicit_configs_plus_baseline():
    sweep = make_sweep(backends=[
        BackendBlock("bitsandbytes", grid={"bits": [4], "quant_type": ["nf4", "fp4"],
                                           "double_quant": [False, True]},
                     configs=[{"bits": 8}, {"bits": 8, "int8_threshold": 0.0}]),
    ])
    jobs = expand_grid(sweep)
    labels = [j.config_label for j in jobs]
    assert labels == ["baseline", "nf4", "nf4 dq", "fp4", "fp4 dq", "int8 t=6", "int8 t=0"]
    assert jobs[0].backend == "none" and jobs[0].is_baseline
    assert len({j.id for j in jobs}) == 7
    assert jobs[0].priority > jobs[1].priority  # the baseline is scheduled first


def test_one_baseline_per_model(tmp_path):
    other = tmp_path / "copy"
    other.mkdir()
    (other / "config.json").write_text("{}")
    copy_demo_tokenizer(other)  # eval.bos reads it: does it add a BOS? (it does not)
    sweep = make_sweep(models=[ModelSpec(path=DEMO_MODEL_DIR, name="a"),
                               ModelSpec(path=str(other), name="b")])
    jobs = expand_grid(sweep)
    assert len(jobs) == 2 * 5
    assert sorted(j.model.label for j in jobs if j.is_baseline) == ["a", "b"]


def test_defaults_spelled_out_or_repeated_configs_are_one_job():
    sweep = make_sweep(backends=[
        BackendBlock("bitsandbytes", configs=[{"bits": 4}, {"bits": 4, "quant_type": "nf4",
                                                            "double_quant": False}]),
        BackendBlock("bitsandbytes", grid={"bits": [4]}),
    ])
    assert [j.config_label for j in expand_grid(sweep)] == ["baseline", "nf4"]


def test_ids_are_stable_across_processes():
    code = (
        "from tests.test_spec import make_sweep; "
        "from quantdask.sweepfile.sweep import expand_grid; "
        "print(' '.join(j.id for j in expand_grid(make_sweep())))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out == [j.id for j in expand_grid(make_sweep())]


def test_id_is_a_pure_function_of_the_canonical_spec(tmp_path):
    text = tmp_path / "eval.txt"
    text.write_text("some eval text\n")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    copy_demo_tokenizer(model)  # adds no BOS: the eval's identity holds no bos_token_id
    def sweep(**eval_options) -> Sweep:
        return Sweep(name="s", models=[ModelSpec(path="m", root=str(tmp_path))],
                     backends=[BackendBlock("bitsandbytes", grid={"bits": [8]})],
                     eval=EvalSettings(text="eval.txt", seq_len=16, samples=2,
                                       root=str(tmp_path), **eval_options))

    # The documented rule, worked out here: the id is "<backend>-" + the first 16 hex digits
    # of the sha256 of the canonical job spec as JSON (keys sorted, no spaces, ASCII). The spec:
    # the model (its directory's name, and a fingerprint: the sha256 of config.json's bytes
    # then "<name>:<size>" of each weight file, none here), the backend, its canonical options
    # (defaults filled in), the eval (the text's sha256, seq_len, samples, and kl_top_k with
    # kl_tail_samples unless it is "all"; tail samples only when not 0) and the seed.
    def expected_id(backend: str, options: dict, **eval_identity) -> str:
        spec = {
            "model": {"path": "m", "fingerprint": hashlib.sha256(b"{}").hexdigest()[:16],
                      "dtype": "auto", "trust_remote_code": False},
            "backend": backend,
            "options": options,
            "eval": {"text_sha256": hashlib.sha256(b"some eval text\n").hexdigest(),
                     "seq_len": 16, "samples": 2, **eval_identity},
            "seed": 0,
        }
        canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return f"{backend}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"

    int8 = {"bits": 8, "int8_threshold": 6.0}
    ids = [j.id for j in expand_grid(sweep())]
    sampled = {"kl_top_k": DEFAULT_KL_TOP_K, "kl_tail_samples": DEFAULT_KL_TAIL_SAMPLES}
    assert ids == [expected_id("none", {}, **sampled),
                   expected_id("bitsandbytes", int8, **sampled)]
    # Without tail samples: the ids of the runs that measured the lower bound before them.
    bound = [j.id for j in expand_grid(sweep(kl_tail_samples=0))]
    assert bound == [expected_id("none", {}, kl_top_k=DEFAULT_KL_TOP_K),
                     expected_id("bitsandbytes", int8, kl_top_k=DEFAULT_KL_TOP_K)]
    exact = [j.id for j in expand_grid(sweep(kl_top_k="all"))]
    assert exact == [expected_id("none", {}), expected_id("bitsandbytes", int8)]
    # And the values themselves, so ids cannot drift between versions or machines unnoticed;
    # the exact KL keeps the ids every run had before kl_top_k existed.
    assert exact == ["none-0505861aaaa71935", "bitsandbytes-01caf1c14bcc1d81"]


@pytest.mark.parametrize("change", [
    lambda s: dataclasses.replace(s, seed=1),
    lambda s: dataclasses.replace(s, eval=EvalSettings(text=DEMO_EVAL_TEXT, seq_len=33, samples=4)),
    lambda s: dataclasses.replace(s, eval=EvalSettings(text=DEMO_EVAL_TEXT, seq_len=32, samples=5)),
    lambda s: dataclasses.replace(s, models=[ModelSpec(path=DEMO_MODEL_DIR, dtype="bfloat16")]),
    lambda s: dataclasses.replace(s, eval=dataclasses.replace(s.eval, kl_top_k=8)),
    lambda s: dataclasses.replace(s, eval=dataclasses.replace(s.eval, kl_top_k="all")),
    lambda s: dataclasses.replace(s, eval=dataclasses.replace(s.eval, kl_tail_samples=8)),
], ids=["seed", "seq_len", "samples", "dtype", "kl_top_k", "exact kl", "kl_tail_samples"])
def test_any_changed_field_gives_new_ids(change):
    before = {j.id for j in expand_grid(make_sweep())}
    after = {j.id for j in expand_grid(change(make_sweep()))}
    assert before.isdisjoint(after)


def _copy_model(tmp_path, name: str) -> str:
    import shutil

    return shutil.copytree(DEMO_MODEL_DIR, tmp_path / name / "demo-model")


def test_the_model_is_identified_by_its_files_not_where_they_lie(tmp_path):
    ids = [j.id for j in expand_grid(make_sweep())]
    for path in (_copy_model(tmp_path, "elsewhere"), DEMO_MODEL_DIR + "/"):
        assert [j.id for j in expand_grid(make_sweep(models=[ModelSpec(path=str(path))]))] == ids
    retrained = _copy_model(tmp_path, "retrained")
    config = retrained / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"num_hidden_layers": 4', '"num_hidden_layers": 5'))
    assert set(ids).isdisjoint(
        j.id for j in expand_grid(make_sweep(models=[ModelSpec(path=str(retrained))])))


def test_changed_option_changes_only_that_job():
    base = {j.config_label: j.id for j in expand_grid(make_sweep())}
    changed = make_sweep(backends=[BackendBlock("bitsandbytes", grid={
        "bits": [4], "quant_type": ["nf4", "fp4"], "double_quant": [False, True],
        "compute_dtype": ["bfloat16"]})])
    new = {j.config_label: j.id for j in expand_grid(changed)}
    assert new["baseline"] == base["baseline"]
    quantized_before = set(base.values()) - {base["baseline"]}
    quantized_after = set(new.values()) - {new["baseline"]}
    assert len(quantized_after) == 4 and quantized_after.isdisjoint(quantized_before)


def test_eval_text_content_is_part_of_the_id(tmp_path):
    text = tmp_path / "eval.txt"
    text.write_text("first version\n")
    first = make_sweep(eval=EvalSettings(text=str(text), seq_len=32, samples=4))
    text.write_text("second version\n")
    second = make_sweep(eval=EvalSettings(text=str(text), seq_len=32, samples=4))
    assert {j.id for j in expand_grid(first)}.isdisjoint(j.id for j in expand_grid(second))


def test_scheduling_settings_do_not_change_ids():
    ids = [j.id for j in expand_grid(make_sweep())]
    rescheduled = make_sweep(retries=5, timeout_s=10, priority=3, jobs_per_gpu=2,
                             eval=EvalSettings(text=DEMO_EVAL_TEXT, seq_len=32, samples=4,
                                               batch_size=1))
    jobs = expand_grid(rescheduled)
    assert [j.id for j in jobs] == ids
    assert jobs[1].resources == {"GPU": 0.5} and jobs[1].priority == 3 and jobs[1].retries == 5


@pytest.mark.parametrize("build, field", [
    (lambda: BackendBlock("bitsandbytes", grid={"bits": [3]}), "grid.bits"),
    (lambda: BackendBlock("bitsandbytes", grid={"bits": []}), "grid.bits"),
    (lambda: BackendBlock("bitsandbytes"), "grid"),
    (lambda: BackendBlock("exl2", grid={"bits": [4]}), "backend"),
    (lambda: BackendBlock("bitsandbytes", configs=[{"bits": 8, "quant_type": "nf4"}]),
     "configs[0].quant_type"),
    (lambda: BackendBlock("bitsandbytes", configs=[{"bits": 4, "int8_threshold": 1.0}]),
     "configs[0].int8_threshold"),
    (lambda: BackendBlock("bitsandbytes", configs=[{"bits": True}]), "configs[0].bits"),
    (lambda: BackendBlock("bitsandbytes", configs=[{"quant_type": "nf4"}]), "configs[0].bits"),
    (lambda: ModelSpec(path="/nonexistent/model"), "path"),
    (lambda: ModelSpec(), "path"),
    (lambda: ModelSpec(hub="not a hub id"), "hub"),
    (lambda: EvalSettings(text="/nonexistent.txt"), "text"),
    (lambda: EvalSettings(text=DEMO_EVAL_TEXT, seq_len=0), "seq_len"),
    (lambda: make_sweep(jobs_per_gpu=0), "jobs_per_gpu"),
    (lambda: make_sweep(retries=-1), "retries"),
    (lambda: make_sweep(models=[]), "models"),
])
def test_invalid_specs_name_the_field(build, field):
    with pytest.raises(SpecError) as info:
        build()
    assert info.value.field == field
    assert info.value.message


# Pinned before backend options became dataclasses (issue 28) from the code of then: a change to
# any job id, or to the options JSON that results store in `config`, fails here, since it would
# orphan every earlier run's results. (config_label, job id, config). These are the ids with
# eval.kl_tail_samples: 0, the lower-bound KL every run measured then; the default since issue
# 29 samples the tail, a different measurement, so its jobs have ids of their own
# (test_id_is_a_pure_function_of_the_canonical_spec).
DEMO_SWEEP_JOBS = [
    ("baseline", "none-650a1d1e8ad89e29", '{}'),
    ("nf4", "bitsandbytes-05d05ed5f6b34de0",
     '{"bits": 4, "compute_dtype": "float32", "double_quant": false, "quant_type": "nf4"}'),
    ("nf4 dq", "bitsandbytes-4421e1485351d08f",
     '{"bits": 4, "compute_dtype": "float32", "double_quant": true, "quant_type": "nf4"}'),
    ("fp4", "bitsandbytes-d2acfe096717b20d",
     '{"bits": 4, "compute_dtype": "float32", "double_quant": false, "quant_type": "fp4"}'),
    ("fp4 dq", "bitsandbytes-030957b0a7b6414a",
     '{"bits": 4, "compute_dtype": "float32", "double_quant": true, "quant_type": "fp4"}'),
    ("int8 t=6", "bitsandbytes-7dca2a2b45a4475a", '{"bits": 8, "int8_threshold": 6.0}'),
    ("int8 t=0", "bitsandbytes-98d2ebd050efaa40", '{"bits": 8, "int8_threshold": 0.0}'),
]
TYPED_OPTIONS_SWEEP = {
    "name": "typed-options",
    "models": [{"path": "demo-model"}],
    "backends": [
        {"backend": "torchao", "configs": [
            {"mode": "int8_weight_only"}, {"mode": "int4_weight_only"},
            {"mode": "int4_weight_only", "group_size": 64,
             "skip_modules": ["lm_head", "model.layers.0.mlp.down_proj"]},
            {"mode": "int8_weight_only", "skip_modules": []}]},
        {"backend": "hqq", "configs": [
            {"bits": 4}, {"bits": 4, "group_size": 64, "axis": 1, "skip_modules": ["lm_head"]},
            {"bits": 2, "group_size": 32, "axis": 0,
             "skip_modules": ["lm_head", "embed_tokens"]}]},
        {"backend": "autoround", "configs": [
            {"bits": 4},
            {"bits": 3, "group_size": 64, "sym": False, "iters": 0,
             "skip_modules": ["lm_head", "model.layers.1"]}]},
        {"backend": "bitsandbytes", "configs": [
            {"bits": 4, "skip_modules": ["lm_head", "model.layers.0.self_attn.q_proj"]},
            {"bits": 8, "skip_modules": ["lm_head"]}]},
    ],
    "eval": {"text": "demo/eval.txt", "seq_len": 32, "samples": 4},
    "calibration": {"text": "demo/eval.txt", "samples": 4, "seq_len": 32},
}
TYPED_OPTIONS_JOBS = [
    ("baseline", "none-2c70c414fc7a5f0a", '{}'),
    ("ao int8wo", "torchao-798d68ce4b40edeb",
     '{"mode": "int8_weight_only", "skip_modules": ["lm_head"]}'),
    ("ao int4wo g128", "torchao-a8ef95d151fda3ed",
     '{"group_size": 128, "mode": "int4_weight_only", "skip_modules": ["lm_head"]}'),
    ("ao int4wo g64 skip=lm_head,model.layers.0.mlp.down_proj", "torchao-62c54e7687b34692",
     '{"group_size": 64, "mode": "int4_weight_only", "skip_modules": ["lm_head", '
     '"model.layers.0.mlp.down_proj"]}'),
    ("ao int8wo", "torchao-94250b5b98579ea3", '{"mode": "int8_weight_only", "skip_modules": []}'),
    ("hqq 4b g64", "hqq-1bd3b87c4f252853",
     '{"axis": 1, "bits": 4, "group_size": 64, "skip_modules": ["lm_head"]}'),
    ("hqq 2b g32 axis0 skip=lm_head,embed_tokens", "hqq-9b8fda50df97b244",
     '{"axis": 0, "bits": 2, "group_size": 32, "skip_modules": ["lm_head", "embed_tokens"]}'),
    ("autoround 4b g128 i200", "autoround-a174bff8e8213081",
     '{"bits": 4, "group_size": 128, "iters": 200, "skip_modules": ["lm_head"], "sym": true}'),
    ("autoround 3b g64 rtn asym skip=lm_head,model.layers.1", "autoround-c118b38d6205f31b",
     '{"bits": 3, "group_size": 64, "iters": 0, "skip_modules": ["lm_head", "model.layers.1"], '
     '"sym": false}'),
    ("nf4 skip=lm_head,model.layers.0.self_attn.q_proj", "bitsandbytes-4f65ff3b158ddf80",
     '{"bits": 4, "compute_dtype": "float32", "double_quant": false, "quant_type": "nf4", '
     '"skip_modules": ["lm_head", "model.layers.0.self_attn.q_proj"]}'),
    ("int8 t=6 skip=lm_head", "bitsandbytes-c326beaa19bfd350",
     '{"bits": 8, "int8_threshold": 6.0, "skip_modules": ["lm_head"]}'),
]


@pytest.mark.parametrize("sweep, pinned", [
    (lambda: load_sweep(demo_sweep()), DEMO_SWEEP_JOBS),
    (lambda: sweep_from_dict(TYPED_OPTIONS_SWEEP, root=str(demo_sweep().parent)),
     TYPED_OPTIONS_JOBS),
], ids=["demo sweep", "torchao, hqq, autoround"])
def test_job_ids_and_stored_options_are_pinned(sweep, pinned):
    # The ids were pinned before the tail samples and the demo's tasks and speed blocks: a
    # sweep without them keeps its ids (tasks and speed are part of the ids only when given:
    # test_tasks.py, test_speed.py; the demo's speed block, issue 39, gave its jobs new ids).
    sweep = sweep()
    jobs = expand_grid(dataclasses.replace(
        sweep, eval=dataclasses.replace(sweep.eval, kl_tail_samples=0), tasks=None, speed=None,
        gates=[]))
    assert [(r["config_label"], r["job_id"], r["config"]) for r in plan_rows(jobs)] == pinned
    for job in jobs:
        backend = get_backend(job.backend)
        stored = json.loads(plan_rows([job])[0]["config"])
        # Typed and hashable, keys sorted, and what a stored config normalizes back to (the
        # memory estimate reads earlier results' options so).
        assert isinstance(job.options, backend.options_type) and hash(job.options) is not None
        assert job.options.as_dict() == stored and list(stored) == sorted(stored)
        assert backend.normalize(stored, "config") == job.options
