"""size_bytes split into the quantized part and the rest (quantized_bytes,
bits_per_quantized_weight, unquantized_bytes, unquantized_dtypes), for every backend, run in
this process on the demo model (float32) and checked against the quantized layers' tensors
counted by hand from the module objects."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

import quantdask.backends
from quantdask.backends import Backend, Option, get_backend, register_backend
from quantdask.demo_model import generate_text
from quantdask.job.job import run_job
from quantdask.measure.coverage import coverage
from quantdask.measure.reference import compute_reference
from quantdask.sweepfile.sweep import expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import sweep_dict
from tests.test_backends import fake_quantize

pytestmark = pytest.mark.timeout(300)

CONFIGS = {
    "bitsandbytes": [{"bits": 4, "quant_type": "nf4"},
                     {"bits": 4, "quant_type": "nf4", "double_quant": True}, {"bits": 8}],
    "torchao": [{"mode": "int8_weight_only"}, {"mode": "int4_weight_only", "group_size": 32}],
    "hqq": [{"bits": 4, "group_size": 64}],
    "autoround": [{"bits": 4, "group_size": 32, "iters": 0}],
    "rtn": [{"bits": 4}],
}
LABELS = ("baseline", "nf4", "nf4 dq", "int8 t=6", "ao int8wo", "ao int4wo g32", "hqq 4b g64",
          "autoround 4b g32 rtn", "bits=4")


def nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Each config's record (and the baseline's), with its quantized model counted by hand as
    the backend returned it: before any forward pass, as the job's coverage phase counts it
    (bitsandbytes repacks its 4-bit weights for the CPU kernels on the first forward)."""
    calibration = tmp_path_factory.mktemp("calibration") / "calibration.txt"
    calibration.write_text(generate_text(400, seed=7))
    data = sweep_dict(
        backends=[{"backend": name, "configs": configs} for name, configs in CONFIGS.items()],
        eval={"text": sweep_dict()["eval"]["text"], "seq_len": 64, "samples": 8},
        calibration={"text": str(calibration), "samples": 8, "seq_len": 64},
        layer_stats=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantdask.backends, "_REGISTRY", dict(quantdask.backends._REGISTRY))
        register_backend(Backend("rtn", fake_quantize, options={
            "bits": Option(int, choices=(4, 8), help="bits per weight")}))
        jobs = expand_grid(sweep_from_dict(data))
        backends = {job.backend: get_backend(job.backend) for job in jobs}
    first = jobs[0]
    reference = compute_reference(first.model, first.eval, first.eval.read_text(),
                                  calibration=first.calibration)
    originals = checkpoint()
    ran = {}
    for job in jobs:
        counted = []
        original = backends[job.backend].quantize

        def counting(*args, original=original, counted=counted, job=job, **kwargs):
            model = original(*args, **kwargs)
            counted.append(by_hand(model, originals if job.backend == "rtn" else None))
            return model

        backend = dataclasses.replace(backends[job.backend], quantize=counting)
        record = run_job(job, backend, reference=reference).record
        ran[job.config_label] = (record, *counted[0])
    return ran


