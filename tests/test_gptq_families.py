"""The evidence in ``quantdask.backends.gptq.families`` read from gptqmodel's own code rather
than from a sweep (``tests/test_gptq.py`` has that): AWQ's scaling step alone, before any
rounding, on a tiny model of each family, leaves the logits as they were where AWQ is trusted,
and not where it is refused; and the Phi-3 model its GPTQ saves is not the one transformers
reloads."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from quantdask.backends import get_backend
from quantdask.backends.gptq.families import AWQ_FAMILIES, FAILS
from quantdask.errors import UnsupportedHere
from tests.tiny_families import build_tiny, tiny_config

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("gptqmodel") is None, reason="gptqmodel is not installed")]

SCALED = ("llama", "mistral", "gemma", "qwen2_151k", "qwen3", "gemma3_text", "phi3")


def scaling_groups(wrapped, layer) -> list[tuple[str, tuple[str, ...]]]:
    """The (op before, layers after) pairs between which gptqmodel's AWQ folds a scale in a
    decoder layer: its layer map's groups (``awq_get_modules_for_scaling``, every layer's
    input captured), less those its AWQ pass drops (``awq_processor._quantize_layer``: an op
    before whose outputs are not the layers' inputs)."""
    from gptqmodel.quantization.awq.utils.module import get_op_name

    captured = {name: torch.zeros(1, 1, module.in_features)
                for name, module in layer.named_modules() if isinstance(module, torch.nn.Linear)}
    groups = []
    for node in wrapped.awq_get_modules_for_scaling(layer, captured, {}):
        before, after = node["prev_op"], node["layers"]
        if isinstance(before, torch.nn.Linear) and before is not after[0] \
                and before.out_features != after[0].in_features:
            continue
        groups.append((get_op_name(layer, before),
                       tuple(get_op_name(layer, module) for module in after)))
    return groups


def tiny_model(family: str):
    """``family``'s tiny model with AWQ-sized layers, built in memory."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(tiny_config(family, awq_sized=True),
                                            dtype=torch.float32).eval()


@pytest.mark.parametrize("family", SCALED)
def test_awqs_scaling_alone_leaves_the_logits_where_awq_is_trusted(family, tmp_path):
    """Each group's scale (random here: a fold must hold for any) divided out of the op before
    and multiplied into the layers after, as gptqmodel does it (``apply_scale``), on the model
    as quantdask hands it over (Phi-3's MLP split, gptqmodel's wrapper of the family)."""
    import defuser

    from quantdask.backends.gptq.backend import _gptqmodel

    torch.manual_seed(0)
    model = tiny_model(family)
    with torch.no_grad():  # norms of a trained model's kind, not the initial ones or zeros
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.2)
    defuser.convert_model(model, cleanup_original=False)
    windows = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    draws = torch.Generator().manual_seed(2)
    options = get_backend("awq").normalize({"group_size": 32}, "configs[0]")
    with torch.no_grad(), _gptqmodel("awq", options, "cpu") as (config, _):
        # (imported as quantdask imports it: with the Hub offline)
        from gptqmodel.models.auto import MODEL_MAP
        from gptqmodel.models.base import BaseQModel
        from gptqmodel.quantization.awq.quantize.scale import apply_scale

        before = model(input_ids=windows).logits
        wrapped = MODEL_MAP.get(model.config.model_type, BaseQModel)(
            model, quantized=False, quantize_config=config, tokenizer=None,
            model_local_path=str(tmp_path))  # (where it would look for a generation config)
        groups = [scaling_groups(wrapped, layer) for layer in model.model.layers]
        for layer, layer_groups in zip(model.model.layers, groups, strict=True):
            apply_scale(layer, [(op, after, torch.exp(0.5 * torch.randn(
                layer.get_submodule(after[0]).in_features, generator=draws)), 0.0)
                for op, after in layer_groups])
        changed = (model(input_ids=windows).logits - before).abs().max().item()
    model_type = model.config.model_type
    if model_type in AWQ_FAMILIES:
        # Every fold Llama's layout has: the input norm into q, k, v; v into o (one head per
        # key/value head); the second norm into gate and up; up into down.
        assert groups[0] == [
            ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("self_attn.v_proj", ("self_attn.o_proj",)),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
            ("mlp.up_proj", ("mlp.down_proj",))], groups[0]
        assert changed < 1e-5, (family, changed)  # float32 rounding (logits of about 1)
    elif model_type == "gemma3_text":
        # Its norms multiply by 1 + w, scaled as if by w, and its MLP reads
        # pre_feedforward_layernorm, not the norm scaled: the logits change as much as they are.
        assert "Gemma3RMSNorm as if it multiplied by w" in FAILS[("awq", model_type)]
        assert changed > 0.1 * before.abs().max().item(), changed
        # And gptqmodel's scale search calls its rotary embedding without the layer type.
        with pytest.raises(TypeError, match="layer_type"):
            model.model.rotary_emb(before, torch.arange(40)[None])
    else:  # Phi-3: no norm before qkv_proj in its layer map, so no group at all
        assert model_type == "phi3" and groups == [[], []]
        assert "no scaling group" in FAILS[("awq", model_type)]


def test_gptqmodels_phi3_gptq_model_reloads_without_its_fused_mlp(tmp_path, monkeypatch):
    """Refused (``FAILS``) because its quantization, let through, saves Phi-3's MLP as the
    gate_proj and up_proj gptqmodel split it into: transformers' Phi-3 reloads it without its
    gate_up_proj, which it would fill at random (quantdask refuses that reload)."""
    import quantdask.backends.gptq.backend as gptq
    from quantdask.measure.calibration import Calibration
    from quantdask.process.model_source import load_model_source
    from quantdask.sweepfile.model import ModelSpec

    assert "gate_up_proj" in FAILS[("gptq", "phi3")]
    source = load_model_source(ModelSpec(path=str(build_tiny("phi3", tmp_path / "phi3"))))
    monkeypatch.setattr(gptq, "family_refusal", lambda method, model_type: None)
    windows = torch.randint(3, 300, (4, 32), generator=torch.Generator().manual_seed(1))
    options = get_backend("gptq").normalize({"bits": 4, "group_size": 32}, "configs[0]")
    with pytest.raises(UnsupportedHere, match=r"reloads without 8 of its weights "
                                              r"\(model\.layers\.0\.mlp\.gate_up_proj\."):
        gptq.quantize_gptq(source, options, "cpu", Calibration(windows, cuda=False))
