"""Every architecture a user brings: tiny models of 8 decoder families, each through bitsandbytes
nf4 and int8, torchao int8 and HQQ 4-bit, on the real cluster. A job is done with the share it
quantized and a per-layer row for each quantized layer, or skipped with the reason; never done
with nothing quantized. Where it is done, a plain transformers load of the same config (for HQQ,
a notebook loop of HQQLinear layers) agrees on perplexity.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import polars as pl
import pytest

from quantdask.plan.planning import plan_sweep
from quantdask.run.sweep import run_sweep
from quantdask.store.readers import read_layers
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import sweep_dict
from tests.tiny_families import FAMILIES, build_tiny

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

CONFIGS = [{"backend": "bitsandbytes", "grid": {"bits": [4, 8]}},
           {"backend": "torchao", "configs": [{"mode": "int8_weight_only"}]},
           {"backend": "hqq", "configs": [{"bits": 4, "group_size": 32}]}]
SEQ_LEN, SAMPLES = 32, 4
NO_LAYER = "no layer was quantized: "
QUALITY_DOC = Path(__file__).resolve().parent.parent / "docs" / "quality.md"
TABLE_INTRO = "What the backends do with tiny random models of 8 families"
# The table's columns after the family, and the configs each one stands for.
TABLE_COLUMNS = {"bitsandbytes nf4 / int8": ("nf4", "int8 t=6"),
                 "torchao int8 weight-only": ("ao int8wo",),
                 "hqq 4-bit g32": ("hqq 4b g32",)}


def family_sweep(models: dict) -> dict:
    data = sweep_dict(name="families", backends=CONFIGS,
                      models=[{"name": family, "path": str(path)}
                              for family, path in models.items()])
    data["eval"].update(seq_len=SEQ_LEN, samples=SAMPLES, batch_size=SAMPLES)
    return data


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    return {family: build_tiny(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def run(models, cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("families-run")
    sweep = sweep_from_dict(family_sweep(models))
    results = run_sweep(sweep, run_dir, cluster.client)
    return sweep, results, read_layers(run_dir)


def outcome(results: pl.DataFrame, family: str, label: str) -> dict:
    rows = results.filter((pl.col("model") == family) & (pl.col("config_label") == label))
    assert rows.height == 1, (family, label)
    return rows.row(0, named=True)


def test_every_job_is_done_with_a_share_or_skipped_with_a_reason(run):
    _, results, _ = run
    assert results.height == len(FAMILIES) * 5
    assert set(results["status"]) <= {"done", "skipped"}, results.filter(
        pl.col("status") == "failed").select("model", "config_label", "error_message").rows()
    quantized = results.filter(pl.col("backend") != "none")
    done = quantized.filter(pl.col("status") == "done")
    assert (done["quantized_share"] > 0).all() and (done["quantized_params"] > 0).all()
    skipped = quantized.filter(pl.col("status") == "skipped")
    assert (skipped["failure_class"] == "unsupported").all()
    assert skipped["error_message"].str.len_chars().min() > 10
    baselines = results.filter(pl.col("backend") == "none")
    assert baselines["status"].to_list() == ["done"] * len(FAMILIES)
    assert baselines["quantized_share"].to_list() == [0.0] * len(FAMILIES)


def test_what_each_backend_does_with_each_family(run):
    """The table the README gives: done with this share, or skipped and why."""
    _, results, _ = run
    table = {(r["model"], r["config_label"]): r for r in results.to_dicts()}
    # Falcon's own linear class: bitsandbytes replaces exact nn.Linear only.
    for label in ("nf4", "int8 t=6"):
        falcon = table[("falcon", label)]
        assert falcon["status"] == "skipped" and falcon["error_message"].startswith(
            NO_LAYER + "bitsandbytes replaced none of this model's weights, which stay in "
                       "FalconLinear 57%, Embedding 43%")
    # torchao takes FalconLinear (an nn.Linear), and then lacks an op its forward uses.
    falcon_ao = table[("falcon", "ao int8wo")]
    assert (falcon_ao["status"], falcon_ao["error_class"]) == ("skipped", "NotImplementedError")
    # GPT-2's Conv1D: bitsandbytes quantizes it (weights transposed), torchao does not.
    assert table[("gpt2", "nf4")]["status"] == "done"
    assert table[("gpt2", "ao int8wo")]["error_message"].startswith(
        NO_LAYER + "torchao replaced none of this model's weights, which stay in Conv1D")
    # Mixtral's experts are fused 3-D parameters: most of the model stays in full precision.
    mixtral = table[("mixtral", "nf4")]
    assert mixtral["status"] == "done" and mixtral["quantized_share"] < 0.1
    assert mixtral["full_precision"].startswith("experts (MixtralExperts) ")
    # 151,936 tokens: the embeddings are nearly all of the tiny model, and stay unquantized.
    big = table[("qwen2_151k", "nf4")]
    assert big["status"] == "done" and big["quantized_share"] < 0.01
    for family in ("llama", "phi3", "gemma", "gpt_neox"):
        assert {table[(family, label)]["status"] for label in ("nf4", "int8 t=6", "ao int8wo")} \
            == {"done"}, family
    # HQQ takes every linear layer: FalconLinear, and GPT-2's Conv1D turned into nn.Linear,
    # with the same share as bitsandbytes where both quantize.
    hqq = {family: table[(family, "hqq 4b g32")] for family in FAMILIES}
    assert {r["status"] for r in hqq.values()} == {"done"}
    assert hqq["falcon"]["quantized_share"] > 0.5
    assert hqq["gpt2"]["quantized_share"] == pytest.approx(
        table[("gpt2", "nf4")]["quantized_share"])
    assert hqq["mixtral"]["quantized_share"] < 0.1
    assert hqq["mixtral"]["full_precision"].startswith("experts (MixtralExperts) ")


def quantized_modules(model) -> list[str]:
    """Modules whose weight the backend holds quantized, independently of quantdask."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return [name for name, module in model.named_modules()
            if type(module).__name__ == "HQQLinear" or getattr(module, "weight", None) is not None
            and (type(module.weight).__name__ in ("Params4bit", "Int8Params")
                 or is_traceable_wrapper_subclass(module.weight))]


