"""GGUF as a mixed-precision search backend (issue 56): each probed module holds the bytes
llama.cpp's quantizer writes for it, the searched allocation is written by that quantizer
with per-tensor types into one .gguf, and that file is what the verifying job measures in
llama.cpp. On a tiny Llama built here (nothing downloaded)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

pytest.importorskip("llama_cpp", reason="pip install 'quantdask[gguf]'")

from quantdask.gguf.source import missing_converter  # noqa: E402

if missing_converter():
    pytest.skip(missing_converter(), allow_module_level=True)

from quantdask.backends import get_backend  # noqa: E402
from quantdask.gguf.quantize import quantize_gguf, tensor_types  # noqa: E402
from quantdask.gguf.searched import given_types  # noqa: E402
from quantdask.gguf.source import gguf_module  # noqa: E402
from tests.conftest import calibration_file  # noqa: E402
from tests.gguf_models import cached_f32, gguf_search_sweep, llama2_style_model  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def narrow_ffn(tmp_path_factory):
    """A tiny Llama whose FFN width (640) is no multiple of 256: its down_proj rows take
    llama.cpp's fallback types. Converted to F32 (into the conversion cache its sweep reads)."""
    folder = llama2_style_model(tmp_path_factory.mktemp("gguf-search") / "llama", ffn=640)
    return folder, cached_f32(folder)


