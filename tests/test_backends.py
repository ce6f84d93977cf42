"""Backends: the registry, torchao for real, and a user's own backend swept on a real cluster."""

from __future__ import annotations

import sys

import polars as pl
import pytest

import quantdask.backends
from quantdask.backends import Backend, Option, get_backend, register_backend
from quantdask.backends.capabilities import Dequantizes, Lacks
from quantdask.demo_model import DEMO_EVAL_TEXT
from quantdask.errors import SpecError
from quantdask.job.job import run_job
from quantdask.measure.reference import compute_reference
from quantdask.run.sweep import run_sweep
from quantdask.store.readers import read_layers
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.settings import EvalSettings
from quantdask.sweepfile.sweep import BackendBlock, Sweep, expand_grid

pytestmark = pytest.mark.timeout(180)


def sweep_of(demo_model, *blocks: BackendBlock) -> Sweep:
    return Sweep(name="b", models=[ModelSpec(path=demo_model)], backends=list(blocks),
                 eval=EvalSettings(text=DEMO_EVAL_TEXT, seq_len=64, samples=8))


@pytest.fixture(scope="module")
def torchao_outcomes(demo_model):
    sweep = sweep_of(demo_model, BackendBlock(
        "torchao", grid={"mode": ["int4_weight_only"], "group_size": [32, 128, 256]},
        configs=[{"mode": "int8_weight_only"}]))
    jobs = expand_grid(sweep)
    with open(jobs[0].eval.text_path) as f:
        reference = compute_reference(jobs[0].model, jobs[0].eval, f.read())
    return {job.config_label: run_job(job, get_backend(job.backend), reference=reference)
            for job in jobs}


def test_torchao_quantizes_for_real(torchao_outcomes):
    r = torchao_outcomes
    assert {k: v.status for k, v in r.items()} == {
        "baseline": "done", "ao int4wo g32": "done", "ao int4wo g128": "done",
        "ao int4wo g256": "skipped", "ao int8wo": "done"}
    assert r["ao int4wo g128"].record["size_bytes"] < r["ao int4wo g32"].record["size_bytes"] \
        < r["ao int8wo"].record["size_bytes"] < r["baseline"].record["size_bytes"]
    assert 0 < r["ao int8wo"].record["kl_divergence"] < r["ao int4wo g32"].record["kl_divergence"]
    for label in ("ao int4wo g32", "ao int4wo g128", "ao int8wo"):
        assert len(r[label].rows["layers"]) == 28
    g32 = {row["layer"]: row["weight_rel_error"] for row in r["ao int4wo g32"].rows["layers"]}
    g128 = {row["layer"]: row["weight_rel_error"] for row in r["ao int4wo g128"].rows["layers"]}
    assert all(g32[name] < g128[name] for name in g32)  # smaller groups, smaller error
    # The baseline ran after torchao in this process: the cached weights were left intact.
    assert r["baseline"].record["kl_divergence"] == pytest.approx(0.0, abs=1e-9)


def test_a_group_size_that_does_not_divide_a_layer_skips_the_job(torchao_outcomes):
    skipped = torchao_outcomes["ao int4wo g256"].record
    assert skipped["failure_class"] == "unsupported"
    assert skipped["error_class"] == "UnsupportedHere"
    assert "group_size=256 does not divide model.layers.0.self_attn.q_proj.in_features=128" \
        in skipped["error_message"]


