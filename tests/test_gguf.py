"""GGUF through llama.cpp's own converter, quantizer and runtime (issue 55, in progress): the
pieces, on tiny Llamas built here (nothing downloaded)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from quantdask.errors import SpecError, UnsupportedHere

llama_cpp = pytest.importorskip("llama_cpp", reason="pip install 'quantdask[gguf]'")

from quantdask.gguf.source import missing_converter  # noqa: E402

if missing_converter():
    pytest.skip(missing_converter(), allow_module_level=True)

from quantdask.gguf.convert import convert  # noqa: E402
from quantdask.gguf.quantize import quantize_gguf, tensor_types, type_counts  # noqa: E402
from quantdask.gguf.runtime import RuntimeDevice, llama_cpp_meter  # noqa: E402
from quantdask.gguf.types import canonical  # noqa: E402
from tests.gguf_models import (  # noqa: E402
    cached_f32,
    gemma_style_model,
    llama2_style_model,
    plain_figures,
)

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A tiny Llama whose widths are multiples of 256, converted to F32, and its reference
    as quantdask computes it (BOS + 127 text tokens per window, exact KL)."""
    from quantdask.measure.reference import compute_reference
    from quantdask.sweepfile.bos import window_bos
    from quantdask.sweepfile.model import ModelSpec
    from quantdask.sweepfile.settings import EvalSettings

    folder = llama2_style_model(tmp_path_factory.mktemp("gguf") / "wide")
    model = ModelSpec(path=str(folder))
    settings = EvalSettings(text=str(folder / "eval.txt"), seq_len=128, samples=8,
                            batch_size=4, kl_top_k="all")  # BOS resolved as a sweep's is
    settings = settings.with_bos(window_bos(settings.bos, model))
    reference = compute_reference(model, settings, (folder / "eval.txt").read_text())
    assert set(reference.windows[:, 0].tolist()) == {1}  # a Llama-style tokenizer adds BOS
    return folder, cached_f32(folder), reference


def test_the_unquantized_gguf_in_llama_cpp_matches_the_torch_reference(wide):
    _, f32, reference = wide
    assert int(reference.windows[0, 0]) == 1  # the BOS, fed as an id: llama.cpp adds none
    scores = llama_cpp_meter(f32, reference.windows, reference.distribution,
                             RuntimeDevice(2)).scores()
    assert scores.kl_divergence < 1e-5
    assert scores.perplexity == pytest.approx(reference.baseline.perplexity, rel=1e-4)
    assert scores.top1_agreement > 0.99


def test_each_type_is_written_as_llama_cpp_writes_it_and_kl_follows_the_bits(wide, tmp_path):
    _, f32, reference = wide
    kls, sizes = [], []
    for name in ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K"):
        out = quantize_gguf(f32, tmp_path / f"{name}.gguf", name, threads=2)
        types = tensor_types(out)
        main = {"Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q5_K_M": "Q5_K", "Q4_K_M": "Q4_K",
                "Q3_K_M": "Q3_K", "Q2_K": "Q2_K"}[name]
        assert main in type_counts(types), (name, type_counts(types))
        assert types["token_embd.weight"] != "F32"
        kls.append(llama_cpp_meter(out, reference.windows, reference.distribution, RuntimeDevice(2))
                   .scores().kl_divergence)
        sizes.append(out.stat().st_size)
    assert kls == sorted(kls) and all(math.isfinite(k) for k in kls), kls
    assert sizes == sorted(sizes, reverse=True), sizes


