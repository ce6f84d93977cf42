"""A search's sensitivity probes (quantdask.search.probes): each cell's KL against an
independent computation (the hqq backend's own model with that module quantized, run whole),
starting from captured hidden states giving exactly the whole forward's figures, and each
cell's bytes adding up to the quantized model's size, on the demo model and test families."""

from __future__ import annotations

import pytest

from quantdask.backends import get_backend
from quantdask.backends.hqq import HqqOptions, quantize_hqq
from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR
from quantdask.measure.metrics import quality
from quantdask.measure.reference import compute_reference
from quantdask.measure.usage import stored_tensors
from quantdask.process.model_source import load_model_source
from quantdask.search.probes import Prober, layer_index, linear_units
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.settings import EvalSettings
from tests.tiny_families import build_tiny

pytestmark = pytest.mark.timeout(240)
HQQ = get_backend("hqq")


def options(bits: int, group: int = 32, **extra) -> HqqOptions:
    return HqqOptions(bits=bits, group_size=group, axis=1, skip_modules=("lm_head",), **extra)


def prober_for(path: str):
    spec, settings = ModelSpec(path=path), EvalSettings(text=DEMO_EVAL_TEXT, seq_len=32,
                                                       samples=6, batch_size=4)
    with open(DEMO_EVAL_TEXT) as f:
        reference = compute_reference(spec, settings, f.read())
    source = load_model_source(spec)
    model = source.build("cpu")
    return source, Prober(model, reference.windows, reference.distribution, 4, "cpu"), reference


@pytest.fixture(scope="module")
def demo():
    return prober_for(DEMO_MODEL_DIR)


def whole_model_kl(source, reference, units: dict, unit: str, bits: int) -> tuple[float, int]:
    """The hqq backend's own model with only ``unit`` quantized (every other linear kept by
    ``modules``), run whole: its KL and stored bytes."""
    kept = {m: None for u, modules in units.items() if u != unit for m in modules}
    model = quantize_hqq(source, options(bits, modules=kept), "cpu")
    figures = quality(model, reference.windows, reference.distribution, 4, "cpu")
    return figures.kl_divergence, sum(size for _, _, size in stored_tensors(model))


def test_a_cell_measures_what_the_whole_quantized_model_measures(demo):
    source, prober, reference = demo
    units = linear_units(prober.model, "linear")
    rest = prober.rest_bytes(units)
    full = {u: prober.probe(u, m, "keep", HQQ, None) for u, m in units.items()}
    assert all(cell.kl == 0 and cell.bytes > 0 for cell in full.values())
    last = max(layer_index(u, prober.prefix) for u in units)
    for unit in [u for u in units if layer_index(u, prober.prefix) in (0, last)][::3]:
        cell = prober.probe(unit, units[unit], "b2", HQQ, options(2))
        kl, size = whole_model_kl(source, reference, units, unit, 2)
        assert cell.kl == pytest.approx(kl, rel=1e-5), unit
        assert cell.kl > 0 and cell.kl_se is not None and cell.kl_se > 0
        # The size adds up: the rest, this unit quantized, the others as they are.
        assert rest + cell.bytes + sum(full[u].bytes for u in units if u != unit) == size


@pytest.mark.parametrize("fmt", [{"mode": "int8_weight_only"},
                                 {"mode": "int4_weight_only", "group_size": 32}])
def test_a_torchao_cell_measures_what_torchaos_whole_model_measures(demo, fmt):
    """torchao's own model with one unit quantized runs its own kernels; the probe swaps in
    the dequantized weight: the same KL to 0.1%, the same bytes exactly."""
    from quantdask.backends.torchao import quantize_torchao

    source, prober, reference = demo
    torchao = get_backend("torchao")
    units = linear_units(prober.model, "linear")
    rest = prober.rest_bytes(units)
    full = {u: prober.probe(u, m, "keep", torchao, None).bytes for u, m in units.items()}
    for unit in ("model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj"):
        cell = prober.probe(unit, units[unit], "f", torchao, torchao.normalize(fmt, "f"))
        kept = {m: None for u, modules in units.items() if u != unit for m in modules}
        model = quantize_torchao(source, torchao.normalize({**fmt, "modules": kept}, "f"), "cpu")
        figures = quality(model, reference.windows, reference.distribution, 4, "cpu")
        assert cell.kl == pytest.approx(figures.kl_divergence, rel=1e-3), unit
        size = sum(n for _, _, n in stored_tensors(model, torchao.sizing.stored_bytes))
        assert rest + cell.bytes + sum(full[u] for u in units if u != unit) == size


