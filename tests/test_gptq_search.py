"""GPTQ as a mixed-precision search backend (issue 56): probes by a stated proxy
(round-to-nearest at the same bits and group size), each holding the bytes the GPTQ checkpoint
stores; the verifying jobs fit real GPTQ with gptqmodel's per-module ``dynamic`` config, and
the mix's checkpoint reloads with ``GPTQModel.load`` in a fresh process to the recorded KL,
where plain ``from_pretrained`` refuses it. On the demo model, on the real cluster."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from quantdask.demo_model import DEMO_MODEL_DIR
from tests.conftest import calibration_file, sweep_dict

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("gptqmodel") is None, reason="gptqmodel is not installed")]


def test_a_proxy_cell_holds_round_to_nearest_weights_and_the_checkpoints_bytes():
    import torch

    from quantdask.backends import get_backend
    from quantdask.backends.gptq.mixed import gptq_layer_bytes, rtn_proxy

    gptq = get_backend("gptq")
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=False)
    for bits, group in ((4, 32), (3, 128), (8, -1)):
        options = gptq.normalize({"bits": bits, "group_size": group}, "test")
        proxy = rtn_proxy(linear, options)
        # an independent round-to-nearest: each group's largest magnitude on the top code
        width = 128 if group == -1 else group
        w = linear.weight.detach().reshape(64, -1, width)
        scale = (w.abs().amax(-1, keepdim=True) * 2 / (2 ** bits - 1)).half().float()
        zero = 2 ** (bits - 1)
        expected = scale * (torch.clamp(torch.round(w / scale) + zero, 0, 2 ** bits - 1) - zero)
        assert torch.allclose(proxy.weight, expected.reshape(64, 128), atol=1e-6)
        assert len(torch.unique(proxy.weight[0, :width])) <= 2 ** bits
        assert proxy.checkpoint_bytes == gptq_layer_bytes(128, 64, bits, group)
    # the probe's bytes are the checkpoint's, as the job's stored size counts them
    assert gptq_layer_bytes(128, 64, 4, 32) == 128 * 64 // 2 + 4 * 64 // 2 + 4 * 64 * 2 + 128 * 4


def test_a_gptq_mix_with_a_null_module_or_an_unknown_name_is_refused():
    from quantdask.backends import get_backend
    from quantdask.errors import SpecError
    from quantdask.plan.model_facts import model_facts
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    facts = model_facts(expand_grid(sweep_from_dict(sweep_dict()))[0])
    gptq = get_backend("gptq")
    with pytest.raises(SpecError, match="modules.model.layers.0.mlp.up_proj.*8 bits"):
        gptq.normalize({"bits": 4, "modules": {"model.layers.0.mlp.up_proj": None}}, "o")
    with pytest.raises(SpecError, match="modules.a.bit.*unknown key"):
        gptq.normalize({"bits": 4, "modules": {"a": {"bit": 2}}}, "o")
    options = gptq.normalize({"bits": 4, "modules": {"model.layers.9.mlp.up_proj": {"bits": 8}}},
                             "o")
    assert "not linear layers gptq quantizes" in gptq.check(options, facts)
    odd = gptq.normalize({"bits": 4, "modules": {"model.layers.0.mlp.down_proj":
                                                 {"group_size": 256}}}, "o")
    assert "group_size=256 does not divide model.layers.0.mlp.down_proj" in gptq.check(
        odd, facts)


@pytest.fixture(scope="module")
def gptq_search(cluster, tmp_path_factory):
    """A GPTQ search of the demo model (3, 4 and 8 bits at group size 32, per decoder
    layer) with its artifacts kept."""
    import quantdask as qd
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    root = tmp_path_factory.mktemp("gptq-search")
    calibration = calibration_file(tmp_path_factory, 300, seed=5)
    sweep = sweep_from_dict(sweep_dict(
        name="gptq-search", backends=[],
        eval={"text": sweep_dict()["eval"]["text"], "seq_len": 64, "samples": 16,
              "batch_size": 8},
        calibration={"text": calibration, "samples": 8, "seq_len": 64},
        searches=[{"name": "mix", "model": "demo", "backend": "gptq",
                   "base": {"group_size": 32},
                   "formats": {"b3": {"bits": 3}, "b4": {"bits": 4}, "b8": {"bits": 8}},
                   "granularity": "block", "budget": {"bits_per_weight": 9.0}, "windows": 8}],
        artifacts={"keep": "done", "to": str(root / "models"), "verify": True}, retries=0))
    return qd.run_sweep(sweep, root / "run", cluster.client), root


FRESH = """
import json, sys, torch
from transformers import AutoModelForCausalLM
windows = torch.load(sys.argv[1])
def log_probs(model):
    with torch.inference_mode():
        return torch.log_softmax(model.eval()(input_ids=windows).logits[:, :-1].double(), -1)
p = log_probs(AutoModelForCausalLM.from_pretrained(sys.argv[2]))
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[3])
    plain = "loaded"
except Exception as error:
    plain = f"{type(error).__name__}: {error}"