def quantized_layer_bytes(module) -> int | None:
    """The stored bytes of a quantized layer's weight and its quantization constants, from
    the module's own attributes; None for a module that holds no quantized weight."""
    import bitsandbytes as bnb
    from hqq.core.quantize import HQQLinear
    from torchao.quantization import Int8Tensor

    weight = getattr(module, "weight", None)
    if isinstance(module, bnb.nn.Linear4bit):
        state = weight.quant_state
        total = nbytes(weight.data) + nbytes(state.absmax) + nbytes(state.code)
        if state.nested:  # the absmax quantized in turn: its own absmax and code
            total += nbytes(state.state2.absmax) + nbytes(state.state2.code)
        # The shape, dtype, block size and quant type, packed as JSON bytes beside them.
        packed = next(v for k, v in state.as_dict(packed=True).items()
                      if k.startswith("quant_state."))
        return total + nbytes(packed)
    if isinstance(module, bnb.nn.Linear8bitLt):
        # int8 rows, a float32 scale per row (SCB) and a one-byte weight format code.
        return nbytes(weight.data) + nbytes(weight.SCB) + 1
    if isinstance(weight, Int8Tensor):
        return nbytes(weight.qdata) + nbytes(weight.scale) + nbytes(weight.zero_point)
    if type(weight).__name__ == "Int4OpaqueTensor":
        return nbytes(weight.qdata) + nbytes(weight.scale_and_zero)
    if isinstance(module, HQQLinear):
        core = nbytes(module.W_q) + nbytes(module.meta["scale"]) + nbytes(module.meta["zero"])
        # Its meta (bits, group size, shape, axis, packing names...) as small tensors.
        meta = sum(nbytes(v) for k, v in module.state_dict().items()
                   if k not in ("W_q", "scale", "zero", "bias"))
        assert 0 < meta < 100
        return core + meta
    if hasattr(module, "qweight"):  # AutoRound's GPTQ-style export
        return sum(nbytes(t) for t in (module.qweight, module.qzeros, module.scales,
                                       getattr(module, "g_idx", None)) if t is not None)
    return None


def by_hand(model, originals=None):
    """(quantized bytes, the rest's bytes by dtype, quantized layers) counted from the modules:
    a quantized layer's weight with its constants, every other parameter as stored. A float
    weight that differs from the checkpoint's (``originals``) counts as quantized."""
    quantized, rest, layers = 0, Counter(), 0
    for name, module in model.named_modules():
        held = quantized_layer_bytes(module)
        if held is not None:
            quantized += held
            layers += 1
        for pname, param in module.named_parameters(recurse=False):
            if held is not None and pname in ("weight", "W_q"):
                continue
            key = f"{name}.{pname}"
            if originals is not None and key in originals and not (
                    param.detach() == originals[key]).all():
                quantized += nbytes(param)
                layers += pname == "weight"
                continue
            rest[str(param.dtype).removeprefix("torch.")] += nbytes(param)
    return quantized, rest, layers


def checkpoint():
    from safetensors.torch import load_file

    from quantdask.demo_model import DEMO_MODEL_DIR

    return load_file(f"{DEMO_MODEL_DIR}/model.safetensors")


def test_every_backend_splits_its_size_into_the_quantized_part_and_the_rest(jobs):
    assert {label: record["status"] for label, (record, *_) in jobs.items()} == {
        label: "done" for label in LABELS}
    params = jobs["baseline"][0]["param_count"]
    for label, (record, quantized, rest, layers) in jobs.items():
        assert layers == (0 if label == "baseline" else 28), label  # 7 linear layers x 4
        assert record["quantized_bytes"] == quantized, label
        assert record["unquantized_bytes"] == sum(rest.values()), label
        assert record["quantized_bytes"] + record["unquantized_bytes"] == record["size_bytes"]
        assert record["bits_per_weight"] == pytest.approx(8 * record["size_bytes"] / params)
        if label == "baseline":
            assert record["bits_per_quantized_weight"] is None
        else:
            assert record["bits_per_quantized_weight"] == pytest.approx(
                8 * quantized / record["quantized_params"]), label
        (dtype, _), = rest.items()  # one dtype left on this model, whichever the backend
        assert record["unquantized_dtypes"] == f"{dtype} 100%", label