def hqq_by_hand(model, bits: int, group_size: int):
    """HQQ as a user's notebook loop does it: every linear layer but the head becomes an
    HQQLinear (GPT-2's Conv1D, which computes x @ W + b, as the Linear of W transposed)."""
    import torch
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
    from transformers.pytorch_utils import Conv1D

    config = BaseQuantizeConfig(nbits=bits, group_size=group_size)
    for name, module in list(model.named_modules()):
        if name.endswith("lm_head") or not isinstance(module, (torch.nn.Linear, Conv1D)):
            continue
        if isinstance(module, Conv1D):
            linear = torch.nn.Linear(*module.weight.shape, bias=module.bias is not None)
            linear.weight.data, linear.bias.data = module.weight.data.t(), module.bias.data
            module = linear
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child,
                HQQLinear(module, config, compute_dtype=torch.float32, device="cpu"))
    return model


def plain_load(path, label: str):
    """The quantized model as a user would load it with transformers alone."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if label == "ao int8wo":  # what quantdask's torchao backend does: quantize_ every Linear
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        quantize_(model, Int8WeightOnlyConfig(),
                  filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and name != "lm_head")
        return model
    if label == "hqq 4b g32":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return hqq_by_hand(model, bits=4, group_size=32)
    config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                 bnb_4bit_compute_dtype=torch.float32) if label == "nf4"
              else BitsAndBytesConfig(load_in_8bit=True))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu",
                                                quantization_config=config).eval()


def test_done_jobs_agree_with_a_plain_transformers_load_and_measure_every_quantized_layer(
        run, models):
    import torch
    from transformers import AutoTokenizer

    _, results, layers = run
    tokenizer = AutoTokenizer.from_pretrained(next(iter(models.values())))
    with open(sweep_dict()["eval"]["text"], encoding="utf-8") as f:
        ids = tokenizer(f.read())["input_ids"][:SEQ_LEN * SAMPLES]
    windows = torch.tensor(ids).view(SAMPLES, SEQ_LEN)
    done = results.filter((pl.col("status") == "done") & (pl.col("backend") != "none"))
    assert done.height >= 26
    for row in done.to_dicts():
        model = plain_load(models[row["model"]], row["config_label"])
        with torch.inference_mode():
            log_q = torch.log_softmax(model(input_ids=windows).logits[:, :-1].double(), -1)
        nll = -log_q.gather(-1, windows[:, 1:].unsqueeze(-1)).mean().item()
        assert row["perplexity"] == pytest.approx(math.exp(nll), rel=0.01), row["config_label"]
        # A per-layer row for every layer the backend quantized, in the network's order.
        rows = layers.filter(pl.col("job_id") == row["job_id"]).sort("position")
        expected = quantized_modules(model)
        assert rows["layer"].to_list() == expected, (row["model"], row["config_label"])
        assert row["layers_unmeasured"] == 0
        assert rows["weight_rel_error"].is_between(0, 0.5).all()
        assert rows["output_rel_error"].is_not_null().all()


def test_the_plan_predicts_the_share_and_the_configs_that_quantize_nothing(run):
    sweep, results, _ = run
    plan = plan_sweep(sweep)
    measured = {(r["model"], r["config_label"]): r for r in results.to_dicts()}
    for row in plan.to_dicts():
        result = measured[(row["model"], row["config_label"])]
        if result["status"] == "done" and row["backend"] != "none":
            assert row["quantized_share"] == pytest.approx(result["quantized_share"]), row
            assert row["state"] == "to run"
    unsupported = {(r["model"], r["config_label"]): r["reason"]
                   for r in plan.filter(pl.col("state") == "unsupported").to_dicts()}
    # Known before any worker runs: bitsandbytes on Falcon and torchao on GPT-2 quantize
    # nothing. (torchao on Falcon fails only when its forward runs: the workers find that.)
    assert set(unsupported) == {("falcon", "nf4"), ("falcon", "int8 t=6"), ("gpt2", "ao int8wo")}
    assert unsupported[("falcon", "nf4")] == (
        "would quantize no layer: bitsandbytes replaces none of this model's layers (its "
        "weights are in FalconLinear 57%, Embedding 43%, LayerNorm <1%)")


def family_table() -> list[list[str]]:
    """The rows of docs/quality.md's family table (after its header and rule), as cells."""
    text = QUALITY_DOC.read_text(encoding="utf-8")
    lines = text[text.index(TABLE_INTRO):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = [[cell.strip() for cell in line.strip().strip("|").split("|")]
             for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start:])]
    assert table[0][1:] == list(TABLE_COLUMNS), table[0]
    return table[2:]


