"""A GGUF search of a mixture-of-experts model (issue 56, ties): each layer's experts are one
unit per projection, as llama.cpp stores them (``ffn_*_exps``, one type for every expert), the
router stays as converted (llama.cpp never quantizes ``ffn_gate_inp``), the probes hold the
bytes and weights the file holds, and the searched file is written with those types. On a tiny
Mixtral built here (nothing downloaded)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from tests.gguf_models import (
    cached_f32,
    gguf_search_sweep,
    llama2_style_model,
    require_gguf,
)

require_gguf()

from quantdask.backends import get_backend  # noqa: E402
from quantdask.gguf.quantize import quantize_gguf, tensor_types  # noqa: E402
from quantdask.gguf.searched import given_types  # noqa: E402
from quantdask.gguf.source import gguf_module  # noqa: E402
from tests.conftest import calibration_file  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral (4 experts of FFN width 256, 2 per token), converted to F32 into the
    conversion cache."""
    folder = llama2_style_model(tmp_path_factory.mktemp("gguf-moe") / "mixtral", ffn=256,
                                experts=4)
    return folder, cached_f32(folder)


def test_fused_experts_are_units_their_router_is_not_and_the_probe_holds_the_files_weights(
        mixtral, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from quantdask.backends.per_module import module_options
    from quantdask.gguf.linear import dequantize_module
    from quantdask.gguf.searched import quantize_module, rest_bytes
    from quantdask.search.members import quantizable
    from quantdask.search.probes import linear_units

    folder, f32 = mixtral
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    units = linear_units(model, "linear", experts=True)
    layer = "model.layers.0"
    assert f"{layer}.mlp.experts.gate_up_proj" in units
    assert f"{layer}.mlp.experts.down_proj" in units
    assert f"{layer}.mlp.gate" not in units  # the router: llama.cpp keeps it
    assert not any("experts" in unit for unit in linear_units(model, "linear"))  # (others')
    block = linear_units(model, "block", experts=True)[layer]
    assert f"{layer}.mlp.experts.down_proj" in block and f"{layer}.mlp.gate" not in block
    gguf = get_backend("gguf")
    options = gguf.normalize({"type": "Q4_K_M", "tensor_type": "Q4_K", "modules": {
        f"{layer}.mlp.experts.gate_up_proj": {"tensor_type": "Q2_K"},
        "model.layers.1.mlp.experts.down_proj": {"tensor_type": "Q8_0"},
        "model.layers.1.self_attn.v_proj": {"tensor_type": "Q6_K"}}}, "test")
    written = quantize_gguf(f32, tmp_path / "mix.gguf", "Q4_K_M", 2,
                            given=given_types(f32, options))
    types = tensor_types(written)
    # every expert of a projection in one tensor, of the type given; the router F32
    assert (types["blk.0.ffn_gate_exps.weight"], types["blk.0.ffn_up_exps.weight"],
            types["blk.0.ffn_down_exps.weight"], types["blk.1.ffn_down_exps.weight"],
            types["blk.1.attn_v.weight"], types["blk.0.ffn_gate_inp.weight"]) == (
        "Q2_K", "Q2_K", "Q4_K", "Q8_0", "Q6_K", "F32")
    tensors = {t.name: t for t in gguf_module().GGUFReader(str(written)).tensors}
    dequantize = gguf_module().quants.dequantize
    for member, names in (
            (f"{layer}.mlp.experts.gate_up_proj",
             ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight")),
            ("model.layers.1.mlp.experts.down_proj", ("blk.1.ffn_down_exps.weight",))):
        module, weight = quantizable(model, member)
        probed = quantize_module(module, module_options(gguf, options, member))
        file_bytes = [np.asarray(tensors[n].data).view(np.uint8) for n in names]
        assert probed.weight_bytes.numpy().nbytes == sum(b.nbytes for b in file_bytes)
        # the file's experts, (experts, rows, row length) each, as transformers fuses them:
        # gate then up, expert by expert
        theirs = torch.cat([torch.from_numpy(dequantize(
            np.asarray(tensors[n].data), tensors[n].tensor_type)).float() for n in names], 1)
        assert torch.equal(dequantize_module(probed).reshape(weight.shape), theirs), member
    # outside the units: the router, the norms (F32) and the embedding and output as written
    outside = sum(int(t.n_bytes) for n, t in tensors.items()
                  if not n.startswith("blk.") or len(t.shape) == 1 or "ffn_gate_inp" in n)
    assert rest_bytes(model, units, options) == outside


def test_only_experts_are_units_a_linear_router_is_none_transposed_experts_refused():
    """Other families: a router that is a linear (one output per expert) stays out of the
    units, a 3-D parameter that is no expert (a convolution) is no unit, and experts stored
    (experts, in, out) are refused rather than quantized along the wrong axis."""
    import types

    import torch

    from quantdask.errors import UnsupportedHere
    from quantdask.search.probes import linear_units

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 6, 8))
            self.down_proj = torch.nn.Parameter(torch.zeros(4, 8, 3))

    def layer():
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp.gate = torch.nn.Linear(8, 4)  # the router: 4 experts
        block.mlp.experts = Experts()
        block.mlp.shared = torch.nn.Linear(8, 8)
        block.conv = torch.nn.Conv1d(8, 8, 3)  # a 3-D weight, no expert
        return block

    model = torch.nn.Module()
    model.config = types.SimpleNamespace(num_hidden_layers=2)
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer(), layer()])
    units = linear_units(model, "linear", experts=True)
    assert set(units) == {f"model.layers.{i}.mlp.{name}" for i in (0, 1) for name in (
        "experts.gate_up_proj", "experts.down_proj", "shared")}
    assert "model.layers.0.mlp.gate" in linear_units(model, "linear")  # (without experts)
    model.model.layers[1].mlp.experts.is_transposed = True  # (experts, in, out): GPT-OSS
    with pytest.raises(UnsupportedHere, match="model.layers.1.mlp.experts"):
        linear_units(model, "linear", experts=True)