@pytest.fixture
def llama_loaded():
    """The demo model's classes, loaded before a test blocks a quantization library:
    transformers imports them lazily, and that import fails while the library is blocked (the
    tests that block one otherwise hinge on an earlier test having loaded them)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401


def test_a_missing_library_skips_the_job_with_an_install_hint(demo_model, llama_loaded,
                                                             monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # import fails
    job = expand_grid(sweep_of(demo_model, BackendBlock(
        "torchao", configs=[{"mode": "int8_weight_only"}])))[1]
    record = run_job(job, get_backend("torchao")).record
    assert record["status"] == "skipped"
    assert "pip install 'quantdask[torchao]'" in record["error_message"]


MIXED = {"model.layers.0.mlp.down_proj": {"bits": 8},
         "model.layers.0.self_attn.q_proj": None,
         "model.layers.1.mlp.up_proj": {"bits": 2, "group_size": 32}}
"""Per-module formats (a search's candidate): one module up, one kept, one down and finer."""


@pytest.fixture(scope="module")
def hqq_outcomes(demo_model):
    sweep = sweep_of(demo_model, BackendBlock("hqq", configs=[
        {"bits": 2, "group_size": 64}, {"bits": 4, "group_size": 64},
        {"bits": 4, "group_size": 64, "modules": MIXED}]))
    jobs = expand_grid(sweep)
    with open(jobs[0].eval.text_path) as f:
        reference = compute_reference(jobs[0].model, jobs[0].eval, f.read())
    return {job.config_label: run_job(job, get_backend(job.backend), reference=reference)
            for job in jobs}


def test_hqq_quantizes_every_linear_layer_but_the_head_for_real(hqq_outcomes, demo_model):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    r = hqq_outcomes
    assert {k: v.status for k, v in r.items()} == {
        "baseline": "done", "hqq 2b g64": "done", "hqq 4b g64": "done",
        "hqq 4b g64 mixed(3 modules)": "done"}
    # Counted independently: the demo model's linear layers but lm_head, from its config.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(demo_model))
    linear = {name: m.weight.numel() for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    total = sum(p.numel() for p in model.parameters())
    for bits in (2, 4):
        outcome = r[f"hqq {bits}b g64"]
        record = outcome.record
        assert record["quantized_params"] == sum(linear.values())
        assert record["quantized_share"] == pytest.approx(sum(linear.values()) / total)
        # Packed codes (bits a weight) and a float32 scale and zero per group of 64; the rest
        # stays float32. HQQ adds a few bytes of layout fields per layer.
        expected = (sum(n * bits // 8 + 2 * (n // 64) * 4 for n in linear.values())
                    + 4 * (total - sum(linear.values())))
        assert expected <= record["size_bytes"] <= expected + 200 * len(linear)
        assert [row["layer"] for row in outcome.rows.get("layers", [])] == list(linear)
    assert 0 < r["hqq 4b g64"].record["kl_divergence"] < r["hqq 2b g64"].record["kl_divergence"]
    two = {row["layer"]: row["weight_rel_error"] for row in r["hqq 2b g64"].rows["layers"]}
    four = {row["layer"]: row["weight_rel_error"] for row in r["hqq 4b g64"].rows["layers"]}
    assert all(0 < four[name] < two[name] < 1 for name in linear)  # fewer bits, more error


def test_hqq_per_module_formats_quantize_each_module_as_named(hqq_outcomes, demo_model):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(demo_model))
    linear = {name: m.weight.numel() for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    total = sum(p.numel() for p in model.parameters())
    formats = {name: (4, 64) for name in linear}  # (bits, group size) of each quantized one
    for name, own in MIXED.items():
        if own is None:
            del formats[name]
        else:
            formats[name] = (own.get("bits", 4), own.get("group_size", 64))
    mixed = hqq_outcomes["hqq 4b g64 mixed(3 modules)"]
    record = mixed.record
    # Counted independently from the names and each one's format.
    assert record["quantized_params"] == sum(linear[n] for n in formats)
    expected = (sum(linear[n] * bits // 8 + 2 * (linear[n] // group) * 4
                    for n, (bits, group) in formats.items())
                + 4 * (total - sum(linear[n] for n in formats)))
    assert expected <= record["size_bytes"] <= expected + 200 * len(formats)
    assert [row["layer"] for row in mixed.rows["layers"]] == list(formats)
    error = {row["layer"]: row["weight_rel_error"] for row in mixed.rows["layers"]}
    four = {row["layer"]: row["weight_rel_error"]
            for row in hqq_outcomes["hqq 4b g64"].rows["layers"]}
    assert error["model.layers.0.mlp.down_proj"] < four["model.layers.0.mlp.down_proj"] / 4
    assert error["model.layers.1.mlp.up_proj"] > four["model.layers.1.mlp.up_proj"]
    untouched = set(formats) - set(MIXED)
    assert all(error[n] == pytest.approx(four[n]) for n in untouched)


def test_hqq_per_module_formats_are_checked_before_anything_runs(demo_model):
    from quantdask.backends.base import ModelFacts
    from quantdask.backends.hqq import HqqOptions, check_hqq

    with pytest.raises(SpecError) as error:
        BackendBlock("hqq", configs=[{"bits": 4, "modules": {"a.b": {"bits": 5}}}])
    assert error.value.field == "configs[0].modules.a.b.bits"
    with pytest.raises(SpecError) as error:
        BackendBlock("hqq", configs=[{"bits": 4, "modules": {"a.b": {"width": 5}}}])
    assert error.value.field == "configs[0].modules.a.b.width"
    with pytest.raises(SpecError, match="must be a mapping"):
        BackendBlock("hqq", configs=[{"bits": 4, "modules": ["a.b"]}])
    facts = ModelFacts({}, 0, False, weight_modules=(
        ("model.layers.0.mlp.down_proj", __import__("torch").nn.Linear, 4096),))
    reason = check_hqq(HqqOptions(bits=4, group_size=64, skip_modules=("lm_head",),
                                  modules={"model.layers.9.mlp": None}),
                       facts)
    assert reason and "not linear layers hqq quantizes" in reason
    # The id hashes the formats; the options stay hashable and read back as given.
    a, b = (expand_grid(sweep_of(demo_model, BackendBlock("hqq", configs=[
        {"bits": 4, "modules": {"model.layers.0.mlp.down_proj": {"bits": bits}}}])))[1]
        for bits in (8, 2))
    assert a.id != b.id and hash(a.options) != hash(b.options)
    assert a.options.as_dict()["modules"] == {"model.layers.0.mlp.down_proj": {"bits": 8}}


def test_hqq_refuses_a_group_that_does_not_divide_a_layer_and_needs_its_bits():
    from quantdask.backends.hqq import HqqOptions, ungroupable

    assert ungroupable(HqqOptions(bits=4, group_size=64), {"a": 128 * 64, "b": 96}) == (
        "group_size=64 does not divide the 96 weights of b; choose a group size that divides "
        "every layer's")
    assert ungroupable(HqqOptions(bits=4, group_size=32), {"a": 128 * 64}) is None
    # A module's own group size is the one that must divide it.
    assert ungroupable(HqqOptions(bits=4, group_size=32, modules={"b": {"group_size": 32}}),
                       {"b": 96}) is None
    with pytest.raises(SpecError, match="bits: is required for hqq"):
        BackendBlock("hqq", configs=[{"group_size": 64}])
    with pytest.raises(SpecError, match="group_size"):
        BackendBlock("hqq", configs=[{"bits": 4, "group_size": 48}])


@pytest.mark.timeout(240)
def test_an_hqq_group_that_does_not_divide_a_layer_is_unsupported_in_the_plan_and_the_job(
        tmp_path):
    from quantdask.plan.planning import plan_sweep
    from tests.tiny_families import build_tiny_llama

    # Width 40, 2 key/value heads of 10: k_proj holds 20 x 40 = 800 weights, no multiple of 64
    # (every layer's is a multiple of 16).
    model = build_tiny_llama(tmp_path, hidden_size=40, intermediate_size=72)
    sweep = sweep_of(model, BackendBlock("hqq", grid={"bits": [4], "group_size": [64, 16]}))
    plan = plan_sweep(sweep).filter(pl.col("backend") == "hqq").sort("config_label")
    assert plan["config_label"].to_list() == ["hqq 4b g16", "hqq 4b g64"]
    assert plan["state"].to_list() == ["to run", "unsupported"]
    reason = ("group_size=64 does not divide the 800 weights of model.layers.0.self_attn.k_proj; "
              "choose a group size that divides every layer's")
    assert plan["reason"].to_list()[1] == reason
    job = next(j for j in expand_grid(sweep) if j.config_label == "hqq 4b g64")
    record = run_job(job, get_backend("hqq")).record  # a worker decides alike
    assert (record["status"], record["failure_class"]) == ("skipped", "unsupported")
    assert record["error_message"] == reason


@pytest.mark.parametrize("bf16_kernel", [True, False])
def test_bnb_4bit_on_a_cpu_whose_kernel_cannot_take_a_width_is_unsupported_up_front(
        tmp_path, monkeypatch, bf16_kernel):
    """On a processor with AVX512-BF16, bitsandbytes' CPU 4-bit kernel repacks each layer at
    its first forward pass and fails on an input width that is no multiple of 64 (a reshape
    error, on every retry): quantdask says so in the plan and skips the job with the reason.
    Without that kernel the same model runs."""
    import bitsandbytes.functional

    from quantdask.plan.planning import plan_sweep
    from tests.tiny_families import build_tiny_llama

    monkeypatch.setattr(bitsandbytes.functional, "has_avx512bf16", lambda: bf16_kernel)
    model = build_tiny_llama(tmp_path, hidden_size=64, intermediate_size=96)  # down_proj: 96 in
    sweep = sweep_of(model, BackendBlock("bitsandbytes", configs=[{"bits": 4},
                                                                         {"bits": 8}]))
    reason = ("bitsandbytes' CPU 4-bit kernel on this processor (AVX512-BF16) needs each "
              "quantized layer's input width to be a multiple of 64: "
              "model.layers.0.mlp.down_proj.in_features=96; quantize on a GPU, or leave the "
              "layer out (skip_modules)")
    plan = {row["config_label"]: row for row in plan_sweep(sweep).iter_rows(named=True)}
    assert plan["int8 t=6"]["state"] == "to run"
    assert (plan["nf4"]["state"], plan["nf4"]["reason"]) == (
        ("unsupported", reason) if bf16_kernel else ("to run", None))
    if bf16_kernel:  # the worker decides alike, before any forward pass
        job = next(j for j in expand_grid(sweep) if j.config_label == "nf4")
        record = run_job(job, get_backend("bitsandbytes")).record
        assert (record["status"], record["failure_class"]) == ("skipped", "unsupported")
        assert record["error_message"] == reason


def test_a_missing_hqq_skips_the_job_with_an_install_hint(demo_model, llama_loaded,
                                                         monkeypatch):
    monkeypatch.setitem(sys.modules, "hqq.core.quantize", None)  # import fails
    job = expand_grid(sweep_of(demo_model, BackendBlock("hqq", configs=[{"bits": 4}])))[1]
    record = run_job(job, get_backend("hqq")).record
    assert record["status"] == "skipped"
    assert "pip install 'quantdask[hqq]'" in record["error_message"]


def test_a_tile_packed_int4_weight_counts_its_own_bytes_not_its_padding():
    # torchao's CUDA int4 layout stores a (200 x 384) weight quantized as (200 x 1024): packed
    # int4 codes (int32 tiles, half a byte a weight) and bf16 scale+zero pairs per group of
    # 128 input features. Built here by hand (from_hp needs a GPU), with the layout's shapes.
    import torch
    from torchao.quantization import Int4TilePackedTo4dTensor

    from quantdask.backends.torchao import stored_bytes
    from quantdask.measure.usage import stored_tensors

    rows, width, group = 200, 384, 128
    padded_rows, padded_width = 200, 1024
    qdata = torch.zeros(padded_rows // 8, padded_width // 128, 32, 4, dtype=torch.int32)
    scale_and_zero = torch.zeros(padded_width // group, padded_rows, 2, dtype=torch.bfloat16)
    weight = Int4TilePackedTo4dTensor(qdata, scale_and_zero, block_size=[1, group],
                                      shape=torch.Size([rows, width]))
    assert qdata.nbytes + scale_and_zero.nbytes == padded_rows * padded_width // 2 + 6_400
    own = rows * width // 2 + (width // group) * rows * 2 * 2  # codes + scale/zero pairs
    assert stored_bytes(weight) == own == 40_800

    layer = torch.nn.Linear(width, rows, bias=False, dtype=torch.bfloat16)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    def size(counted_by=None) -> int:
        return sum(nbytes for *_, nbytes in stored_tensors(layer, counted_by))

    assert size(stored_bytes) == own
    assert size() == 108_800  # what is stored, padding and all
    plain = torch.nn.Linear(4, 2, bias=False)  # any other tensor: its stored bytes
    assert stored_bytes(plain.weight) == 32


def test_torchao_options_are_validated():
    with pytest.raises(SpecError, match="configs\\[0\\].group_size: applies to int4"):
        BackendBlock("torchao", configs=[{"mode": "int8_weight_only", "group_size": 64}])
    with pytest.raises(SpecError, match="grid.group_size: must be 32 or 64 or 128 or 256"):
        BackendBlock("torchao", grid={"mode": ["int4_weight_only"], "group_size": [48]})


def fake_quantize(source, options, device):
    """Round every decoder linear weight to ``bits`` per output row (symmetric, in float)."""
    import torch

    model = source.build(device)
    levels = 2 ** (options["bits"] - 1) - 1
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            weight = module.weight.detach()
            scale = weight.abs().amax(dim=1, keepdim=True) / levels
            module.weight = torch.nn.Parameter((weight / scale).round() * scale)
            module.fake_quantized = True
    return model


def fake_dequantize(module):
    return module.weight.detach().float() if getattr(module, "fake_quantized", False) else None


def test_a_users_backend_is_swept_on_the_real_cluster(cluster, demo_model, tmp_path, monkeypatch):
    monkeypatch.setattr(quantdask.backends, "_REGISTRY", dict(quantdask.backends._REGISTRY))
    register_backend(Backend("rtn", fake_quantize, capabilities=(Dequantizes(fake_dequantize),),
                             options={"bits": Option(int, choices=(3, 4, 8),
                                                     help="bits per weight")}))
    sweep = sweep_of(demo_model, BackendBlock("rtn", grid={"bits": [3, 4, 8]}))
    results = run_sweep(sweep, tmp_path / "run", cluster.client)
    rows = {row["config_label"]: row for row in results.to_dicts()}
    assert {k: v["status"] for k, v in rows.items()} == {
        "baseline": "done", "bits=3": "done", "bits=4": "done", "bits=8": "done"}
    kl = [rows[f"bits={b}"]["kl_divergence"] for b in (8, 4, 3)]
    assert 0 < kl[0] < kl[1] < kl[2]
    layers = read_layers(tmp_path / "run").join(results.select("job_id", "config_label"),
                                                on="job_id")
    assert layers.group_by("config_label").len().sort("config_label").rows() == [
        ("bits=3", 28), ("bits=4", 28), ("bits=8", 28)]
    assert layers.filter(pl.col("config_label") == "bits=8")["weight_rel_error"].max() < 0.01


def test_torchao_per_module_formats_quantize_each_module_as_named(demo_model):
    """torchao's ``modules``: int8 where a module asks for it, int4 of its own group size,
    kept where null, the config's format elsewhere; refused naming the field when wrong."""
    import torch

    from quantdask.backends.base import ModelFacts
    from quantdask.backends.torchao import check_torchao, quantize_torchao
    from quantdask.process.model_source import load_model_source

    torchao = get_backend("torchao")
    own = {"model.layers.0.mlp.down_proj": {"mode": "int8_weight_only", "group_size": None},
           "model.layers.1.mlp.up_proj": {"group_size": 32},
           "model.layers.2.self_attn.q_proj": None}
    options = torchao.normalize({"mode": "int4_weight_only", "group_size": 64, "modules": own},
                                "configs[0]")
    assert torchao.label(options) == "ao int4wo g64 mixed(3 modules)"
    model = quantize_torchao(load_model_source(ModelSpec(path=demo_model)), options, "cpu")
    kinds = {name: (type(m.weight).__name__, getattr(m.weight, "block_size", None))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds["model.layers.0.mlp.down_proj"][0] == "Int8Tensor"
    assert kinds["model.layers.2.self_attn.q_proj"][0] == "Parameter"  # kept
    assert kinds["lm_head"][0] == "Parameter"  # skipped by default
    assert tuple(kinds["model.layers.1.mlp.up_proj"][1])[-1] == 32
    assert tuple(kinds["model.layers.1.mlp.down_proj"][1])[-1] == 64  # the config's own
    for bad, field in (({"a": {"bits": 4}}, "configs[0].modules.a.bits"),
                       ({"a": {"mode": "int8_weight_only", "group_size": 32}},
                        "configs[0].modules.a.group_size")):
        with pytest.raises(SpecError) as error:
            BackendBlock("torchao", configs=[{"mode": "int4_weight_only", "modules": bad}])
        assert error.value.field == field
    facts = ModelFacts({"model.layers.0.mlp.down_proj": 96}, 0, False)
    assert "not linear layers torchao quantizes" in check_torchao(
        torchao.normalize({"mode": "int8_weight_only", "modules": {"x.y": None}}, "c"), facts)
    assert "does not divide" in check_torchao(torchao.normalize(
        {"mode": "int8_weight_only",
         "modules": {"model.layers.0.mlp.down_proj": {"mode": "int4_weight_only",
                                                      "group_size": 64}}}, "c"), facts)


def test_backends_a_search_cannot_use_say_why():
    from quantdask.backends import searchable_backends

    # and gguf, where its extra registered it (tests/test_gguf_search.py)
    # (gptq by a stated proxy: tests/test_gptq_search.py)
    assert [name for name in searchable_backends() if name != "gguf"] == ["gptq", "hqq",
                                                                          "torchao"]
    for name in ("bitsandbytes", "autoround", "awq"):
        backend = get_backend(name)
        why = next(c.why for c in backend.capabilities if isinstance(c, Lacks))
        assert not backend.module_keys and len(why) > 40, name


def test_a_modules_own_format_alone_takes_only_what_applies_to_it():
    from quantdask.backends.per_module import module_options

    torchao, hqq = get_backend("torchao"), get_backend("hqq")
    mixed = torchao.normalize({"mode": "int4_weight_only", "group_size": 64,
                               "modules": {"a": {"mode": "int8_weight_only"}, "b": None}}, "c")
    alone = module_options(torchao, mixed, "a")  # int8 takes no group size: not the config's
    assert (alone.mode, alone.group_size) == ("int8_weight_only", None)
    assert module_options(torchao, mixed, "b") is None
    assert (module_options(torchao, mixed, "z").mode, module_options(torchao, mixed, "z")
            .group_size) == ("int4_weight_only", 64)
    grouped = hqq.normalize({"bits": 4, "group_size": 32, "modules": {"a": {"bits": 2}}}, "c")
    assert (module_options(hqq, grouped, "a").bits,
            module_options(hqq, grouped, "a").group_size) == (2, 32)  # the config's group


def test_libraries_are_imported_with_the_hub_offline_and_the_setting_put_back(tmp_path,
                                                                           monkeypatch):
    """bitsandbytes fetches a CPU kernel from the Hub as it is imported (on AVX512-BF16, with
    ``kernels`` installed): quantdask's imports of the libraries see the Hub offline, and
    leave the setting as it was, after an import that fails too."""
    from huggingface_hub import constants as hub

    from quantdask.util import import_offline

    (tmp_path / "sees_the_hub.py").write_text(
        "from huggingface_hub import constants\nOFFLINE = constants.HF_HUB_OFFLINE\n")
    (tmp_path / "fails_to_import.py").write_text("raise ImportError('not here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    assert import_offline("sees_the_hub").OFFLINE is True
    assert hub.HF_HUB_OFFLINE is False
    with pytest.raises(ImportError, match="not here"):
        import_offline("fails_to_import")
    assert hub.HF_HUB_OFFLINE is False
    monkeypatch.delitem(sys.modules, "sees_the_hub")
