"""bitsandbytes' CPU 4-bit width refusal comes from the layers' shapes, before a model is built
and quantized for nothing; and the shapes it reads (a skeleton on the meta device) name the
very layers transformers replaces, family by family, so it refuses no job that would run."""

from __future__ import annotations

import pytest

from quantdask.backends import get_backend
from quantdask.job.job import run_job
from quantdask.measure.reference import compute_reference
from quantdask.process.model_source import ModelSource, load_model_source
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.sweep import expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import sweep_dict
from tests.tiny_families import FAMILIES, build_tiny, build_tiny_llama

REASON = ("bitsandbytes' CPU 4-bit kernel on this processor (AVX512-BF16) needs each "
          "quantized layer's input width to be a multiple of 64: "
          "model.layers.0.mlp.down_proj.in_features=96; quantize on a GPU, or leave the "
          "layer out (skip_modules)")


@pytest.fixture
def narrow_llama(tmp_path):
    """A tiny Llama whose down_proj takes 96 inputs (no multiple of 64)."""
    return build_tiny_llama(tmp_path, hidden_size=64, intermediate_size=96)


@pytest.mark.timeout(120)
def test_the_cpu_4bit_width_refusal_comes_before_the_model_is_built(narrow_llama,
                                                                    monkeypatch):
    import bitsandbytes.functional

    data = sweep_dict(models=[{"name": "narrow", "path": narrow_llama}],
                      backends=[{"backend": "bitsandbytes", "configs": [{"bits": 4}]}])
    job = next(j for j in expand_grid(sweep_from_dict(data)) if j.config_label == "nf4")
    reference = compute_reference(job.model, job.eval, job.eval.read_text())  # builds fp32
    monkeypatch.setattr(bitsandbytes.functional, "has_avx512bf16", lambda: True)
    builds = []

    def no_build(self, device, quantization_config=None):
        builds.append(quantization_config)
        raise AssertionError("the quantized model was built before the refusal")

    monkeypatch.setattr(ModelSource, "build", no_build)
    record = run_job(job, get_backend("bitsandbytes"), reference=reference).record
    assert builds == []
    assert (record["status"], record["failure_class"]) == ("skipped", "unsupported")
    assert record["error_message"] == REASON


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen2_151k"])
def test_the_widths_read_before_the_build_are_the_layers_transformers_replaces(
        family, tmp_path, monkeypatch):
    """The skeleton's picked layers and widths equal the built model's ``Linear4bit`` layers
    (GPT-2's Conv1D transposed, Falcon's own linear class left out, a tied head skipped), and
    reading them leaves the worker's cached config as it was."""
    import bitsandbytes as bnb
    import bitsandbytes.functional

    from quantdask.backends.bitsandbytes import bitsandbytes_config, selected_widths

    monkeypatch.setattr(bitsandbytes.functional, "has_avx512bf16", lambda: False)
    source = load_model_source(ModelSpec(path=str(build_tiny(family, tmp_path / family))))
    options = get_backend("bitsandbytes").normalize({"bits": 4}, "options")
    config_before = source.config.to_dict()
    predicted = selected_widths(source, options)
    assert source.config.to_dict() == config_before
    built = source.build("cpu", quantization_config=bitsandbytes_config(options))
    replaced = {name: module.in_features for name, module in built.named_modules()
                if isinstance(module, bnb.nn.Linear4bit)}
    assert predicted == replaced
    assert (predicted == {}) == (family == "falcon")