def test_a_probed_module_holds_the_bytes_llama_cpps_quantizer_writes_for_it(narrow_ffn,
                                                                             tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from quantdask.backends.per_module import module_options
    from quantdask.gguf.linear import dequantize_module
    from quantdask.gguf.searched import quantize_module, rest_bytes
    from quantdask.search.probes import linear_units

    folder, f32 = narrow_ffn
    gguf = get_backend("gguf")
    options = gguf.normalize({"type": "Q4_K_M", "tensor_type": "Q4_K", "modules": {
        "model.layers.0.mlp.down_proj": {"tensor_type": "Q6_K"},
        "model.layers.1.mlp.down_proj": {"tensor_type": "Q2_K"},
        "model.layers.1.self_attn.q_proj": {"tensor_type": "Q8_0"},
        "model.layers.1.self_attn.v_proj": None}}, "test")
    written = quantize_gguf(f32, tmp_path / "mix.gguf", "Q4_K_M", 2,
                            given=given_types(f32, options))
    types = tensor_types(written)
    # as given, with llama.cpp's fallback on rows of 640: Q6_K -> Q8_0, Q2_K -> Q4_0
    assert (types["blk.0.ffn_down.weight"], types["blk.1.ffn_down.weight"],
            types["blk.1.attn_q.weight"], types["blk.1.attn_v.weight"],
            types["blk.0.ffn_up.weight"]) == ("Q8_0", "Q4_0", "Q8_0", "F32", "Q4_K")
    tensors = {t.name: t for t in gguf_module().GGUFReader(str(written)).tensors}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for module, name in (("model.layers.0.mlp.down_proj", "blk.0.ffn_down.weight"),
                         ("model.layers.1.mlp.down_proj", "blk.1.ffn_down.weight"),
                         ("model.layers.0.mlp.up_proj", "blk.0.ffn_up.weight"),
                         ("model.layers.1.self_attn.q_proj", "blk.1.attn_q.weight"),
                         ("model.layers.0.self_attn.k_proj", "blk.0.attn_k.weight")):
        probed = quantize_module(model.get_submodule(module),
                                 module_options(gguf, options, module))
        assert probed.tensor_type == types[name], module
        ours = probed.weight_bytes.numpy()
        theirs = np.asarray(tensors[name].data).view(np.uint8).reshape(ours.shape)
        if "attn_q" in name or "attn_k" in name:  # the converter permutes their rows (RoPE)
            assert sorted(map(bytes, ours)) == sorted(map(bytes, theirs)), module
            continue
        assert np.array_equal(ours, theirs), module
        # the weight the probe swaps in is the file's, as gguf-py reads it back
        weight = dequantize_module(probed)
        assert weight.shape == model.get_submodule(module).weight.shape
        assert torch.equal(weight, torch.from_numpy(gguf_module().quants.dequantize(
            theirs, tensors[name].tensor_type)).float())
    # the bytes the file holds outside the searched units (the embedding in Q4_K, the output
    # in Q6_K, the norms in F32), counted from the torch model
    outside = sum(int(t.n_bytes) for n, t in tensors.items()
                  if not (n.startswith("blk.") and len(t.shape) == 2))
    assert rest_bytes(model, linear_units(model, "linear"), options) == outside
    assert (types["token_embd.weight"], types["output.weight"]) == ("Q4_K", "Q6_K")
    # the token embedding and the output as units of their own, by their modules' names
    options = gguf.normalize({"type": "Q4_K_M", "tensor_type": "Q4_K", "modules": {
        "model.embed_tokens": {"tensor_type": "Q5_0"}, "lm_head": {"tensor_type": "Q3_K"}}},
        "test")
    written = quantize_gguf(f32, tmp_path / "ends.gguf", "Q4_K_M", 2,
                            given=given_types(f32, options))
    tensors = {t.name: t for t in gguf_module().GGUFReader(str(written)).tensors}
    for module, name, kind in (("model.embed_tokens", "token_embd.weight", "Q5_0"),
                               ("lm_head", "output.weight", "Q3_K")):
        probed = quantize_module(model.get_submodule(module),
                                 module_options(gguf, options, module))
        ours = probed.weight_bytes.numpy()
        assert tensors[name].tensor_type.name == probed.tensor_type == kind
        assert np.array_equal(ours, np.asarray(tensors[name].data).view(np.uint8).reshape(
            ours.shape)), module
    units = linear_units(model, "linear", embeddings=True)
    assert {"model.embed_tokens", "lm_head"} <= set(units)
    assert rest_bytes(model, units, options) == sum(  # the norms alone, F32
        int(t.n_bytes) for t in tensors.values() if len(t.shape) == 1)


def test_a_mix_assembled_from_kept_tensors_is_the_file_llama_cpps_quantizer_writes(
        narrow_ffn, tmp_path, monkeypatch):
    """``gguf.assembled.write_mix``: each tensor's type and bytes and every metadata value are
    those of llama.cpp's own file for the same mix (the converter's permuted q and k rows
    included); a second mix of the same (tensor, type) pairs quantizes nothing again."""
    import filecmp

    from quantdask.gguf.assembled import write_mix

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    _, f32 = narrow_ffn
    options = get_backend("gguf").normalize({"type": "Q4_K_M", "tensor_type": "Q4_K", "modules": {
        "model.layers.0.mlp.down_proj": {"tensor_type": "Q6_K"},
        "model.layers.1.self_attn.q_proj": {"tensor_type": "Q8_0"},
        "model.layers.0.self_attn.k_proj": {"tensor_type": "Q2_K"},
        "model.layers.1.self_attn.v_proj": None}}, "test")
    given = given_types(f32, options)
    theirs = quantize_gguf(f32, tmp_path / "theirs.gguf", "Q4_K_M", 2, given=given)
    ours, by = write_mix(f32, tmp_path / "ours.gguf", "Q4_K_M", 1, given)
    read = gguf_module().GGUFReader
    a = {t.name: t for t in read(str(theirs)).tensors}
    b = {t.name: t for t in read(str(ours)).tensors}
    assert a.keys() == b.keys()
    quantized = [n for n, t in a.items() if t.tensor_type.name != "F32"]
    assert by == f"assembled: {len(quantized)} of {len(quantized)} tensors quantized here"
    assert {a[n].tensor_type.name for n in quantized} >= {"Q4_K", "Q8_0", "Q2_K", "Q6_K"}
    for name in a:
        assert a[name].tensor_type == b[name].tensor_type, name
        assert np.array_equal(np.asarray(a[name].data).view(np.uint8),
                              np.asarray(b[name].data).view(np.uint8)), name
    fields = {f.name: f.contents() for f in read(str(theirs)).fields.values()
              if not f.name.startswith("GGUF.")}
    assert fields == {f.name: f.contents() for f in read(str(ours)).fields.values()
                      if not f.name.startswith("GGUF.")}
    again, by = write_mix(f32, tmp_path / "again.gguf", "Q4_K_M", 1, given)
    assert by == f"assembled: 0 of {len(quantized)} tensors quantized here"
    assert filecmp.cmp(ours, again, shallow=False)


@pytest.fixture(scope="module")
def gguf_search(narrow_ffn, cluster, tmp_path_factory):
    """A GGUF search of the tiny Llama (Q2_K, Q4_K and Q8_0 per linear, the rest as Q4_K_M
    writes it) run on the cluster: its results and run folder."""
    import quantdask as qd

    folder, _ = narrow_ffn
    calibration = calibration_file(tmp_path_factory, 300, seed=11)
    run_dir = tmp_path_factory.mktemp("gguf-search") / "run"
    sweep = gguf_search_sweep(folder, calibration, "gguf-search", "llama")
    return qd.run_sweep(sweep, run_dir, cluster.client), run_dir


def test_a_gguf_search_writes_its_allocation_into_one_file_measured_in_llama_cpp(gguf_search):
    from collections import Counter

    import quantdask as qd
    from quantdask.cli.summary import search_lines
    from quantdask.gguf.tensors import written_type
    from quantdask.report.search import agreement_table
    from quantdask.store.run_store import read_frame

    results, run_dir = gguf_search
    assert set(results["status"]) == {"done"}, results.select(
        "config_label", "status", "error_message").rows()
    searched = {row["config_label"]: row for row in
                results.filter(pl.col("search") == "mix").iter_rows(named=True)}
    assert set(searched) >= {"mix 5b #1", "mix uniform q2", "mix uniform q4", "mix uniform q8"}
    for label, row in searched.items():
        # the probes counted the bytes the file's tensors hold, as llama.cpp writes them
        assert row["size_bytes"] == row["predicted_bytes"], label
        assert row["runtime"].startswith("llama.cpp"), label
    # down_proj's rows of 640 take llama.cpp's fallback type, and the job says so
    assert 0 < searched["mix uniform q4"]["fallback_share"] < 0.5
    mixed = searched["mix 5b #1"]
    assert mixed["bits_per_weight"] <= 5.0
    # the file holds the allocation's types, tensor by tensor (down_proj's rows of 640 in
    # llama.cpp's fallback), the token embedding and the output among its units
    allocation = read_frame(run_dir, "allocation").filter(pl.col("job_id") == mixed["job_id"])
    predicted = {p.split(", from")[0] for p in allocation["predicted_in"]}
    assert predicted == {"torch, a proxy for llama.cpp"}
    kinds = {"q2": "Q2_K", "q4": "Q4_K", "q8": "Q8_0"}
    expected = Counter(written_type(kinds[row["format"]], 640 if "down_proj" in row["unit"]
                                    else 256) for row in allocation.iter_rows(named=True))
    assert {"model.embed_tokens", "lm_head"} <= set(allocation["unit"])
    expected.update({"F32": 5})  # the norms
    written = Counter({kind: int(n) for n, kind in
                       (part.split(" ") for part in mixed["tensor_types"].split(", "))})
    assert written == expected and len(set(allocation["format"])) > 1
    # mixed beats uniform Q4_K at no more bytes, measured in llama.cpp, beyond the error bars
    equal, uniform = searched["mix mixed at q4 bytes"], searched["mix uniform q4"]
    assert equal["size_bytes"] <= uniform["size_bytes"]
    slack = 2 * (equal["kl_se"] ** 2 + uniform["kl_se"] ** 2) ** 0.5
    assert equal["kl_divergence"] < uniform["kl_divergence"] - slack
    # the torch probes are a proxy for llama.cpp's figures: they rank the jobs as measured
    [agreement] = agreement_table(results).to_dicts()
    assert agreement["jobs"] == len(searched) and agreement["spearman"] >= 0.9
    assert agreement["proxy"] and agreement["measured_in"] == "llama.cpp"
    joined = qd.read_allocation(run_dir).filter(pl.col("job_id") == mixed["job_id"])
    assert set(joined["kl_divergence"]) == {mixed["kl_divergence"]}
    assert set(joined["spearman"]) == {agreement["spearman"]} and joined["proxy"].all()
    [line] = search_lines(results)
    assert "Spearman" in line and "a proxy: predicted in torch" in line
    assert "measured in llama.cpp" in line
    assert "its mix: one file: quantdask export allocation" in line


def test_the_allocation_exports_as_one_gguf_that_gives_the_recorded_kl(gguf_search, narrow_ffn,
                                                                       tmp_path, capsys):
    from quantdask.cli.main import main
    from quantdask.gguf.quantize import type_counts
    from quantdask.gguf.runtime import RuntimeDevice, llama_cpp_meter
    from quantdask.measure.reference import compute_reference
    from quantdask.sweepfile.bos import window_bos
    from quantdask.sweepfile.model import ModelSpec
    from quantdask.sweepfile.settings import EvalSettings

    results, run_dir = gguf_search
    folder, _ = narrow_ffn
    [mixed] = results.filter(pl.col("config_label") == "mix 5b #1").to_dicts()
    assert main(["export", "allocation", str(run_dir), "--search", "mix", "--budget", "5",
                 "--to", str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert f"job {mixed['job_id']}" in said and "measured KL" in said
    [written] = (tmp_path / "out").glob("*.gguf")
    assert type_counts(tensor_types(written)) == mixed["tensor_types"]
    # loaded in llama.cpp on the sweep's own eval windows, it gives the KL the job recorded
    model = ModelSpec(path=str(folder))
    settings = EvalSettings(text=str(folder / "eval.txt"), seq_len=128, samples=8,
                            batch_size=4, kl_top_k="all")
    settings = settings.with_bos(window_bos(settings.bos, model))
    reference = compute_reference(model, settings, (folder / "eval.txt").read_text())
    kl = llama_cpp_meter(written, reference.windows, reference.distribution,
                         RuntimeDevice(2)).scores().kl_divergence
    assert kl == pytest.approx(mixed["kl_divergence"], rel=1e-3)
    # a search or budget the run did not solve is refused, naming the ones it did
    assert main(["export", "allocation", str(run_dir), "--search", "nope", "--budget", "5",
                 "--to", str(tmp_path)]) == 2
    assert main(["export", "allocation", str(run_dir), "--search", "mix", "--budget", "4",
                 "--to", str(tmp_path)]) == 2
    said = capsys.readouterr().err
    assert "its searches: mix" in said and "--budget" in said
    assert "it solved: 5 (candidate 1)" in said