def test_a_gemma_style_checkpoint_measures_in_llama_cpp_as_a_plain_loop_does(tmp_path):
    """Gemma's own layout (a SentencePiece vocabulary, a BOS before every window, tied and
    scaled embeddings): the F32 GGUF matches the torch reference, and Q4_K_M's figures
    equal an independent computation within 2%."""
    from quantdask.gguf.quantize import quantize_gguf
    from quantdask.measure.reference import compute_reference
    from quantdask.sweepfile.bos import window_bos
    from quantdask.sweepfile.model import ModelSpec
    from quantdask.sweepfile.settings import EvalSettings

    folder = gemma_style_model(tmp_path / "gemma")
    model = ModelSpec(path=str(folder))
    settings = EvalSettings(text=str(folder / "eval.txt"), seq_len=128, samples=6,
                            batch_size=6, kl_top_k="all")
    settings = settings.with_bos(window_bos(settings.bos, model))
    reference = compute_reference(model, settings, (folder / "eval.txt").read_text())
    assert set(reference.windows[:, 0].tolist()) == {2}  # Gemma's BOS on every window
    f32 = convert(folder, tmp_path / "gemma-f32.gguf")
    full = llama_cpp_meter(f32, reference.windows, reference.distribution, RuntimeDevice(2))
    assert full.scores().kl_divergence < 1e-5
    q4 = quantize_gguf(f32, tmp_path / "gemma-q4.gguf", "Q4_K_M", threads=2)
    ours = llama_cpp_meter(q4, reference.windows, reference.distribution,
                           RuntimeDevice(2)).scores()
    plain = plain_figures(q4, folder, reference.windows)
    assert ours.kl_divergence == pytest.approx(plain["kl_divergence"], rel=0.02)
    assert ours.perplexity == pytest.approx(plain["perplexity"], rel=0.02)
    assert ours.top1_agreement == pytest.approx(plain["top1_agreement"], rel=0.02)
    _searched_tied(folder, f32, tmp_path)
    (folder / "tokenizer.model").unlink()  # a checkpoint with tokenizer.json only
    with pytest.raises(UnsupportedHere, match="tokenizer.model"):
        convert(folder, tmp_path / "no-spm.gguf")