@pytest.fixture(scope="module")
def moe_search(mixtral, cluster, tmp_path_factory):
    """A GGUF search of the tiny Mixtral (Q2_K, Q4_K, Q8_0 per unit) run on the cluster."""
    import quantdask as qd

    folder, _ = mixtral
    run_dir = tmp_path_factory.mktemp("gguf-moe") / "run"
    sweep = gguf_search_sweep(folder, calibration_file(tmp_path_factory, 300, seed=11),
                              "gguf-moe", "moe")
    return qd.run_sweep(sweep, run_dir, cluster.client), run_dir


def test_a_moe_search_writes_each_layers_experts_in_one_type_and_predicts_the_files_bytes(
        moe_search, tmp_path):
    import quantdask as qd
    from quantdask.store.run_store import read_frame

    results, run_dir = moe_search
    assert set(results["status"]) == {"done"}, results.select(
        "config_label", "status", "error_message").rows()
    searched = results.filter(pl.col("search") == "mix")
    assert searched.height >= 4
    for row in searched.iter_rows(named=True):  # the probes counted the file's bytes
        assert row["size_bytes"] == row["predicted_bytes"], row["config_label"]
    [mixed] = searched.filter(pl.col("config_label") == "mix 5b #1").to_dicts()
    assert mixed["bits_per_weight"] <= 5.0
    allocation = read_frame(run_dir, "allocation").filter(pl.col("job_id") == mixed["job_id"])
    chosen = dict(allocation.select("unit", "format").unique().iter_rows())
    assert "model.layers.1.mlp.experts.down_proj" in chosen
    assert not any(unit.endswith("mlp.gate") for unit in chosen)
    # the file, exported from the run, holds each layer's experts in the type chosen for them
    exported = qd.export_allocation(run_dir, "mix", 5.0, tmp_path)
    assert exported.job_id == mixed["job_id"]
    types = tensor_types(exported.path)
    kinds = {"q2": "Q2_K", "q4": "Q4_K", "q8": "Q8_0"}
    for layer in (0, 1):
        experts = f"model.layers.{layer}.mlp.experts"
        assert types[f"blk.{layer}.ffn_down_exps.weight"] == kinds[chosen[f"{experts}.down_proj"]]
        gate_up = kinds[chosen[f"{experts}.gate_up_proj"]]
        assert types[f"blk.{layer}.ffn_gate_exps.weight"] == gate_up
        assert types[f"blk.{layer}.ffn_up_exps.weight"] == gate_up
        assert types[f"blk.{layer}.ffn_gate_inp.weight"] == "F32"
