"""lm-eval tasks answered by a GGUF in llama.cpp (issue 69): the same requests lm-eval gives
HFLM, the same tokens, question for question against the torch model and a plain
llama-cpp-python loop; on tiny Llamas built here (nothing downloaded)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import KeptRunDir, write_generate_task
from tests.gguf_models import cached_f32, gemma_style_model, require_gguf

require_gguf()

from quantdask.demo_model import DEMO_TASKS_DIR  # noqa: E402
from quantdask.gguf.quantize import quantize_gguf  # noqa: E402
from quantdask.gguf.runtime import RuntimeDevice  # noqa: E402
from quantdask.gguf.tasks_lm import llama_cpp_lm  # noqa: E402
from quantdask.measure.tasks import evaluate_lm, evaluate_tasks  # noqa: E402
from quantdask.sweepfile.tasks import TaskSettings  # noqa: E402

pytestmark = [pytest.mark.timeout(240)]

QUESTIONS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    # a SentencePiece vocabulary: a text and its continuation tokenize apart at the space
    return gemma_style_model(tmp_path_factory.mktemp("tasks") / "gemma")


@pytest.fixture(scope="module")
def generate_task(tmp_path_factory) -> Path:
    """demo_facts' questions as a generate_until task: stop at '.' or ',', 4 new tokens."""
    root = tmp_path_factory.mktemp("generate")
    write_generate_task(root)
    return root


def _items(items) -> dict:
    return {(i.task, i.doc_id, i.metric): i.value for i in items}


def _gguf_items(path, tokenizer, config, settings):
    lm = llama_cpp_lm(path, tokenizer, config, RuntimeDevice(2), settings.max_length)
    try:
        return evaluate_lm(lm, settings)
    finally:
        lm.close()


def test_the_f32_gguf_answers_every_question_as_the_torch_model_does(model, generate_task):
    """F32 in llama.cpp against the same checkpoint in float32 torch (HFLM): the same answer
    to every multiple-choice and every generated question (llama.cpp quantizes activations
    only for quantized matmuls: none in an F32 file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    settings = TaskSettings(names=["demo_facts", "demo_generate"],
                            include_path=[DEMO_TASKS_DIR, str(generate_task)], limit=QUESTIONS)
    theirs_rows, theirs = evaluate_tasks(torch_model, tokenizer, settings)
    ours_rows, ours = _gguf_items(cached_f32(model), tokenizer, torch_model.config, settings)
    assert len(ours) == len(theirs) == QUESTIONS * 2 + 12  # acc, acc_norm; exact_match
    assert _items(ours) == _items(theirs)
    assert [(r.task, r.metric, r.value, r.samples) for r in ours_rows] == [
        (r.task, r.metric, r.value, r.samples) for r in theirs_rows]


def _plain_choices(path, tokenizer, docs: list[dict]) -> list[int]:
    """Each question's choice by a plain llama-cpp-python loop: every (question, choice)
    decoded alone from a reset context, its continuation's log-likelihood summed, the
    largest taken (lm-eval's acc); the pair encoded as lm-eval encodes it."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, logits_all=True,
                          n_threads=2, verbose=False)
    picks = []
    for doc in docs:
        scores = []
        for choice in doc["choices"]:
            whole = tokenizer(doc["query"] + " " + choice)["input_ids"]
            context = tokenizer(doc["query"])["input_ids"]
            llm.reset()
            llm.eval(whole[:-1])
            logits = np.array(llm.scores[len(context) - 1:len(whole) - 1], dtype=np.float64)
            logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
                -1, keepdims=True)) - logits.max(-1, keepdims=True)
            scores.append(sum(logprobs[i, t] for i, t in enumerate(whole[len(context):])))
        picks.append(int(np.argmax(scores)))
    llm.close()
    return picks


