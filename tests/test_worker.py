"""run_job in this process: real bitsandbytes quantization of the real demo model."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
from safetensors import safe_open

from quantdask.backends import Backend, get_backend
from quantdask.backends.base import UNQUANTIZED
from quantdask.backends.capabilities import Dequantizes
from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR
from quantdask.errors import UnsupportedHere
from quantdask.job.job import run_job
from quantdask.measure.metrics import SCORES
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.settings import EvalSettings
from quantdask.sweepfile.sweep import BackendBlock, Sweep, expand_grid

pytestmark = pytest.mark.timeout(120)


def jobs_for(demo_model, samples: int = 8, **grid) -> dict:
    sweep = Sweep(
        name="w", models=[ModelSpec(path=demo_model)],
        backends=[BackendBlock("bitsandbytes", grid=grid or {"bits": [4, 8]})],
        eval=EvalSettings(text=DEMO_EVAL_TEXT, seq_len=64, samples=samples),
    )
    return {job.config_label: job for job in expand_grid(sweep)}


@pytest.fixture(scope="module")
def reference(demo_model):
    from quantdask.measure.reference import compute_reference
    from quantdask.process import model_source

    model_source._cache.clear()  # this module measures the cold start
    job = jobs_for(demo_model)["baseline"]
    with open(job.eval.text_path) as f:
        return compute_reference(job.model, job.eval, f.read())


@pytest.fixture(scope="module")
def outcomes(demo_model, reference):
    jobs = jobs_for(demo_model)
    return {label: run_job(job, get_backend(job.backend), reference=reference)
            for label, job in jobs.items()}


@pytest.fixture(scope="module")
def records(outcomes):
    return {label: outcome.record for label, outcome in outcomes.items()}


def test_a_reference_computed_in_parts_is_the_one_computed_whole(demo_model, reference):
    import torch

    from quantdask.measure.reference import (
        combine_reference,
        compute_reference,
        compute_reference_shard,
        shard_rows,
    )

    job = jobs_for(demo_model)["baseline"]
    settings = dataclasses.replace(job.eval, batch_size=4)  # parts of a batch each
    text = job.eval.read_text()
    rows = shard_rows(settings.samples, settings.batch_size, slots=2)
    assert rows == [(0, 4), (4, 8)]
    parts = [compute_reference_shard(job.model, settings, text, r) for r in rows]
    combined = combine_reference(job.model, settings, *reversed(parts))  # in any order
    whole = compute_reference(job.model, settings, text)  # the same batches, in one process
    assert combined.key == whole.key == reference.key
    assert torch.equal(combined.windows, whole.windows)
    assert combined.distribution.keys() == whole.distribution.keys() == {
        "log_probs", "ids", "rest", "tail_ids", "tail_log_probs", "target_log_probs"}
    for name, tensor in whole.distribution.items():
        assert torch.equal(combined.distribution[name], tensor), name
    for name in SCORES:  # the same bits (a rerun on fewer workers reproduces its figures),
        mine = getattr(combined.baseline, name)
        assert mine == getattr(whole.baseline, name), name  # and near batches of 8
        assert mine == pytest.approx(getattr(reference.baseline, name), rel=1e-6)
    assert combined.baseline_peaks.peak_host_rss_bytes == max(
        p.peaks.peak_host_rss_bytes for p in parts)
    with pytest.raises(ValueError, match="cover windows"):
        combine_reference(job.model, settings, parts[0])  # a part missing


def test_every_job_is_done_with_plausible_metrics(records):
    assert {label: r["status"] for label, r in records.items()} == {
        "baseline": "done", "nf4": "done", "int8 t=6": "done"}
    base, nf4, int8 = records["baseline"], records["nf4"], records["int8 t=6"]
    assert nf4["size_bytes"] < int8["size_bytes"] < base["size_bytes"]
    assert base["bits_per_weight"] == pytest.approx(32.0)  # the demo model is float32
    assert 4.0 < nf4["bits_per_weight"] < int8["bits_per_weight"] < 32.0
    # Every job counts the checkpoint's weights (the demo model ties nothing), float32 bytes each
    # for the unquantized baseline.
    with safe_open(os.path.join(DEMO_MODEL_DIR, "model.safetensors"), "pt") as checkpoint:
        weights = sum(math.prod(checkpoint.get_slice(name).get_shape())
                      for name in checkpoint.keys())
    assert {r["param_count"] for r in records.values()} == {weights}
    assert base["size_bytes"] == 4 * weights
    for r in records.values():
        assert math.isfinite(r["perplexity"]) and 1.0 < r["perplexity"] < 50.0
        assert r["eval_tokens"] == 8 * 63
        assert r["wall_s"] >= r["load_s"] + r["quantize_s"] + r["eval_s"] - 1e-3
        assert r["quantize_s"] > 0
        # The baseline is not evaluated again: the reference's pass measured it.
        assert (r["eval_s"] == 0) if r is base else (r["eval_s"] > 0)
        assert r["peak_device_mem_bytes"] > 50_000_000  # a CPU slot's device memory is its RSS
        assert r["device"] == "cpu" and r["worker"] == "local"
        assert r["started_at"] <= r["finished_at"]
    assert nf4["perplexity"] >= base["perplexity"]


def test_the_worker_reuses_the_model_source_but_keeps_no_weights(demo_model, records,
                                                                  reference):
    # The reference loaded the model's config and tokenizer into this process; every job
    # reused them.
    assert all(r["source_cached"] is True for r in records.values())
    import torch

    from quantdask.process import model_source
    # What stays between jobs holds no tensor: the weights are read from the checkpoint per
    # job (memory-mapped, shared by the workers of a machine), never kept as a private copy.
    for source in model_source._cache.values():
        assert not [name for name, value in vars(source).items()
                    if isinstance(value, (torch.Tensor, torch.nn.Module, dict))]
    model_source._cache.clear()
    job = jobs_for(demo_model)["nf4"]
    cold = run_job(job, get_backend(job.backend), reference=reference).record
    assert cold["source_cached"] is False and cold["status"] == "done"
    # Loaded again, into the cache. (Not compared by load_s: on a loaded machine a warm load
    # took 0.29 s and this cold one 0.12 s.)
    assert [source.spec for source in model_source._cache.values()] == [job.model]
    for name in SCORES:  # what a job measures does not depend on what the worker had
        assert cold[name] == pytest.approx(records["nf4"][name], rel=1e-9)


def unquantized(source, options, device):
    return source.build(device)


def test_the_unquantized_model_evaluated_as_a_job_agrees_with_its_reference(demo_model,
                                                                            reference, records):
    """The baseline row's KL 0 and top-1 1 are its definition (its scores are the reference's
    own). Here the unquantized model goes through a job's evaluation against the reference
    (the path every quantized job takes): the windows, positions and log-probs line up only if
    that path scores it as the reference did."""
    job = jobs_for(demo_model)["baseline"]
    job = dataclasses.replace(job, backend="identity", config_label="identity")
    record = run_job(job, Backend("identity", unquantized, sizing=UNQUANTIZED),
                     reference=reference).record
    assert record["status"] == "done", record.get("error_message")
    assert record["kl_divergence"] == pytest.approx(0.0, abs=1e-6)
    assert record["top1_agreement"] == 1.0
    assert record["perplexity"] == pytest.approx(records["baseline"]["perplexity"], rel=1e-6)
    assert records["baseline"]["kl_divergence"] == 0.0
    assert records["baseline"]["top1_agreement"] == 1.0


def test_kl_grows_from_8_bit_to_4_bit(records):
    int8, nf4 = records["int8 t=6"], records["nf4"]
    assert 0.0 < int8["kl_divergence"] < nf4["kl_divergence"]
    assert nf4["top1_agreement"] <= int8["top1_agreement"] <= 1.0
    assert nf4["top1_agreement"] > 0.5


def test_per_layer_rows_cover_every_quantized_linear(outcomes):
    assert outcomes["baseline"].rows["layers"] == []
    for label in ("nf4", "int8 t=6"):
        layers = outcomes[label].rows["layers"]
        # 4 decoder layers x (q, k, v, o, gate, up, down); the output head stays unquantized.
        assert len(layers) == 28 and not any("lm_head" in row["layer"] for row in layers)
        for row in layers:
            assert 0 < row["weight_rel_error"] < 0.5 and math.isfinite(row["weight_sqnr_db"])
            assert 0 < row["output_rel_error"] < 1.0
    nf4 = {row["layer"]: row for row in outcomes["nf4"].rows["layers"]}
    int8 = {row["layer"]: row for row in outcomes["int8 t=6"].rows["layers"]}
    assert all(nf4[name]["weight_sqnr_db"] < int8[name]["weight_sqnr_db"] for name in nf4)


def test_the_same_job_twice_gives_the_same_quality(demo_model, records, outcomes, reference):
    job = jobs_for(demo_model)["nf4"]
    outcome = run_job(job, get_backend(job.backend), reference=reference)
    again = outcome.record
    for metric in ("perplexity", "kl_divergence", "top1_agreement", "size_bytes"):
        assert again[metric] == records["nf4"][metric]
    assert outcome.rows.get("layers", []) == outcomes["nf4"].rows["layers"]


def test_without_layer_stats_a_job_measures_the_same_and_records_no_layer(demo_model, records,
                                                                         outcomes, reference):
    import dataclasses

    job = dataclasses.replace(jobs_for(demo_model)["nf4"], layer_stats=False)
    outcome = run_job(job, get_backend(job.backend), reference=reference)
    record = outcome.record
    assert record["status"] == "done" and outcome.rows.get("layers", []) == []
    assert len(outcomes["nf4"].rows["layers"]) == 28
    for metric in ("perplexity", "kl_divergence", "top1_agreement", "size_bytes",
                   "quantized_share"):
        assert record[metric] == records["nf4"][metric]


def test_the_job_log_says_what_happened(outcomes):
    log = outcomes["nf4"].log
    assert "attempt=1 start on worker local" in log and "perplexity" in log


def test_a_failing_job_returns_its_class_message_and_traceback(demo_model, reference):
    def broken(source, options, device):
        raise RuntimeError("the backend broke")

    job = jobs_for(demo_model)["nf4"]
    outcome = run_job(job, Backend("broken", broken), attempt=2, reference=reference)
    record = outcome.record
    assert record["status"] == "failed"
    assert record["error_class"] == "RuntimeError"
    assert record["error_message"] == "the backend broke"
    assert "Traceback" in record["traceback"] and "in broken" in record["traceback"]
    assert "attempt=2 failed (job_error): RuntimeError" in outcome.log
    assert record["failure_class"] == "job_error"


def test_too_little_eval_text_is_a_clear_failure(demo_model):
    job = jobs_for(demo_model, samples=100_000)["nf4"]
    record = run_job(job, get_backend(job.backend)).record
    assert record["status"] == "failed" and record["error_class"] == "ValueError"
    assert "eval.samples x eval.seq_len needs 6400000" in record["error_message"]


def test_an_unsupported_job_is_skipped_with_the_reason(demo_model):
    def needs_cuda(source, options, device):
        raise UnsupportedHere("this backend needs CUDA")

    job = jobs_for(demo_model)["nf4"]
    record = run_job(job, Backend("cuda-only", needs_cuda)).record
    assert record["status"] == "skipped"
    assert record["failure_class"] == "unsupported"
    assert record["error_class"] == "UnsupportedHere"
    assert record["error_message"] == "this backend needs CUDA"


def test_the_quantized_share_counts_the_weights_each_backend_replaced(demo_model, records):
    # Independently of quantdask: the demo model's weights in nn.Linear layers but the output
    # head (what bitsandbytes replaces), over every weight in the checkpoint.
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR)
    total = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and name != "lm_head")
    for label in ("nf4", "int8 t=6"):
        assert records[label]["quantized_params"] == linear
        assert records[label]["quantized_share"] == pytest.approx(linear / total)
        assert records[label]["full_precision"].startswith("embed_tokens (Embedding) 5%, "
                                                           "lm_head (Linear) 5%")
        assert records[label]["layers_unmeasured"] == 0
    assert (records["baseline"]["quantized_params"], records["baseline"]["quantized_share"],
            records["baseline"]["full_precision"]) == (0, 0.0, None)


def test_simulated_quantization_counts_the_weights_it_changed(demo_model):
    """Quantized and dequantized back to float in place (a research backend): the weights it
    changed are its quantized share, though their dtype stays float."""
    import torch

    def fake_int8_mlp(source, options, device):
        model = source.build(device)
        for name, module in model.named_modules():
            if name.endswith("mlp.down_proj"):
                w = module.weight.detach()
                scale = w.abs().amax(dim=1, keepdim=True) / 127
                module.weight = torch.nn.Parameter((w / scale).round() * scale)
        return model

    job = jobs_for(demo_model)["nf4"]
    record = run_job(job, Backend("fake-int8", fake_int8_mlp)).record
    assert record["status"] == "done"
    assert record["quantized_params"] == 4 * 128 * 384  # down_proj in each of the 4 layers
    assert record["full_precision"].startswith("gate_proj (Linear) 23%, up_proj (Linear) 23%")


def test_a_config_that_quantized_nothing_is_skipped_not_done(demo_model):
    """A backend that hands the model back in full precision (a layer class it does not
    recognize, say) has measured nothing about quantization."""
    def loads_only(source, options, device):
        return source.build(device)

    job = jobs_for(demo_model)["nf4"]
    record = run_job(job, Backend("no-op", loads_only)).record
    assert (record["status"], record["failure_class"]) == ("skipped", "unsupported")
    assert record["error_message"] == (
        "no layer was quantized: no-op replaced none of this model's weights, which stay in "
        "Linear 95%, Embedding 5%, LlamaRMSNorm <1%")


def test_a_library_limit_is_unsupported_and_keeps_its_traceback(demo_model):
    def no_kernel(source, options, device):
        raise NotImplementedError("Int8Tensor dispatch: attempting to run aten.numpy_T")

    job = jobs_for(demo_model)["nf4"]
    outcome = run_job(job, Backend("limited", no_kernel))
    record = outcome.record
    assert (record["status"], record["failure_class"]) == ("skipped", "unsupported")
    assert record["error_class"] == "NotImplementedError"
    assert record["error_message"] == "Int8Tensor dispatch: attempting to run aten.numpy_T"
    assert "no_kernel" in record["traceback"] and "not implemented by the library" in outcome.log


def test_a_layer_the_stats_cannot_measure_is_counted_and_the_job_kept(demo_model):
    bnb = get_backend("bitsandbytes")

    def dequantize_but_q_proj(module):
        weight = bnb.has(Dequantizes).dequantize(module)
        if weight is not None and weight.shape[0] == weight.shape[1]:  # q_proj and o_proj
            return weight[:, :-1]  # a shape that matches no checkpoint weight
        return weight

    job = jobs_for(demo_model)["nf4"]
    outcome = run_job(job, Backend("odd-stats", bnb.quantize, options=bnb.options,
                                  capabilities=(Dequantizes(dequantize_but_q_proj),)))
    record = outcome.record
    assert record["status"] == "done" and math.isfinite(record["perplexity"])
    assert record["layers_unmeasured"] == 8  # q_proj and o_proj in each of the 4 layers
    measured = [row["layer"] for row in outcome.rows.get("layers", [])]
    assert len(measured) == 20 and not [m for m in measured if m.endswith(("q_proj", "o_proj"))]
    assert "per-layer stats skip model.layers.0.self_attn.q_proj: ValueError: dequantized " \
           "weight (128, 127) does not match the checkpoint's (128, 128)" in outcome.log


def test_jobs_hold_the_unquantized_weights_only_while_they_run(demo_model):
    from quantdask.process.model_source import cached_model_source

    source, _ = cached_model_source(jobs_for(demo_model)["nf4"].model)
    with source.weights() as first:
        with source.weights() as packed:  # a second job on this worker meanwhile
            assert packed is first
        assert source._weights is first  # the first job still runs
        model = source.build("cpu")
        assert model.state_dict()["lm_head.weight"].data_ptr() == \
            first["lm_head.weight"].data_ptr()  # built from the held weights, not read again
    assert source._weights is None


@pytest.mark.parametrize("fails", [False, True])
def test_what_the_phases_made_goes_before_the_measured_span_ends(fails, monkeypatch):
    """The stages (the model in them) are run_phases' alone: gone by their last reference (the
    cycle collector off) once it returns, or once it raises though the error and its traceback
    are still held; a phase sees the records so far, and one that reads what no phase made
    yet fails saying so."""
    import gc
    import types
    import weakref

    from quantdask.job import phases
    from quantdask.job.job import run_phases
    from quantdask.records import LayerWeights

    class Model:  # stands for the quantized model
        pass

    made_models: list[weakref.ref] = []

    def quantize(run, made):
        model = Model()
        made_models.append(weakref.ref(model))
        return dataclasses.replace(made, model=model), LayerWeights(0)

    def last(run, made):
        assert made.model is not None and made.records == (LayerWeights(0),)
        if fails:
            raise RuntimeError("the last phase failed")
        return made, None

    monkeypatch.setattr(phases, "PHASES", (quantize, last))
    run = phases.JobContext(types.SimpleNamespace(streamed=False), None, None, "cpu", False)
    gc.collect()
    gc.disable()
    try:
        with run.measured():
            if fails:
                with pytest.raises(RuntimeError, match="the last phase failed") as caught:
                    run_phases(run)
                assert caught.value.__traceback__ is not None
            else:
                assert run_phases(run)[0] == [LayerWeights(0)]
            assert made_models[0]() is None
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="no model made yet"):
        phases.check_coverage(run, phases.Made())


def test_packed_jobs_get_one_model_source_and_a_held_one_is_never_dropped(demo_model,
                                                                          monkeypatch):
    import dataclasses
    from concurrent.futures import ThreadPoolExecutor

    from quantdask.process import model_source
    spec = jobs_for(demo_model)["nf4"].model
    model_source._cache.clear()
    with ThreadPoolExecutor(2) as pool:  # two jobs packed on one worker start at once
        got = list(pool.map(lambda _: model_source.cached_model_source(spec), range(2)))
    assert got[0][0] is got[1][0] and sorted(cached for _, cached in got) == [False, True]
    monkeypatch.setattr(model_source, "MODEL_CACHE_SIZE", 1)
    held = got[0][0]
    as_bf16, as_fp16 = (dataclasses.replace(spec, dtype=d) for d in ("bfloat16", "float16"))
    with held.weights():
        in_bf16, _ = model_source.cached_model_source(as_bf16)  # over the size, but held
        assert model_source.cached_model_source(spec) == (held, True)
    # One checkpoint in two dtypes (a 16-bit model's float32 reference): one tokenizer.
    assert in_bf16 is not held and in_bf16.tokenizer is held.tokenizer
    model_source.cached_model_source(as_fp16)
    assert len(model_source._cache) == 1  # nothing held now: the least recently used went


def test_weight_errors_are_those_of_the_freshly_quantized_weights(demo_model, outcomes):
    # Kernels may repack weights at the first forward pass (bitsandbytes 4-bit on some CPUs):
    # the recorded errors must be those of the quantized weights, not of a repacked layout.
    from quantdask.measure.layers import weight_errors
    from quantdask.process.model_source import cached_model_source

    job = jobs_for(demo_model)["nf4"]
    backend = get_backend(job.backend)
    source, _ = cached_model_source(job.model)
    with source.weights() as originals:
        fresh, unmeasured = weight_errors(backend.quantize(source, job.options, "cpu"),
                                          backend.has(Dequantizes).dequantize, originals)
    assert unmeasured == {}
    recorded = outcomes["nf4"].rows["layers"]
    assert [r["layer"] for r in fresh] == [r["layer"] for r in recorded]
    for mine, theirs in zip(fresh, recorded):
        assert mine["weight_rel_error"] == pytest.approx(theirs["weight_rel_error"], rel=1e-6)
        assert 0.05 < mine["weight_rel_error"] < 0.2  # nf4 with 64-wide blocks


def layer_errors_by_hand(demo_model, label: str, batch, probe: int) -> dict[str, dict]:
    """Per-layer errors of the demo model quantized by transformers' own ``BitsAndBytesConfig``,
    in float64: each weight dequantized with bitsandbytes' functional API (before any forward
    pass repacks it) against the checkpoint's (safetensors); each layer's output on the first
    ``probe`` windows of ``batch`` (captured with forward hooks during a forward pass of the
    whole batch) against ``F.linear`` of its input and the checkpoint's
    weight; and the weight-only output error, ``F.linear`` with the dequantized weight."""
    import bitsandbytes as bnb
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                 bnb_4bit_compute_dtype=torch.float32) if label == "nf4"
              else BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0))
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32,
                                                 device_map="cpu",
                                                 quantization_config=config).eval()
    dequantized = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            dequantized[name] = bnb.functional.dequantize_4bit(module.weight.data,
                                                               module.weight.quant_state)
        elif isinstance(module, bnb.nn.Linear8bitLt):  # int8 rows x their absmax / 127
            dequantized[name] = bnb.functional.int8_vectorwise_dequant(module.weight.data,
                                                                       module.weight.SCB)
    seen: dict[str, tuple] = {}

    def capture(name):
        def hook(module, inputs, output):
            seen[name] = (inputs[0][:probe].double(), output[:probe].double())
        return hook

    handles = [model.get_submodule(name).register_forward_hook(capture(name))
               for name in dequantized]
    with torch.inference_mode():
        model(input_ids=batch)
    for handle in handles:
        handle.remove()
    checkpoint = load_file(os.path.join(demo_model, "model.safetensors"))

    def relative(a, b) -> float:
        return math.sqrt(((a - b) ** 2).sum().item() / (b ** 2).sum().item())

    errors = {}
    for name, weight_q in dequantized.items():
        weight, (x, output) = checkpoint[f"{name}.weight"].double(), seen[name]
        noise, signal = ((weight_q.double() - weight) ** 2).sum().item(), (weight ** 2).sum().item()
        exact = torch.nn.functional.linear(x, weight)
        errors[name] = {
            "shape": tuple(weight.shape), "weight_rel_error": math.sqrt(noise / signal),
            "weight_sqnr_db": 10 * math.log10(signal / noise),
            "output_rel_error": relative(output, exact),
            "weight_only": relative(torch.nn.functional.linear(x, weight_q.double()), exact)}
    return errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("label", ["nf4", "int8 t=6"])
def test_per_layer_errors_match_an_independent_computation(demo_model, outcomes, label):
    """Every per-layer row, recomputed here with bitsandbytes, safetensors and torch alone on the
    probe: the first 4 eval windows (cut from the text here), as the eval's first batch of 8
    runs them (LLM.int8 picks its outlier columns per batch, so an int8 layer's output on a
    window depends on the batch it runs in: the eval's own passes are what is measured).

    ``output_rel_error`` is the layer's own output (as the docs define it), not the dequantized
    weight's: for int8, LLM.int8 quantizes the activations too, so it differs from the weight-only
    error by far more than a tolerance; for nf4 the two agree to 1% (on a CPU with AVX512-BF16,
    bitsandbytes' kernel holds the block scales in bfloat16 after the first forward pass)."""
    import torch
    from transformers import AutoTokenizer

    from quantdask.job.phases import PROBE_WINDOWS

    seq_len, samples = 64, 8  # jobs_for's eval
    with open(DEMO_EVAL_TEXT, encoding="utf-8") as f:
        ids = AutoTokenizer.from_pretrained(demo_model)(f.read())["input_ids"]
    first_batch = torch.tensor(ids[:seq_len * samples]).view(samples, seq_len)[:8]
    expected = layer_errors_by_hand(demo_model, label, first_batch, PROBE_WINDOWS)
    rows = outcomes[label].rows["layers"]
    assert [row["layer"] for row in rows] == list(expected)  # every quantized layer, in order
    for row in rows:
        mine = expected[row["layer"]]
        assert (row["out_features"], row["in_features"]) == mine["shape"]
        for metric in ("weight_rel_error", "weight_sqnr_db", "output_rel_error"):
            assert row[metric] == pytest.approx(mine[metric], rel=1e-4), (row["layer"], metric)
        if label == "nf4":
            assert row["output_rel_error"] == pytest.approx(mine["weight_only"], rel=0.01)


def test_a_model_directory_missing_on_a_worker_node_says_where_and_what_to_do(demo_model,
                                                                             tmp_path):
    # The driver validated the path on its machine; a worker on another node may lack it.
    import copy

    from quantdask.process.model_source import load_model_source

    job = jobs_for(demo_model)["nf4"]
    elsewhere = copy.copy(job.model)
    object.__setattr__(elsewhere, "path", str(tmp_path / "not-here"))
    with pytest.raises(FileNotFoundError) as err:
        load_model_source(elsewhere)
    assert f"model directory {elsewhere.location} is not on " in str(err.value)
    assert "put the model at the same path on every node, or use `hub:`" in str(err.value)


def test_a_slow_fault_only_delays_the_attempt(demo_model, records, reference):
    import dataclasses
    import time

    from quantdask.job.faults import SLOW_FAULT_S

    job = dataclasses.replace(jobs_for(demo_model)["nf4"], faults=((1, "slow"),))
    began = time.monotonic()
    outcome = run_job(job, get_backend(job.backend), reference=reference)
    elapsed = time.monotonic() - began
    assert elapsed >= SLOW_FAULT_S and outcome.record["status"] == "done"
    assert outcome.record["wall_s"] <= elapsed - SLOW_FAULT_S  # not counted as the job's time
    assert outcome.record["kl_divergence"] == records["nf4"]["kl_divergence"]  # measured alike
    assert "injecting fault 'slow' on attempt 1" in outcome.log
    again = run_job(job, get_backend(job.backend), attempt=2, reference=reference)
    assert "injecting fault" not in again.log  # attempt 2 has none


def test_each_phase_records_its_own_time_and_peak(records, outcomes):
    from quantdask.job.phases import PHASES

    names = [phase.__name__ for phase in PHASES]
    for label, outcome in outcomes.items():
        record, rows = outcome.record, outcome.rows["phases"]
        ran = [row["phase"] for row in rows]
        # The phases that had something to do, in the job's order (no tasks, speed or
        # artifacts in these jobs).
        assert ran == ["load", "quantize", "check_coverage", "layer_weights", "score"], label
        assert [row["position"] for row in rows] == [names.index(p) for p in ran]
        seconds = {row["phase"]: row["seconds"] for row in rows}
        # Each phase's time holds its own timed part, and the phases fit in the job's wall.
        assert seconds["load"] >= record["load_s"] and seconds["score"] >= record["eval_s"]
        assert seconds["quantize"] >= record["quantize_s"]
        assert sum(seconds.values()) <= record["wall_s"]
        # The job's peak covers every phase's (phase blocks nest in the job's).
        assert max(row["peak_device_mem_bytes"] for row in rows) <= record["peak_device_mem_bytes"]
        assert all(row["peak_host_rss_bytes"] > 0 for row in rows), label