def _searched_tied(folder, f32, tmp_path) -> None:
    """A search's mix on Gemma's tied embedding: one unit (no output tensor), its bytes the
    file's token_embd, and nothing outside the units but the F32 norms."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from quantdask.backends import get_backend
    from quantdask.backends.per_module import module_options
    from quantdask.gguf.quantize import quantize_gguf
    from quantdask.gguf.searched import given_types, quantize_module, rest_bytes
    from quantdask.gguf.source import gguf_module
    from quantdask.search.probes import linear_units

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    units = linear_units(model, "linear", embeddings=True)
    assert "model.embed_tokens" in units and "lm_head" not in units  # tied: one unit
    gguf = get_backend("gguf")
    options = gguf.normalize({"type": "Q4_K_M", "modules": {
        **{m: {"tensor_type": "Q4_K"} for m in units},
        "model.embed_tokens": {"tensor_type": "Q8_0"},
        "model.layers.1.mlp.down_proj": {"tensor_type": "Q2_K"}}}, "test")
    mixed = quantize_gguf(f32, tmp_path / "gemma-mixed.gguf", "Q4_K_M", 2,
                          given=given_types(f32, options))
    tensors = {t.name: t for t in gguf_module().GGUFReader(str(mixed)).tensors}
    assert "output.weight" not in tensors
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "Q2_K"
    probed = quantize_module(model.get_submodule("model.embed_tokens"),
                             module_options(gguf, options, "model.embed_tokens"))
    theirs = tensors["token_embd.weight"]
    assert theirs.tensor_type.name == probed.tensor_type == "Q8_0"
    assert np.array_equal(probed.weight_bytes.numpy(), np.asarray(theirs.data).view(
        np.uint8).reshape(probed.weight_bytes.shape))
    assert rest_bytes(model, units, options) == sum(
        int(t.n_bytes) for t in tensors.values() if len(t.shape) == 1)


def test_a_type_llama_cpp_does_not_know_is_refused_naming_the_ones_it_does():
    assert canonical("q4_k") == "Q4_K_M"
    for bad in ("Q4_K_X", "q4"):
        with pytest.raises(SpecError, match="Q4_K_M"):
            canonical(bad)


def test_the_device_llama_cpp_runs_on_is_part_of_the_job_and_a_missing_gpu_a_reason():
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict
    from tests.conftest import sweep_dict

    jobs = [j for j in expand_grid(sweep_from_dict(sweep_dict(backends=[
        {"backend": "gguf", "grid": {"type": ["Q4_K_M"], "device": ["cpu", "cuda"]}}])))
        if j.backend == "gguf"]
    assert sorted(j.config_label for j in jobs) == ["Q4_K_M", "Q4_K_M cuda"]
    assert len({j.id for j in jobs}) == 2
    with pytest.raises(SpecError, match="grid.device: must be 'cpu' or 'cuda'"):
        sweep_from_dict(sweep_dict(backends=[{"backend": "gguf", "grid": {"device": ["gpu"]}}]))
    if not torch.cuda.is_available():
        with pytest.raises(UnsupportedHere, match="no CUDA device"):
            RuntimeDevice(1, gpu=True).check()


def test_an_imatrix_type_without_one_fails_with_llama_cpps_reason(wide, tmp_path):
    _, f32, _ = wide
    with pytest.raises(RuntimeError, match="imatrix"):
        quantize_gguf(f32, tmp_path / "iq2.gguf", "IQ2_XS", threads=2)
    assert not list(tmp_path.glob("iq2.gguf*"))


def test_a_machine_that_does_not_see_the_converted_file_converts_its_own(wide, tmp_path,
                                                                       monkeypatch):
    from quantdask.gguf.conversion import Converted, base_file, cache_dir
    from quantdask.sweepfile.model import ModelSpec

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder, f32, _ = wide
    model = ModelSpec(path=str(folder))
    seen = base_file(Converted("f32", str(f32), "here", f32.stat().st_size), model, "f32", 60)
    assert seen == f32 and not cache_dir().exists()  # the task's file, as it is
    elsewhere = Converted("f32", str(tmp_path / "on-another-machine.gguf"), "there", 10)
    own = base_file(elsewhere, model, "f32", 60)
    assert own.parent.parent == cache_dir() and own.read_bytes() == f32.read_bytes()
    with pytest.raises(UnsupportedHere, match="no such tokenizer"):
        base_file(Converted("f32", None, "there", refused="no such tokenizer"), model, "f32", 60)


def test_each_outtype_is_converted_into_a_file_of_its_own(wide, tmp_path, monkeypatch):
    """The conversion cache keeps F32, F16 and BF16 apart: each outtype its own file, whose
    tensors are in that type (a cache keyed without it would hand an F16 job the F32 file)."""
    from quantdask.gguf.conversion import converted
    from quantdask.gguf.quantize import tensor_types
    from quantdask.sweepfile.model import ModelSpec

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder, _, _ = wide
    model = ModelSpec(path=str(folder))
    files = {outtype: converted(model, outtype) for outtype in ("f32", "f16", "bf16")}
    assert len(set(files.values())) == 3
    for outtype, path in files.items():
        written = {kind for name, kind in tensor_types(path).items() if name.endswith(
            "attn_q.weight")}
        assert written == {outtype.upper()}, (outtype, written)
    assert converted(model, "f16") == files["f16"]  # found again, not converted again


def _done_rows(cluster, tmp_path, folder, backends: list, others: tuple = (), **more) -> dict:
    """A sweep of ``backends`` on the model in ``folder`` (and the ``others``: models' entries)
    (8 windows of 128, exact KL) run on the cluster; the rows of ``folder``'s model by config
    label, every one done."""
    import quantdask as qd
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    sweep = sweep_from_dict({
        "name": "gguf", "models": [{"name": folder.name, "path": str(folder)}, *others],
        "backends": backends, "eval": {"text": str(folder / "eval.txt"), "seq_len": 128,
                                       "samples": 8, "batch_size": 4, "kl_top_k": "all"},
        "seed": 0, "retries": 0, **more})
    results = qd.run_sweep(sweep, tmp_path / "run", cluster.client)
    rows = {r["config_label"]: r for r in results.iter_rows(named=True)
            if r["model"] == folder.name}
    assert {r["status"] for r in rows.values()} == {"done"}, {
        k: (r["status"], r["error_message"]) for k, r in rows.items()}
    return rows


def test_a_sweep_of_gguf_types_runs_in_llama_cpp_beside_the_reference(wide, cluster, tmp_path):
    import polars as pl

    import quantdask as qd
    from quantdask.demo_model import DEMO_MODEL_DIR

    folder, f32, reference = wide
    # beside it the demo model, whose locally trained BPE pre-tokenizer the converter refuses
    rows = _done_rows(cluster, tmp_path, folder, [
        {"backend": "gguf", "grid": {"type": ["F32", "Q8_0", "Q4_K_M", "Q2_K"]}},
        {"backend": "bitsandbytes", "grid": {"bits": [4]}}],
        others=({"name": "demo", "path": DEMO_MODEL_DIR},))
    kl = [rows[t]["kl_divergence"] for t in ("F32", "Q8_0", "Q4_K_M", "Q2_K")]
    assert kl == sorted(kl) and kl[0] < 1e-5, kl
    # each job's figures equal an independent computation (a plain torch forward, a plain
    # llama.cpp loop) on the same windows, within 2%
    from quantdask.gguf.quantize import quantize_gguf
    for name in ("F32", "Q4_K_M", "Q2_K"):
        here = (f32 if name == "F32" else
                quantize_gguf(f32, tmp_path / f"{name}.gguf", name, 1))
        plain = plain_figures(here, folder, reference.windows)
        for metric in ("kl_divergence", "perplexity", "top1_agreement"):
            assert rows[name][metric] == pytest.approx(
                plain[metric], rel=0.02, abs=1e-6 if metric == "kl_divergence" else 0), (
                name, metric)
    # one conversion per model for its four GGUF configs, one task the jobs depended on
    tasks = qd.read_worker_tasks(tmp_path / "run").filter(pl.col("kind") == "convert")
    assert sorted(tasks["label"].to_list()) == ["demo", "wide"]
    assert set(tasks["status"]) == {"done"}  # a refusal is the conversion's result
    demo = qd.read_results(tmp_path / "run").filter(pl.col("model") == "demo")
    for row in demo.filter(pl.col("backend") == "gguf").iter_rows(named=True):
        # a reason, with the hash llama.cpp's converter would need, never a guessed tokenizer
        assert row["status"] == "skipped" and re.search(
            "pre-tokenizer .*chkhsh [0-9a-f]{64}", row["error_message"]), row
    assert demo.filter(pl.col("backend") == "bitsandbytes")["status"].to_list() == ["done"]
    assert rows["F32"]["quantized_params"] == 0 and rows["Q4_K_M"]["quantized_share"] > 0.5
    assert rows["Q4_K_M"]["runtime"].startswith("llama.cpp 0c1e570") and "cpu" in rows[
        "Q4_K_M"]["runtime"]
    assert "Q4_K" in rows["Q4_K_M"]["tensor_types"] and rows["Q4_K_M"]["fallback_share"] == 0
    assert rows["nf4"]["runtime"] is None  # a torch backend's job
    assert rows["Q2_K"]["bits_per_weight"] < rows["Q8_0"]["bits_per_weight"]
    windows = qd.read_windows(tmp_path / "run")
    assert windows.filter(pl.col("job_id") == rows["Q8_0"]["job_id"]).height == 8


def test_a_k_quant_on_rows_not_a_multiple_of_256_says_it_fell_back(tmp_path):
    from quantdask.gguf.phases import fallback_share

    narrow = llama2_style_model(tmp_path / "narrow", hidden=320, ffn=640)
    f32 = convert(narrow, tmp_path / "narrow-f32.gguf")
    out = quantize_gguf(f32, tmp_path / "q4.gguf", "Q4_K_M", threads=2)
    types = tensor_types(out)
    assert "Q4_K" not in types.values() and types["blk.0.attn_q.weight"] == "Q5_0"
    assert fallback_share(out, types, "Q4_K_M") == 1.0  # every quantized tensor


def test_a_gguf_sweep_without_the_extra_or_its_converter_is_refused_before_anything_runs(
        tmp_path, monkeypatch):
    import importlib.util

    from quantdask.sweepfile.sweep_file import sweep_from_dict
    from tests.conftest import sweep_dict

    data = sweep_dict(backends=[{"backend": "gguf", "grid": {"type": ["Q4_K_M"]}}])
    monkeypatch.setenv("QUANTDASK_LLAMA_CPP", str(tmp_path / "nowhere"))
    with pytest.raises(SpecError, match="quantdask gguf-setup"):
        sweep_from_dict(data)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(SpecError, match=r"pip install 'quantdask\[gguf\]'"):
        sweep_from_dict(data)
    monkeypatch.undo()
    with pytest.raises(SpecError, match="needs an importance matrix.*imatrix: true"):
        sweep_from_dict(sweep_dict(backends=[{"backend": "gguf", "grid": {"type": ["IQ2_XS"]}}]))
    with pytest.raises(SpecError, match="calibration block"):  # an imatrix needs its windows
        sweep_from_dict(sweep_dict(backends=[{"backend": "gguf", "configs": [
            {"type": "Q2_K"}, {"type": "Q2_K", "imatrix": True}]}]))
    sweep_from_dict(sweep_dict(backends=[{"backend": "gguf", "grid": {"type": ["Q2_K"]}}]))
    with pytest.raises(SpecError, match="Q4_K_M"):
        sweep_from_dict(sweep_dict(backends=[{"backend": "gguf", "grid": {"type": ["q4"]}}]))


@pytest.fixture(scope="module")
def outliers(tmp_path_factory):
    """A tiny Llama whose decoder inputs have outlier columns (8 channels of every norm's gain
    x20): where an importance matrix matters."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = llama2_style_model(tmp_path_factory.mktemp("gguf") / "outliers")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:8] *= 20
            layer.post_attention_layernorm.weight[:8] *= 20
    model.save_pretrained(folder)
    from quantdask.demo_model import generate_text

    (folder / "calibration.txt").write_text(generate_text(300, seed=5))
    return folder


def test_the_importance_matrix_covers_every_block_weight_at_its_width(outliers, tmp_path):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from quantdask.gguf.imatrix import importance
    from quantdask.gguf.source import gguf_module

    f32 = cached_f32(outliers)
    model = AutoModelForCausalLM.from_pretrained(outliers, dtype=torch.float32).eval()
    windows = torch.randint(3, 500, (3, 32))
    found = importance(model, windows, "llama", batch_size=2)
    reader = gguf_module().GGUFReader(str(f32))
    blocks = {t.name: int(t.shape[0]) for t in reader.tensors
              if t.name.startswith("blk.") and len(t.shape) == 2}
    assert {n: v.size for n, v in found.items()} == blocks
    # q/k/v share their input (the attention norm's output): the same columns' means
    assert np.array_equal(found["blk.0.attn_q.weight"], found["blk.0.attn_v.weight"])
    # and the outlier columns carry the weight
    assert found["blk.0.attn_q.weight"][:8].min() > 10 * np.median(found["blk.0.attn_q.weight"])


def test_an_imatrix_lowers_the_kl_of_low_bit_types_and_opens_the_iq_types(outliers, cluster,
                                                                         tmp_path):

    rows = _done_rows(cluster, tmp_path, outliers, [
        {"backend": "gguf", "grid": {"type": ["Q3_K_M", "Q2_K"], "imatrix": [False, True]}},
        {"backend": "gguf", "configs": [{"type": "IQ2_XS", "imatrix": True}]}],
        calibration={"text": str(outliers / "calibration.txt"), "samples": 16, "seq_len": 128})
    for name in ("Q3_K_M", "Q2_K"):
        assert rows[f"{name} imatrix"]["kl_divergence"] < rows[name]["kl_divergence"], name
        assert rows[f"{name} imatrix"]["calibrate_s"] > 0 and rows[name]["calibrate_s"] is None
    assert "IQ2_XS" in rows["IQ2_XS imatrix"]["tensor_types"]


def test_the_gguf_file_is_the_artifact_and_its_speed_is_llama_cpps(wide, cluster, tmp_path):
    import hashlib

    import polars as pl

    import quantdask as qd

    folder, _, _ = wide
    rows = _done_rows(cluster, tmp_path, folder, [
        {"backend": "gguf", "grid": {"type": ["Q4_K_M"]}}],
        artifacts={"keep": "done", "to": str(tmp_path / "kept"), "verify": True},
        speed={"prompt_length": 32, "new_tokens": 6, "batch_sizes": [1, 2], "warmup": 1,
               "repeats": 2})
    row = rows["Q4_K_M"]
    [kept] = (tmp_path / "kept" / row["job_id"]).glob("*.gguf")
    assert kept.name == "model-Q4_K_M.gguf" and row["artifact_bytes"] == kept.stat().st_size
    manifest = f"{kept.name} {hashlib.sha256(kept.read_bytes()).hexdigest()}\n"
    assert row["artifact_sha256"] == hashlib.sha256(manifest.encode()).hexdigest()
    assert row["reload_kl_delta"] == 0.0  # llama.cpp on a CPU: the same file, the same bits
    assert "Q4_K" in type_counts(tensor_types(kept)) and row["artifact_error"] is None
    # speed: timed in llama.cpp at batch size 1, the larger batch said to be left out
    speed = qd.read_speed(tmp_path / "run").filter(pl.col("job_id") == row["job_id"])
    [timed] = speed.to_dicts()
    assert timed["batch_size"] == 1 and timed["new_tokens"] == 6 and timed["repeats"] == 2
    assert timed["decode_tokens_per_s"] == pytest.approx(1 / timed["decode_s_p50"])
    assert timed["prefill_tokens_per_s"] == pytest.approx(32 / timed["ttft_s"])
    assert "batch sizes above 1" in row["runtime_skipped"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_tied_models_counts_do_not_depend_on_the_worker_or_a_resume(tmp_path):
    """Issue 70: the same configs on a tied model run after the baseline on its worker, and
    rerun by a resume (they failed the first time) on a fresh cluster of two, where a GGUF job
    on the worker that did not compute the reference builds the model empty: the same
    param_count, size and bits per weight, the tied table counted once."""
    from transformers import AutoModelForCausalLM

    import quantdask as qd
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    folder = gemma_style_model(tmp_path / "gemma")
    configs = [{"backend": "gguf", "configs": [{"type": "Q8_0"}, {"type": "Q6_K"}]},
               {"backend": "bitsandbytes", "configs": [{"bits": 4}]}]
    counted = ("param_count", "size_bytes", "bits_per_weight", "quantized_share")

    def sweep(faults: list) -> qd.Sweep:
        return sweep_from_dict({
            "name": "tied", "models": [{"name": "gemma", "path": str(folder)}],
            "backends": configs, "eval": {"text": str(folder / "eval.txt"), "seq_len": 64,
                                          "samples": 4, "batch_size": 4},
            "seed": 0, "retries": 0, "faults": faults})

    def done(run_dir) -> list[dict]:
        return qd.read_results(run_dir).filter(status="done").to_dicts()

    def figures(run_dir) -> dict:
        return {r["config_label"]: tuple(r[c] for c in counted) for r in done(run_dir)}

    with qd.start_cluster(workers=1) as cluster:  # each after the baseline, on its worker
        qd.run_sweep(sweep([]), tmp_path / "after-baseline", cluster.client)
        failing = [{"config": label, "kind": "raise"} for label in ("Q8_0", "Q6_K")]
        qd.run_sweep(sweep(failing), tmp_path / "resumed", cluster.client)
    assert set(figures(tmp_path / "resumed")) == {"baseline", "nf4"}  # the GGUF jobs failed
    with qd.start_cluster(workers=2) as cluster:  # the resume, on fresh workers
        qd.run_sweep(sweep([]), tmp_path / "resumed", cluster.client)
    # one GGUF job ran where nothing had loaded the model: the empty path
    assert any(not r["source_cached"] for r in done(tmp_path / "resumed")
               if r["backend"] == "gguf")
    first, resumed = figures(tmp_path / "after-baseline"), figures(tmp_path / "resumed")
    assert set(first) == {"baseline", "Q8_0", "Q6_K", "nf4"}
    assert resumed == first
    tied = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(folder).parameters())
    assert {row[0] for row in first.values()} == {tied}  # parameters(): a tied table once