def test_bits_per_quantized_weight_is_the_format_and_its_constants(jobs):
    bits = {label: jobs[label][0]["bits_per_quantized_weight"] for label in LABELS[1:]}
    layers = 28
    weights = jobs["nf4"][0]["quantized_params"]
    # Per layer (not per weight): the 16-entry float32 quant map and the packed JSON state.
    assert bits["nf4"] == pytest.approx(4 + 32 / 64, abs=layers * 250 * 8 / weights)
    assert bits["nf4 dq"] < bits["nf4"]  # absmax in 8 bits, not 32
    # LLM.int8: a float32 scale per output row (and a byte per layer for its format code);
    # torchao's int8: an int8 zero point per row too.
    rows = 4 * (128 + 64 + 64 + 128 + 384 + 384 + 128)  # q, k, v, o, gate, up, down
    assert bits["int8 t=6"] == pytest.approx(8 + (32 * rows + 8 * layers) / weights)
    assert bits["ao int8wo"] == pytest.approx(8 + 40 * rows / weights)
    assert bits["ao int4wo g32"] == pytest.approx(4 + 64 / 32)  # float32 scale and zero
    assert bits["hqq 4b g64"] == pytest.approx(4 + 64 / 64, abs=0.05)
    assert bits["autoround 4b g32 rtn"] == pytest.approx(4 + (16 + 4) / 32)  # f16 scale, 4b zero
    assert bits["bits=4"] == 32.0  # simulated: the rounded weights stay float32


def test_autoround_and_nf4_compare_on_the_quantized_part_not_on_bits_per_weight(jobs):
    autoround, nf4 = jobs["autoround 4b g32 rtn"][0], jobs["nf4"][0]
    assert autoround["quantized_share"] == nf4["quantized_share"]
    # The same 4-bit weights with their constants: within 0.1 bit of each other...
    assert 4.5 <= nf4["bits_per_quantized_weight"] < autoround["bits_per_quantized_weight"] < 4.7
    # ...while bits_per_weight differs by a bit and a half, all of it the rest's dtype:
    # bitsandbytes keeps the model's float32, AutoRound's CPU export holds it in 16 bits
    # (bfloat16 with auto-round 0.16 on CPU; float16 elsewhere).
    assert nf4["bits_per_weight"] - autoround["bits_per_weight"] > 1.4
    assert nf4["unquantized_dtypes"] == "float32 100%"
    assert autoround["unquantized_dtypes"] in ("bfloat16 100%", "float16 100%")
    assert nf4["unquantized_bytes"] == 2 * autoround["unquantized_bytes"]
    rest = 8 * (nf4["unquantized_bytes"] - autoround["unquantized_bytes"]) / nf4["param_count"]
    quantized = 8 * (nf4["quantized_bytes"] - autoround["quantized_bytes"]) / nf4["param_count"]
    assert nf4["bits_per_weight"] - autoround["bits_per_weight"] == pytest.approx(
        rest + quantized)
    assert rest > 1.4 and abs(quantized) < 0.1


def test_a_bias_and_a_layer_left_unquantized_are_the_rest():
    """Biases (a parameter beside torchao's weight, a plain tensor HQQ keeps) and a layer left
    in full precision count as the rest, in their own dtypes."""
    import torch
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 32),
                                torch.nn.Linear(32, 16, dtype=torch.float16))
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn == "0")
    model[1] = HQQLinear(model[1], BaseQuantizeConfig(nbits=4, group_size=32),
                         compute_dtype=torch.float32, device="cpu")
    covered = coverage(model)
    weight = model[0].weight
    assert covered.quantized_params == 64 * 32 + 32 * 32
    assert covered.unquantized_by_dtype == {"float32": 4 * (32 + 32),
                                            "float16": 2 * (32 * 16 + 16)}
    assert covered.unquantized_dtypes() == "float16 80%, float32 20%"  # 1,056 and 256 bytes
    assert covered.quantized_bytes == (
        nbytes(weight.qdata) + nbytes(weight.scale) + nbytes(weight.zero_point)
        + quantized_layer_bytes(model[1]))
    assert covered.bits_per_quantized_weight == pytest.approx(
        8 * covered.quantized_bytes / covered.quantized_params)
    nothing = coverage(torch.nn.Linear(4, 2, dtype=torch.bfloat16))
    assert nothing.bits_per_quantized_weight is None and nothing.quantized_bytes == 0
    assert nothing.unquantized_dtypes() == "bfloat16 100%" and nothing.size_bytes == 20