def test_starting_at_the_units_layer_gives_the_whole_forwards_figures(demo):
    _, prober, _ = demo
    units = linear_units(prober.model, "linear")
    unit = [u for u in units if layer_index(u, prober.prefix) == len(prober.layers) - 1][0]
    module = prober.model.get_submodule(unit)
    original = module.weight.data
    module.weight.data = original * 0.9  # a change in the last layer alone
    try:
        assert prober.measure(len(prober.layers) - 1) == prober.measure(0)
    finally:
        module.weight.data = original
    assert prober.measure(0)[0] == pytest.approx(0, abs=1e-9)  # put back: the reference
    # The layers before the start do not run on the captured batches (the sliced head's check
    # before them, a plain and a sliced forward of one short window, runs the whole model).
    calls = []
    hook = prober.layers[0].register_forward_hook(lambda *_: calls.append(1))
    try:
        prober.measure(len(prober.layers) - 1)
        skipped = len(calls)
        prober.measure(0)
    finally:
        hook.remove()
    batches = -(-prober.windows.size(0) // prober.batch_size)
    assert skipped <= 2 and len(calls) - skipped == skipped + batches


def test_block_units_hold_each_layers_linears_and_fewer_bits_cost_more(demo):
    _, prober, _ = demo
    blocks = linear_units(prober.model, "block")
    linears = linear_units(prober.model, "linear")
    assert sorted(m for ms in blocks.values() for m in ms) == sorted(linears)
    assert list(blocks) == [f"{prober.prefix}.{i}" for i in range(len(prober.layers))]
    unit, modules = next(iter(blocks.items()))
    two, four = (prober.probe(unit, modules, f"b{b}", HQQ, options(b)) for b in (2, 4))
    assert two.kl > four.kl > 0 and two.bytes < four.bytes


@pytest.mark.parametrize("family", ["gpt2", "gemma", "gpt_neox", "qwen2_151k"])
def test_families_probe_from_their_layers_as_the_whole_model_does(family, tmp_path):
    source, prober, reference = prober_for(str(build_tiny(family, tmp_path / family)))
    units = linear_units(prober.model, "linear")
    assert units and all(len(m) == 1 for m in units.values())
    if family == "gpt2":  # torchao's jobs leave Conv1D as it is: its probe refuses one too
        from quantdask.backends.torchao import TorchaoOptions, quantize_module
        from quantdask.errors import UnsupportedHere

        with pytest.raises(UnsupportedHere, match="Conv1D"):
            quantize_module(prober.model.get_submodule(next(iter(units))),
                            TorchaoOptions(mode="int8_weight_only"))
    last = [u for u in units if layer_index(u, prober.prefix) == len(prober.layers) - 1]
    # GPT-2's Conv1D stores (in, out), its square attn.c_proj too: each is swapped in as is
    for unit in last if family == "gpt2" else last[-1:]:
        cell = prober.probe(unit, units[unit], "b2", HQQ, options(2))
        kl, _ = whole_model_kl(source, reference, units, unit, 2)
        assert cell.kl == pytest.approx(kl, rel=1e-4), unit
    assert prober.measure(0)[0] == pytest.approx(0, abs=1e-9)


def test_a_whole_format_swapped_in_layer_by_layer_measures_what_all_at_once_does(demo):
    """Every unit swapped in as its layer runs (one layer's quantized copy at a time) gives
    the figures of every unit swapped in at once, and the same bytes."""
    from quantdask.search.probes import swapped_in

    _, prober, _ = demo
    units = linear_units(prober.model, "linear")
    members = [(m, options(2)) for modules in units.values() for m in modules]
    meter, size = prober.whole(members, HQQ)
    with swapped_in(prober.model, members, HQQ) as at_once:
        kl, _ = prober.measure(None)
    assert meter.scores().kl_divergence == pytest.approx(kl, rel=1e-6) and kl > 0
    assert size == at_once
    assert prober.measure(None)[0] == pytest.approx(0.0, abs=1e-9)  # every weight put back