from gptqmodel import BACKEND, GPTQModel
# as a user loads it (gptqmodel's loader takes half precision on the CPU)
q = log_probs(GPTQModel.load(sys.argv[3], device="cpu", backend=BACKEND.TORCH,
                             dtype=torch.bfloat16).model.float())
per_token = (p.exp() * (p - q)).sum(-1).flatten()
print(json.dumps({"kl": per_token.mean().item(), "plain": plain,
                  "se": (per_token.std() / per_token.numel() ** 0.5).item()}))
"""


def test_a_gptq_search_fits_its_mix_and_ships_one_checkpoint_gptqmodel_loads(gptq_search):
    import torch

    from quantdask.backends.gptq.mixed import PROXY, SHIPS_AS
    from quantdask.measure.reference import compute_reference
    from quantdask.report.search import agreement_table
    from quantdask.store.run_store import read_frame
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    results, root = gptq_search
    assert set(results["status"]) == {"done"}, results.select(
        "config_label", "status", "error_message").rows()
    searched = {row["config_label"]: row for row in
                results.filter(pl.col("search") == "mix").iter_rows(named=True)}
    assert {"mix 9b #1", "mix uniform b3", "mix uniform b4", "mix uniform b8"} <= set(searched)
    for label, row in searched.items():
        # the proxy's cells count the bytes the fitted checkpoint stores, exactly
        assert row["size_bytes"] == row["predicted_bytes"], label
    mixed = searched["mix 9b #1"]
    assert mixed["bits_per_weight"] <= 9.0
    allocation = read_frame(root / "run", "allocation").filter(
        pl.col("job_id") == mixed["job_id"])
    assert set(allocation["predicted_in"]) == {f"torch, {PROXY}"}
    assert len(set(allocation["format"])) > 1  # a mix, not a uniform format
    # the checkpoint is one file of per-module formats: gptqmodel's dynamic, as allocated
    saved = Path(mixed["artifact_uri"])
    dynamic = json.loads((saved / "config.json").read_text())["quantization_config"]["dynamic"]
    bits = {"b3": 3, "b4": 4, "b8": 8}
    for row in allocation.iter_rows(named=True):
        layer = [name for name in dynamic if name.startswith(row["unit"] + ".")]
        assert len(layer) == 7 and {dynamic[n]["bits"] for n in layer} == {bits[row["format"]]}
    assert abs(mixed["reload_kl_delta"]) < 1e-3  # the worker's reload, with GPTQModel.load
    # predicted (the proxy) against measured (real GPTQ), labelled a proxy, and the file
    [agreement] = agreement_table(results).to_dicts()
    assert agreement["proxy"] and agreement["spearman"] is not None
    assert agreement["spearman"] >= 0.6, agreement
    assert SHIPS_AS in agreement["file"]
    # A fresh process loads the mix as its users do and measures the recorded KL.
    sweep = sweep_from_dict(sweep_dict(eval={"text": sweep_dict()["eval"]["text"],
                                             "seq_len": 64, "samples": 16, "batch_size": 8}))
    baseline = expand_grid(sweep)[0]
    reference = compute_reference(baseline.model, baseline.eval, baseline.eval.read_text())
    torch.save(reference.windows, root / "windows.pt")
    fresh = subprocess.run([sys.executable, "-c", FRESH, str(root / "windows.pt"),
                            DEMO_MODEL_DIR, str(saved)], capture_output=True, text=True,
                           timeout=300, cwd=root, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    measured = json.loads([line for line in fresh.stdout.splitlines()
                           if line.startswith('{"kl"')][-1])
    assert abs(measured["kl"] - mixed["kl_divergence"]) <= 0.05 * mixed["kl_divergence"]
    # plain transformers cannot load a mixed GPTQ checkpoint (what the report says)
    assert "size mismatch" in measured["plain"] or "mismatch" in measured["plain"], measured


def test_a_gptq_search_ties_what_vllm_fuses_unless_told_otherwise():
    from quantdask.backends.gptq.mixed import FUSED
    from quantdask.sweepfile.search import SearchSpec

    units = [f"model.layers.{i}.{part}.{name}" for i in (0, 1) for part, names in
             (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
              ("mlp", ("gate_proj", "up_proj", "down_proj"))) for name in names]

    def search(**extra):
        return SearchSpec(name="mix", model="demo", backend="gptq", base={"group_size": 32},
                          formats={"b4": {"bits": 4}, "b8": {"bits": 8}},
                          budget={"bits_per_weight": 6.0}, **extra)

    assert search().ties() == [list(names) for names in FUSED]
    assert search().ties_in(units) == [
        ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
         "model.layers.0.self_attn.v_proj"],
        ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
        ["model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
         "model.layers.1.self_attn.v_proj"],
        ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]]
    assert search(tie=[]).ties_in(units) == []  # overridden: each linear its own
    hqq = SearchSpec(name="mix", model="demo", backend="hqq", formats={"b4": {"bits": 4}},
                     budget={"bits_per_weight": 6.0})
    assert hqq.ties_in(units) == []  # a runtime that fuses nothing ties nothing


@pytest.fixture(scope="module")
def gptq_moe_search(cluster, tmp_path_factory):
    """A GPTQ search of a tiny Mixtral (4 experts; 4 and 8 bits at group size 32, per linear)
    with its artifacts kept."""
    import quantdask as qd
    from quantdask.sweepfile.sweep_file import sweep_from_dict
    from tests.tiny_families import build_tiny

    root = tmp_path_factory.mktemp("gptq-moe")
    sweep = sweep_from_dict(sweep_dict(
        name="gptq-moe", backends=[],
        models=[{"name": "moe", "path": str(build_tiny("mixtral", root / "mixtral"))}],
        eval={"text": sweep_dict()["eval"]["text"], "seq_len": 64, "samples": 8,
              "batch_size": 8},
        calibration={"text": calibration_file(tmp_path_factory, 300, seed=5), "samples": 8,
                     "seq_len": 64},
        searches=[{"name": "mix", "model": "moe", "backend": "gptq",
                   "base": {"group_size": 32},
                   "formats": {"b4": {"bits": 4}, "b8": {"bits": 8}},
                   "budget": {"bits_per_weight": 16.0}, "windows": 8}],
        artifacts={"keep": "done", "to": str(root / "models"), "verify": True}, retries=0))
    return qd.run_sweep(sweep, root / "run", cluster.client), root


def test_a_gptq_search_of_a_moe_gives_all_of_a_layers_experts_one_format(gptq_moe_search):
    """vLLM runs a layer's experts as one fused MoE kernel of one bits and group size: each
    fused experts projection is one unit, fitted by gptqmodel as its per-expert linears."""
    from safetensors import safe_open

    from quantdask.store.run_store import read_frame

    results, root = gptq_moe_search
    assert set(results["status"]) == {"done"}, results.select(
        "config_label", "status", "error_message").rows()
    searched = results.filter(pl.col("search") == "mix")
    assert {"mix uniform b4", "mix uniform b8", "mix 16b #1"} <= set(searched["config_label"])
    for row in searched.iter_rows(named=True):  # the experts counted as the checkpoint stores
        assert row["size_bytes"] == row["predicted_bytes"], row["config_label"]
        # reloaded with GPTQModel.load, the uniform ones too: gptqmodel saves one linear per
        # expert, which plain transformers (fused experts) leaves random
        assert abs(row["reload_kl_delta"]) < 1e-3, row["config_label"]
    [mixed] = searched.filter(pl.col("config_label") == "mix 16b #1").to_dicts()
    allocation = read_frame(root / "run", "allocation").filter(
        pl.col("job_id") == mixed["job_id"])
    chosen = dict(allocation.select("unit", "format").unique().iter_rows())
    assert {"model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.1.mlp.experts.down_proj"} <= set(chosen)
    assert len(set(chosen.values())) > 1  # a mix: the checks below tell formats apart
    # each expert's linears in the checkpoint hold the bits chosen for their layer's unit:
    # GPTQ packs (in x bits / 32) rows of codes
    bits = {"b4": 4, "b8": 8}
    saved = Path(mixed["artifact_uri"])
    with safe_open(str(next(saved.glob("*.safetensors"))), "pt") as f:
        rows = {name.removesuffix(".qweight"): f.get_slice(name).get_shape()[0]
                for name in f.keys() if name.endswith(".qweight")}
    for layer in (0, 1):
        experts = f"model.layers.{layer}.mlp.experts"
        for unit, projections, width in ((f"{experts}.gate_up_proj", ("gate_proj", "up_proj"),
                                          64), (f"{experts}.down_proj", ("down_proj",), 128)):
            found = {rows[f"{experts}.{e}.{p}"] for e in range(4) for p in projections}
            assert found == {width * bits[chosen[unit]] // 32}, (unit, found)



def test_loading_a_moe_checkpoint_leaves_transformers_as_it_was(gptq_moe_search):
    """GPTQModel.load swaps transformers' Mixtral experts block for a per-expert one
    process-wide (defuser); a worker puts it back, or its later jobs on Mixtral would build
    another model than a fresh process does."""
    from transformers import conversion_mapping, modeling_utils
    from transformers.models.mixtral import modeling_mixtral

    from quantdask.backends.gptq.saved import load_saved

    results, _ = gptq_moe_search
    # what defuser patches: the experts block, the conversion mapping (and the original it keeps)
    patched = [(modeling_mixtral, "MixtralSparseMoeBlock")] + [
        (module, name) for module in (conversion_mapping, modeling_utils)
        for name in ("get_checkpoint_conversion_mapping", "orig_get_checkpoint_conversion_mapping")]
    before = [vars(module).get(name) for module, name in patched]
    [saved] = results.filter(pl.col("config_label") == "mix uniform b4")["artifact_uri"]
    loaded = load_saved(saved, "cpu")
    # one linear per expert in the model loaded, and transformers as it was
    assert type(loaded.model.layers[0].mlp) is not modeling_mixtral.MixtralSparseMoeBlock
    assert [vars(module).get(name) for module, name in patched] == before