def family_of(cell: str) -> str:
    """The family a row names: its first word (``qwen2`` is the tiny 151k-vocabulary one)."""
    word = cell.split()[0]
    [family] = [f for f in FAMILIES if f == word] or [f for f in FAMILIES if f.startswith(word)]
    return family


def check_cell(cell: str, row: dict) -> None:
    """One cell against one measured result: a share as the cell rounds it (``36%``: to whole
    percent, ``0.4%``: to a tenth), or ``skipped: <gist> (...)`` where the result is skipped
    for that reason (a backticked name: its error class; words: what its message says)."""
    where = (row["model"], row["config_label"], cell)
    share = re.match(r"(\d+(?:\.(\d+))?)%", cell)
    if share:
        assert row["status"] == "done", where
        decimals = len(share[2] or "")
        assert f"{100 * row['quantized_share']:.{decimals}f}" == share[1], (
            *where, row["quantized_share"])
        return
    assert cell.startswith("skipped: "), where
    assert (row["status"], row["failure_class"]) == ("skipped", "unsupported"), where
    gist = cell.removeprefix("skipped: ").split(" (")[0]
    if re.fullmatch(r"`\w+`", gist):
        assert row["error_class"] == gist.strip("`"), (*where, row["error_class"])
    else:
        assert row["error_message"].startswith(gist), (*where, row["error_message"])


@pytest.mark.timeout(400)
def test_the_family_table_in_the_docs_is_what_the_sweep_measured(run):
    """docs/quality.md's table, cell by cell, against this module's sweep: every family and
    every config in it, each share as measured and each skip for its reason."""
    _, results, _ = run
    measured = {(r["model"], r["config_label"]): r for r in results.to_dicts()}
    table = family_table()
    assert sorted(family_of(cells[0]) for cells in table) == sorted(FAMILIES)
    checked = 0
    for cells in table:
        family = family_of(cells[0])
        assert len(cells) == 1 + len(TABLE_COLUMNS), cells
        for cell, labels in zip(cells[1:], TABLE_COLUMNS.values()):
            for label in labels:
                check_cell(cell, measured[(family, label)])
                checked += 1
    assert checked == len(FAMILIES) * 4  # every quantized job of the sweep has its cell


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gemma", "gpt2", "llama"])
def test_a_models_weights_are_counted_alike_on_every_path(family, tmp_path):
    """Loaded with its weights (a resident job, the reference), built empty (a GGUF or
    streamed job that is the first on its worker), or built empty from a source already held
    (streaming), or on the meta device by the plan: one count, a tied head once (it was counted
    twice on the empty paths, so a job's param_count and bits per weight depended on what its
    worker had done before, and on a resume)."""
    from quantdask.plan.model_facts import _layer_facts
    from quantdask.process.model_source import load_model_source
    from quantdask.sweepfile.model import ModelSpec

    folder = build_tiny(family, tmp_path / family)
    spec = ModelSpec(path=str(folder))
    loaded = load_model_source(spec, weights=True)
    empty = load_model_source(spec, weights=False)
    counts = {loaded.param_count, empty.param_count,
              sum(p.numel() for p in empty.empty_model().parameters()),
              _layer_facts(folder, False)["param_count"]}
    assert len(counts) == 1, counts
    built = loaded.build("cpu")
    assert counts == {sum(p.numel() for p in built.parameters())}
    tied = built.get_output_embeddings().weight is built.get_input_embeddings().weight
    assert tied == (family in ("gemma", "gpt2"))
