"""Sweep specs: grid expansion, the baseline, and deterministic job ids."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys

import pytest

from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR
from quantdask.errors import SpecError
from quantdask.spec.model import ModelSpec
from quantdask.spec.settings import DEFAULT_KL_TOP_K, EvalSettings
from quantdask.spec.sweep import BackendBlock, Sweep, expand_grid

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
        "from tests.test_spec import make_sweep; from quantdask.spec.sweep import expand_grid; "
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
    def sweep(**eval_options) -> Sweep:
        return Sweep(name="s", models=[ModelSpec(path="m", root=str(tmp_path))],
                     backends=[BackendBlock("bitsandbytes", grid={"bits": [8]})],
                     eval=EvalSettings(text="eval.txt", seq_len=16, samples=2,
                                       root=str(tmp_path), **eval_options))

    # The documented rule, worked out here: the id is "<backend>-" + the first 16 hex digits
    # of the sha256 of the canonical job spec as JSON (keys sorted, no spaces, ASCII). The spec:
    # the model (its directory's name, and a fingerprint: the sha256 of config.json's bytes
    # then "<name>:<size>" of each weight file, none here), the backend, its canonical options
    # (defaults filled in), the eval (the text's sha256, seq_len, samples, and kl_top_k unless
    # it is "all") and the seed.
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
    assert ids == [expected_id("none", {}, kl_top_k=DEFAULT_KL_TOP_K),
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
], ids=["seed", "seq_len", "samples", "dtype", "kl_top_k", "exact kl"])
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
    (lambda: BackendBlock("gptq", grid={"bits": [4]}), "backend"),
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
