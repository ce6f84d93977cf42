"""Models run one decoder layer at a time from their checkpoints (quantdask.stream.streaming),
against the resident model computed independently by transformers' own loading: the same
log-probs to the bit, full precision and quantized (hqq, bitsandbytes nf4 and int8, torchao),
on the demo model and test families; each layer read once, only while its turn lasts."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from quantdask.backends import get_backend
from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR
from quantdask.errors import UnsupportedHere
from quantdask.measure.logits import sliced_log_probs
from quantdask.process.model_source import load_model_source
from quantdask.stream.streaming import StreamedModel, layer_quantizer
from quantdask.sweepfile.model import ModelSpec
from tests.tiny_families import build_tiny

pytestmark = pytest.mark.timeout(240)

CONFIGS = [("hqq", {"bits": 4, "group_size": 32}), ("bitsandbytes", {"bits": 4}),
           ("bitsandbytes", {"bits": 8}), ("torchao", {"mode": "int8_weight_only"})]


def windows_for(source, count: int = 6, length: int = 24) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, source.config.get_text_config().vocab_size, (count, length),
                         generator=generator)


def resident(model, windows) -> list[torch.Tensor]:
    return [piece.log_probs for piece in sliced_log_probs(model, windows, 4, "cpu")]


def streamed(stream: StreamedModel, windows) -> list[torch.Tensor]:
    return [piece.log_probs for piece in stream.log_probs(windows, 4)]


def checkpoint_bytes(directory: str) -> int:
    """Every tensor's bytes in the safetensors files, read from the files' own headers."""
    from safetensors import safe_open

    total = 0
    for path in Path(directory).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                piece = handle.get_slice(key)
                shape, dtype = piece.get_shape(), piece.get_dtype()
                size = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}[dtype]
                total += size * int(torch.tensor(shape).prod()) if shape else size
    return total


@pytest.fixture(scope="module", params=["demo", "gpt2", "gemma", "gpt_neox", "falcon"])
def model_dir(request, tmp_path_factory) -> str:
    if request.param == "demo":
        return DEMO_MODEL_DIR
    return str(build_tiny(request.param, tmp_path_factory.mktemp(request.param)))


def test_the_streamed_reference_is_the_resident_model_to_the_bit(model_dir):
    source = load_model_source(ModelSpec(path=model_dir))
    windows = windows_for(source)
    stream = StreamedModel(source, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(resident(source.build("cpu"), windows),
                                                 streamed(stream, windows), strict=True))
    # Every tensor read once, each layer in its turn; the layers never filled in place.
    assert stream.reader.bytes_read == checkpoint_bytes(model_dir)
    assert [t.index for t in stream.timings] == list(range(len(stream.skeletons)))
    assert len({t.bytes_read for t in stream.timings}) == 1  # identical layers, equal reads
    assert all(p.device.type == "meta" for layer in stream.skeletons
               for p in layer.parameters())


@pytest.mark.parametrize("backend,options", CONFIGS, ids=[f"{b}-{o}" for b, o in CONFIGS])
def test_a_streamed_quantized_model_is_the_backends_own_to_the_bit(model_dir, backend, options):
    chosen = get_backend(backend)
    normalized = chosen.normalize(options, "configs[0]")
    source = load_model_source(ModelSpec(path=model_dir))
    windows = windows_for(source)

    def outcome(run):
        """The log-probs, or the class of the error that stopped them (this machine's CPU
        4-bit kernel and a narrow layer; torchao's int8 under Falcon's own linear class)."""
        try:
            return run()
        except (UnsupportedHere, NotImplementedError) as error:
            return type(error)

    own = outcome(lambda: resident(chosen.quantize(source, normalized, "cpu"), windows))
    stream = outcome(lambda: streamed(StreamedModel(
        source, "cpu", layer_quantizer(chosen, normalized)), windows))
    if own is NotImplementedError:
        # Falcon's own linear class transposes the weight itself, which torchao's tensors
        # cannot; streamed, a layer's quantized modules are torch's Linear: close to full
        # precision (int8) instead of failing.
        full = resident(source.build("cpu"), windows)
        assert max((a - b).abs().max().item() for a, b in zip(full, stream, strict=True)) < 0.05
    elif isinstance(own, type):
        assert stream is own
    else:
        assert all(torch.equal(a, b) for a, b in zip(own, stream, strict=True))


def test_a_sharded_checkpoint_streams_and_a_converted_one_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.tiny_families import copy_demo_tokenizer

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    copy_demo_tokenizer(tmp_path / "sharded")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    source = load_model_source(ModelSpec(path=str(tmp_path / "sharded")))
    windows = windows_for(source)
    assert all(torch.equal(a, b) for a, b in zip(
        resident(source.build("cpu"), windows),
        streamed(StreamedModel(source, "cpu"), windows), strict=True))
    mixtral = load_model_source(ModelSpec(path=str(build_tiny("mixtral", tmp_path / "moe"))))
    with pytest.raises(UnsupportedHere, match="converted as it loads"):
        StreamedModel(mixtral, "cpu")
    # The plan says so before anything runs, for every job of it that streams.
    from quantdask.plan.planning import plan_sweep
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    data = streaming_sweep("always")
    data["models"] = [{"name": "moe", "path": str(tmp_path / "moe")}]
    plan = plan_sweep(sweep_from_dict(data))
    assert (plan["state"] == "unsupported").all()
    assert plan["reason"].str.contains("converted as it loads").all()


def streaming_sweep(stream: str, **extra) -> dict:
    from tests.conftest import sweep_dict

    data = sweep_dict(stream=stream, **extra)
    data["backends"] = [{"backend": "bitsandbytes", "configs": [{"bits": 4}, {"bits": 8}]},
                        {"backend": "hqq", "configs": [{"bits": 4, "group_size": 32}]}]
    return data


@pytest.mark.timeout(300)
def test_a_streamed_sweep_records_what_the_resident_one_does(cluster, tmp_path):
    from quantdask.run.sweep import run_sweep
    from quantdask.store.run_store import read_frame
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    runs = {stream: run_sweep(sweep_from_dict(streaming_sweep(stream)), tmp_path / stream,
                              cluster.client).sort("config_label")
            for stream in ("never", "always")}
    resident, streamed_run = runs["never"], runs["always"]
    assert (streamed_run["status"] == "done").all() and streamed_run["streamed"].all()
    assert resident["streamed"].is_null().all()
    for column in ("job_id", "perplexity", "kl_divergence", "top1_agreement", "size_bytes",
                   "quantized_params", "bits_per_quantized_weight", "full_precision"):
        assert streamed_run[column].to_list() == resident[column].to_list(), column
    assert (streamed_run["stream_bytes_read"] == checkpoint_bytes(DEMO_MODEL_DIR)).all()
    assert (streamed_run["stream_layer_s"] > 0).all()
    assert streamed_run["stream_skipped"].str.contains("need the model resident").all()
    weights = {stream: read_frame(tmp_path / stream, "layers").sort("job_id", "layer")
               for stream in runs}
    for column in ("layer", "weight_rel_error", "output_rel_error"):
        assert weights["always"][column].to_list() == weights["never"][column].to_list(), column
    assert weights["always"]["output_rel_error"].is_not_null().all()
    # Each job's log says each layer's turn as it ends (what `quantdask logs` shows of a
    # long pass while it runs).
    layers = json.loads((Path(DEMO_MODEL_DIR) / "config.json").read_text())["num_hidden_layers"]
    for job_id in streamed_run["job_id"]:
        log = (tmp_path / "always" / "logs" / "jobs" / f"{job_id}.log").read_text()
        turns = re.findall(r"layer (\d+)/(\d+) streamed: [\d.]+ \w+ read in [\d.]+ s, ran in", log)
        assert turns == [(str(i), str(layers)) for i in range(1, layers + 1)], log


class SmallDevices:
    """A scheduler's view of workers whose devices advertise ``memory`` bytes: placement's
    only input from a cluster (this machine has no device that small)."""

    def __init__(self, memory: float):
        self.memory = memory

    def scheduler_info(self, n_workers: int = -1) -> dict:
        from quantdask.sweepfile.sweep import DEVICE_MEMORY

        return {"workers": {f"tcp://127.0.0.1:{port}": {
            "name": f"w{port}", "resources": {"GPU": 1.0, DEVICE_MEMORY: self.memory}}
            for port in (1, 2)}}


def test_placement_streams_a_model_that_fits_no_worker_resident():
    from quantdask.errors import PlacementError
    from quantdask.plan.model_facts import model_facts
    from quantdask.plan.placement import estimate_device_memory, place_jobs, streamed_estimate
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    jobs = expand_grid(sweep_from_dict(streaming_sweep("auto")))
    facts = model_facts(jobs[0], layers=False)
    resident = max(estimate_device_memory(job, facts, __import__("polars").DataFrame()).firm
                   for job in jobs)
    streamed_need = max(streamed_estimate(job, facts).bytes for job in jobs)
    assert 0 < streamed_need < resident
    between = SmallDevices((resident + streamed_need) / 2)
    placed = place_jobs(jobs, between, stream="auto")
    assert all(job.streamed for job in placed.jobs)  # the model streams, every job of it
    assert all(job.device_memory_bytes <= between.memory for job in placed.jobs)
    assert not any(job.streamed for job in place_jobs(jobs, SmallDevices(2 * resident)).jobs)
    with pytest.raises(PlacementError):
        place_jobs(jobs, between, stream="never")
    with pytest.raises(PlacementError, match="stream"):  # too small even streamed
        place_jobs(jobs, SmallDevices(streamed_need / 2), stream="auto")


def test_a_model_that_cannot_stream_stays_resident_and_its_refusal_says_why(tmp_path):
    from quantdask.errors import PlacementError
    from quantdask.plan.model_facts import model_facts
    from quantdask.plan.placement import estimate_device_memory, place_jobs
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    data = streaming_sweep("auto")
    data["models"] = [{"name": "moe", "path": str(build_tiny("mixtral", tmp_path / "moe"))}]
    jobs = expand_grid(sweep_from_dict(data))
    facts = model_facts(jobs[0], layers=False)
    resident = min(estimate_device_memory(job, facts, __import__("polars").DataFrame()).firm
                   for job in jobs)
    # Under auto its jobs would stream on workers this small; its checkpoint cannot, so
    # placement refuses them with that reason instead of a worker skipping each one.
    with pytest.raises(PlacementError, match="it cannot stream one layer at a time: .*"
                                             "converted as it loads"):
        place_jobs(jobs, SmallDevices(resident / 4), stream="auto")


def test_a_search_on_a_streamed_model_is_refused_before_anything_runs(tmp_path_factory,
                                                                       write_sweep, capsys):
    from quantdask.cli.main import main
    from quantdask.errors import SpecError
    from quantdask.plan.model_facts import model_facts
    from quantdask.plan.placement import estimate_device_memory, place_jobs, streamed_estimate
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict
    from tests.conftest import calibration_file
    from tests.test_search import search_sweep

    data = search_sweep(calibration_file(tmp_path_factory, 40, seed=3))
    assert main(["plan", write_sweep(dict(data, stream="always"))]) == 2
    said = capsys.readouterr().err
    assert "searches[0].model" in said and "stream: always" in said and "drop the" in said
    # Under auto, placement streams it on workers too small to hold it: refused before the
    # run directory is made (start_session checks the placed jobs).
    sweep = sweep_from_dict(data)
    jobs = expand_grid(sweep)
    facts = model_facts(jobs[0], layers=False)
    resident = max(estimate_device_memory(job, facts, __import__("polars").DataFrame()).firm
                   for job in jobs)
    streamed_need = max(streamed_estimate(job, facts).bytes for job in jobs)
    placed = place_jobs(jobs, SmallDevices((resident + streamed_need) / 2), stream="auto")
    with pytest.raises(SpecError, match="fits no worker resident") as error:
        sweep.check_searches_resident(placed.jobs)
    assert error.value.field == "searches[0].model"
    sweep.check_searches_resident(jobs)  # resident: nothing to refuse


def test_plan_says_when_a_model_streams_and_what_it_needs(write_sweep, capsys):
    from quantdask.cli.main import main

    for stream, said in (("always", "every job streams (stream: always)"),
                         ("auto", "stream where its weights and eval fit no worker")):
        assert main(["plan", write_sweep(streaming_sweep(stream))]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("stream: demo:")]
        assert len(lines) == 1 and said in lines[0] and "they need ~" in lines[0], lines
    assert main(["plan", write_sweep(streaming_sweep("never"))]) == 0
    assert "stream: demo" not in capsys.readouterr().out
    assert main(["plan", "--json", write_sweep(streaming_sweep("always"))]) == 0
    import json

    jobs = json.loads(capsys.readouterr().out)["jobs"]
    assert all(job["streamed"] is True and job["est_streamed_bytes"] > 0 for job in jobs)


def test_a_streamed_job_skips_what_needs_the_model_resident_and_says_why(tmp_path):
    """Task accuracy and speed are skipped with the reason, never failed; a backend that
    cannot quantize one layer at a time is refused in the plan and skipped on the worker."""
    from quantdask.demo_model import DEMO_TASKS_DIR
    from quantdask.job.job import run_job
    from quantdask.measure.reference import combine_reference, compute_reference_shard
    from quantdask.plan.planning import plan_sweep
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    data = streaming_sweep("always", tasks={"names": ["demo_facts"],
                                            "include_path": DEMO_TASKS_DIR},
                           speed={"prompt_length": 8, "new_tokens": 4, "batch_sizes": [1]})
    data["backends"] = [{"backend": "hqq", "configs": [{"bits": 4, "group_size": 32}]}]
    jobs = expand_grid(sweep_from_dict(data))
    job = jobs[1]
    reference = combine_reference(job.model, job.eval, compute_reference_shard(
        job.model, job.eval, job.eval.read_text(), (0, job.eval.samples), streamed=True),
        tasks=job.tasks)
    outcome = run_job(job, get_backend("hqq"), 1, reference)
    record = outcome.record
    assert record["status"] == "done" and record["streamed"]
    assert "need the model resident" in record["tasks_error"]
    assert "generation speed" in record["stream_skipped"] and record.get("speed_s") is None
    assert not outcome.rows.get("tasks") and not outcome.rows.get("speed")
    # AutoRound and AWQ cannot quantize a streamed model; GPTQ can, on the families its
    # block-by-block fit was checked on (test_a_streamed_gptq_job_...).
    calibrated = streaming_sweep("always")
    calibrated["backends"] = [{"backend": "autoround", "configs": [{"bits": 4}]},
                              {"backend": "awq", "configs": [{"group_size": 32}]},
                              {"backend": "gptq", "configs": [{"bits": 4, "group_size": 32}]}]
    calibrated["calibration"] = {"text": DEMO_EVAL_TEXT, "samples": 4, "seq_len": 32}
    plan = plan_sweep(sweep_from_dict(calibrated))
    reasons = dict(zip(plan["backend"], plan["reason"], strict=True))
    assert "cannot quantize a streamed model, one layer at a time: it calibrates" in \
        reasons["autoround"]
    assert "checkpoint-backed AWQ fit saves another model" in reasons["awq"]
    assert reasons["gptq"] is None
    calibrated["models"] = [{"name": "neox",
                             "path": str(build_tiny("gpt_neox", tmp_path / "neox"))}]
    calibrated["backends"] = calibrated["backends"][2:]
    plan = plan_sweep(sweep_from_dict(calibrated))
    [reason] = plan.filter(plan["backend"] == "gptq")["reason"].to_list()
    assert "fit from the checkpoint is checked on the families llama, mistral, gemma, " \
           "gemma3_text, qwen2, qwen3, not 'gpt_neox'" in reason


# The evidence for quantdask.backends.gptq.families.GPTQ_STREAMED_FAMILIES. (Whether it is
# installed, not an import: imported here, bitsandbytes would look on the Hub for a kernel.)
@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is None,
                    reason="gptqmodel is not installed")
@pytest.mark.parametrize("family", ["demo", "gemma", "mistral", "qwen3", "gemma3_text"])
def test_a_streamed_gptq_job_fits_block_by_block_and_records_what_the_resident_one_does(
        family, tmp_path):
    """GPTQ fitted from the checkpoint one decoder layer at a time (gptqmodel's own
    checkpoint-backed fit) saves the model the resident fit saves, and its layers read one at
    a time measure what transformers' plain load of it measures: every figure of the job's
    row and its per-layer weight errors equal."""
    from dataclasses import replace

    from quantdask.job.job import run_job
    from quantdask.measure.reference import combine_reference, compute_reference_shard
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    data = streaming_sweep("never", calibration={"text": DEMO_EVAL_TEXT, "samples": 8,
                                                 "seq_len": 32})
    if family != "demo":
        data["models"] = [{"name": family, "path": str(build_tiny(family, tmp_path / family))}]
    data["backends"] = [{"backend": "gptq", "configs": [{"bits": 4, "group_size": 32}]}]
    [baseline, job] = expand_grid(sweep_from_dict(data))
    assert job.backend == "gptq" and baseline.is_baseline
    reference = combine_reference(job.model, job.eval, compute_reference_shard(
        job.model, job.eval, job.eval.read_text(), (0, job.eval.samples)),
        calibration=job.calibration, calibration_text=job.calibration.read_text())
    outcomes = {streamed: run_job(replace(job, streamed=streamed), get_backend("gptq"), 1,
                                  reference) for streamed in (False, True)}
    resident_record, streamed_record = (outcomes[s].record for s in (False, True))
    assert streamed_record["status"] == "done", streamed_record.get("error_message")
    assert streamed_record["streamed"] and streamed_record["calibrate_s"] > 0
    # Its pass read the model's checkpoint and the saved model's layers.
    assert streamed_record["stream_bytes_read"] > checkpoint_bytes(job.model.location) > 0
    for column in ("perplexity", "kl_divergence", "top1_agreement", "size_bytes",
                   "quantized_params", "bits_per_quantized_weight", "full_precision"):
        assert streamed_record[column] == resident_record[column], column
    weights = {s: sorted((row["layer"], row["weight_rel_error"], row["output_rel_error"])
                         for row in outcomes[s].rows["layers"]) for s in (False, True)}
    assert weights[True] == weights[False] and len(weights[True]) > 0


def test_a_streamed_gptq_estimate_counts_its_fit_and_its_calibration_states():
    """GPTQ's fit from the checkpoint holds the quantized model it saves and every calibration
    window's inputs and outputs at one layer: its streamed estimate is above a module-wise
    backend's, and grows by those float32 states when the windows double."""
    from dataclasses import replace

    from quantdask.plan.model_facts import model_facts
    from quantdask.plan.phase_memory import streamed_bytes
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    data = streaming_sweep("always", calibration={"text": DEMO_EVAL_TEXT, "samples": 64,
                                                  "seq_len": 128})
    data["backends"] = [{"backend": "gptq", "configs": [{"bits": 4, "group_size": 32}]},
                        {"backend": "hqq", "configs": [{"bits": 4, "group_size": 32}]}]
    jobs = {job.backend: job for job in expand_grid(sweep_from_dict(data))}
    facts = model_facts(jobs["gptq"], layers=False)
    gptq = streamed_bytes(jobs["gptq"], facts)
    assert gptq > streamed_bytes(jobs["hqq"], facts) > 0
    doubled = replace(jobs["gptq"], calibration=replace(jobs["gptq"].calibration, samples=128))
    states = 2 * 64 * 128 * facts.hidden_size * 4  # 64 more windows in, and out, float32
    assert streamed_bytes(doubled, facts) - gptq == pytest.approx(states, abs=1)