def test_a_quantized_ggufs_choices_are_a_plain_loops(model, tmp_path):
    """Q4_K_M's answers (its KV cache reused across a question's choices) against a plain
    llama-cpp-python loop that decodes every pair from scratch: the same choice for every
    question, and the accuracy its choices give."""
    from transformers import AutoConfig, AutoTokenizer

    q4 = quantize_gguf(cached_f32(model), tmp_path / "q4.gguf", "Q4_K_M", threads=2)
    tokenizer = AutoTokenizer.from_pretrained(model)
    settings = TaskSettings(names=["demo_facts"], include_path=DEMO_TASKS_DIR, limit=QUESTIONS)
    rows, items = _gguf_items(q4, tokenizer, AutoConfig.from_pretrained(model), settings)
    docs = [json.loads(line) for line in Path(DEMO_TASKS_DIR, "demo_facts", "demo_facts.jsonl")
            .read_text().splitlines()][:QUESTIONS]
    picks = _plain_choices(q4, tokenizer, docs)
    accuracy = {i.doc_id: i.value for i in items if i.metric == "acc"}
    assert accuracy == {n: float(pick == doc["gold"]) for n, (pick, doc)
                        in enumerate(zip(picks, docs, strict=True))}
    [acc] = [r for r in rows if r.metric == "acc"]
    assert math.isclose(acc.value, sum(accuracy.values()) / QUESTIONS)


@pytest.mark.slow
def test_a_gguf_job_of_a_sweep_records_its_tasks_beside_the_baselines(model, cluster,
                                                                        tmp_path):
    """In a sweep, a GGUF config's tasks are scored in llama.cpp (not skipped): its rows and
    task items, each beside the torch baseline's score, the recovery, the runtime named, the
    recovery against the F32 file in llama.cpp beside it in the report's table; and
    ``quantdask compare`` pairs two GGUF jobs' task items question for question (the flips
    counted here from the items themselves)."""
    import quantdask as qd
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    sweep = sweep_from_dict({
        "name": "gguf-tasks", "models": [{"name": "gemma", "path": str(model)}],
        "backends": [{"backend": "gguf", "configs": [{"type": "Q8_0"}, {"type": "Q3_K_M"},
                                                      {"type": "F32"}]}],
        "eval": {"text": str(model / "eval.txt"), "seq_len": 64, "samples": 4,
                 "batch_size": 4},
        "tasks": {"names": ["demo_facts"], "include_path": DEMO_TASKS_DIR,
                  "limit": QUESTIONS},
        "seed": 0, "retries": 0})
    results = qd.run_sweep(sweep, tmp_path / "run", cluster.client)
    q8 = results.filter(config_label="Q8_0").row(0, named=True)
    assert q8["status"] == "done" and q8["tasks_error"] is None and q8["tasks_s"] > 0
    assert q8["runtime"].startswith("llama.cpp") and "task" not in (q8["runtime_skipped"] or "")
    tasks = qd.read_tasks(tmp_path / "run").filter(job_id=q8["job_id"])
    assert set(tasks["metric"]) == {"acc", "acc_norm"} and set(tasks["samples"]) == {QUESTIONS}
    assert tasks["baseline_value"].null_count() == 0
    for row in tasks.to_dicts():  # (a random model's baseline may score 0: no ratio then)
        assert row["recovery"] is not None or "scored 0" in row["recovery_reason"], row
    items = qd.read_frame(tmp_path / "run", "task_items").filter(job_id=q8["job_id"])
    assert items.height == 2 * QUESTIONS
    # Recovery against llama.cpp's own unquantized file (issue 69 item 2), beside torch's.
    f32 = results.filter(config_label="F32").row(0, named=True)
    assert f32["status"] == "done" and f32["quantized_by"] is None
    f32_tasks = qd.read_tasks(tmp_path / "run").filter(job_id=f32["job_id"])
    table = qd.report.recovery_table(results, qd.read_tasks(tmp_path / "run"))
    for row in tasks.to_dicts():
        base = f32_tasks.filter(task=row["task"], metric=row["metric"])["value"].item()
        shown = table.filter(job_id=q8["job_id"], metric=row["metric"]).row(0, named=True)
        assert shown["runtime_baseline"] == round(base, 4)
        assert shown["runtime_recovery_%"] == (round(100 * row["value"] / base, 2) if base
                                               else None)
    torch_rows = table.filter(job_id=results.filter(backend="none")["job_id"].item())
    assert torch_rows["runtime_recovery_%"].null_count() == torch_rows.height
    acc = {}
    for label in ("Q8_0", "Q3_K_M"):
        job = results.filter(config_label=label)["job_id"].item()
        rows = qd.read_frame(tmp_path / "run", "task_items").filter(job_id=job, metric="acc")
        acc[label] = dict(zip(rows["doc_id"], rows["value"], strict=True))
    compared = qd.compare(tmp_path / "run", tmp_path / "run", pairs={"Q8_0": "Q3_K_M"})
    row = compared.tasks.filter(config_label="Q8_0", metric="acc").row(0, named=True)
    assert row["pairing"] == "paired per question" and row["n"] == QUESTIONS
    assert row["flipped_to_wrong"] == sum(acc["Q8_0"][d] > acc["Q3_K_M"][d] for d in acc["Q8_0"])
    assert row["flipped_to_right"] == sum(acc["Q8_0"][d] < acc["Q3_K_M"][d] for d in acc["Q8_0"])
    assert math.isclose(row["diff"], (sum(acc["Q3_K_M"].values())
                                      - sum(acc["Q8_0"].values())) / QUESTIONS, abs_tol=1e-12)