def test_parameters_transformers_keeps_in_float32_stream_in_float32(tmp_path, monkeypatch):
    """A family's ``_keep_in_fp32_modules_strict`` (DeepSeek-V3's router) keeps those weights
    in float32 in a bfloat16 model as ``from_pretrained`` loads it: each streamed layer holds
    the tensors transformers' own load holds, dtype and value (the demo model in bfloat16,
    its MLP gates declared kept; it cannot run so, a gate being a plain linear layer)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from tests.tiny_families import copy_demo_tokenizer

    AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.bfloat16).save_pretrained(
        tmp_path / "bf16")
    copy_demo_tokenizer(tmp_path / "bf16")
    monkeypatch.setattr(LlamaForCausalLM, "_keep_in_fp32_modules_strict", ["mlp.gate_proj"])
    source = load_model_source(ModelSpec(path=str(tmp_path / "bf16")))
    stream = StreamedModel(source, "cpu")
    with source.weights():
        own = source.build("cpu")
        kept = {name for name, p in own.named_parameters() if p.dtype == torch.float32}
        assert kept and all("gate_proj" in name for name in kept)
        for index, layer in enumerate(own.model.layers):
            streamed_layer = dict(stream.layer(index).named_parameters())
            for name, parameter in layer.named_parameters():
                assert streamed_layer[name].dtype == parameter.dtype, name
                assert torch.equal(streamed_layer[name], parameter), name


def test_a_streamed_job_holds_no_layer_past_its_turn(tmp_path, monkeypatch):
    """Each layer a streamed job lets go, and the original weights its errors were measured
    against, are freed by the next layer's turn, by their last reference (the cycle
    collector off): a pass that kept them would hold the whole model by its end, as a 2 GB
    model's GPTQ job once did until its worker was killed at its memory limit."""
    import gc
    import weakref

    import quantdask.stream.streamed_job as streamed_job
    import quantdask.stream.streaming as streaming
    from quantdask.job.job import run_job
    from quantdask.measure.reference import combine_reference, compute_reference_shard
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    data = streaming_sweep("always")
    data["backends"] = [{"backend": "hqq", "configs": [{"bits": 4, "group_size": 32}]}]
    [_, job] = expand_grid(sweep_from_dict(data))
    reference = combine_reference(job.model, job.eval, compute_reference_shard(
        job.model, job.eval, job.eval.read_text(), (0, job.eval.samples), streamed=True))
    noted: list[weakref.ref] = []  # each let-go layer's tensors, each layer's originals
    settled = [0]  # how many of them belong to turns that have ended
    still_held: list[int] = []  # at each layer's let-go: those of ended turns still alive
    let_go, weight_errors = streaming.let_go, streamed_job.weight_errors

    def noting_let_go(layer):
        still_held.append(sum(ref() is not None for ref in noted[:settled[0]]))
        noted.extend(weakref.ref(t) for t in [*layer.parameters(), *layer.buffers()])
        let_go(layer)
        settled[0] = len(noted)

    def noting_weight_errors(layer, dequantize, originals):
        noted.extend(weakref.ref(t) for t in originals.values())
        return weight_errors(layer, dequantize, originals)

    monkeypatch.setattr(streaming, "let_go", noting_let_go)
    monkeypatch.setattr(streamed_job, "weight_errors", noting_weight_errors)
    gc.collect()
    gc.disable()
    try:
        outcome = run_job(job, get_backend("hqq"), 1, reference)
    finally:
        gc.enable()
    assert outcome.record["status"] == "done" and outcome.record["streamed"]
    assert outcome.rows["layers"] and all(row["output_rel_error"] is not None
                                          for row in outcome.rows["layers"])
    decoder_layers = {re.search(r"layers\.\d+", row["layer"])[0] for row in outcome.rows["layers"]}
    assert len(still_held) == len(decoder_layers) > 1
    assert still_held == [0] * len(still_held)