def test_task_refusal_names_what_llama_cpp_cannot_score():
    """Greedy text tasks are scored; a sampled answer, an image and an output type lm-eval's
    LM API has beyond text are not, each with its reason."""
    from quantdask.gguf.tasks_lm import task_refusal

    greedy = {"output_type": "generate_until",
              "generation_kwargs": {"until": ["\n"], "do_sample": False, "temperature": 0.0}}
    assert task_refusal(greedy) is None
    assert task_refusal({"output_type": "multiple_choice"}) is None
    assert "samples its answers" in task_refusal(
        {**greedy, "generation_kwargs": {"temperature": 0.7}})
    assert "gives the model images (doc_to_image)" in task_refusal(
        {**greedy, "doc_to_image": ["image"]})
    assert "'generate_until_multimodal' is not one" in task_refusal(
        {"output_type": "generate_until_multimodal"})


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_task_llama_cpp_cannot_score_is_refused_before_anything_runs(
        command, model, tmp_path, capsys, monkeypatch):
    """A tasks block with a sampled task and a GGUF config: exit 2 naming the task and the
    reason, within seconds, an existing run directory left as it was; the same block without
    the GGUF config plans."""
    import time

    import yaml

    from quantdask.cli import main

    write_generate_task(tmp_path / "tasks")
    task = tmp_path / "tasks" / "gen" / "gen.yaml"
    task.write_text(task.read_text().replace("do_sample: false", "do_sample: true\n"
                                                                 "  temperature: 0.8"))
    sweep = {"name": "sampled", "models": [{"name": "gemma", "path": str(model)}],
             "backends": [{"backend": "bitsandbytes", "configs": [{"bits": 8}]},
                          {"backend": "gguf", "configs": [{"type": "Q8_0"}]}],
             "eval": {"text": str(model / "eval.txt"), "seq_len": 32, "samples": 2},
             "tasks": {"names": ["demo_generate"], "include_path": str(tmp_path / "tasks")}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    monkeypatch.chdir(tmp_path)
    kept = KeptRunDir(tmp_path / "kept")
    run_dir = kept.path
    began = time.monotonic()
    assert main([command, str(path), "--run-dir", str(run_dir)]) == 2
    assert time.monotonic() - began < 20
    err = capsys.readouterr().err
    assert err.startswith("quantdask: error: tasks.names: Q8_0 (gguf) scores its tasks in "
                          "llama.cpp, which cannot score the task 'demo_generate': it samples "
                          "its answers"), err
    assert "drop 'demo_generate' from the tasks block" in err
    assert kept.unchanged()
    if command == "plan":
        sweep["backends"] = sweep["backends"][:1]
        path.write_text(yaml.safe_dump(sweep))
        assert main(["plan", str(path)]) == 0
