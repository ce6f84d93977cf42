"""Task accuracy (the tasks block) and gates: the settings and their refusals, the job ids, and
lm-eval's scores checked against an independent computation on peaked, realistic and flat
models; truncated prompts flagged. (Sweeps on a real cluster: test_tasks_sweep.py.)"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

from quantdask.cli import main
from quantdask.demo_model import DEMO_MODEL_DIR, DEMO_TASKS_DIR
from quantdask.errors import SpecError
from quantdask.store.schema import RESULT_SCHEMA
from quantdask.sweepfile.gates import GATE_METRICS, Gate, gate_columns, parse_gates
from quantdask.sweepfile.sweep import expand_grid
from quantdask.sweepfile.sweep_file import sweep_from_dict
from quantdask.sweepfile.tasks import TaskSettings
from tests.conftest import sweep_dict, write_generate_task
from tests.kl_models import REALISTIC_EVAL_TEXT, REALISTIC_MODEL, flat_model

pytestmark = pytest.mark.timeout(300)

DEMO_TASK = {"names": ["demo_facts"], "include_path": DEMO_TASKS_DIR}


def tasks_sweep(**tasks) -> dict:
    return sweep_dict(tasks={**DEMO_TASK, **tasks})


# --- settings, refusals and ids -------------------------------------------------------------


def test_a_local_task_is_found_and_its_data_files_resolved_against_its_folder(tmp_path):
    settings = sweep_from_dict(tasks_sweep(), root=str(tmp_path)).tasks
    [config] = settings.specs()
    assert config["task"] == "demo_facts"
    data = config["dataset_kwargs"]["data_files"]["test"]
    assert data == str(Path(DEMO_TASKS_DIR, "demo_facts", "demo_facts.jsonl"))
    assert settings.digests["demo_facts"] and len(settings.digests["demo_facts"]) == 64


def test_tasks_are_part_of_the_ids_and_their_batch_size_is_not():
    plain = {job.config_label: job.id for job in expand_grid(sweep_from_dict(sweep_dict()))}
    with_tasks = {j.config_label: j.id for j in expand_grid(sweep_from_dict(tasks_sweep()))}
    limited = {j.config_label: j.id for j in expand_grid(sweep_from_dict(tasks_sweep(limit=8)))}
    batched = {j.config_label: j.id
               for j in expand_grid(sweep_from_dict(tasks_sweep(batch_size=3)))}
    assert plain.keys() == with_tasks.keys()
    assert not set(plain.values()) & set(with_tasks.values())
    assert not set(with_tasks.values()) & set(limited.values())
    assert with_tasks == batched


def test_a_changed_local_task_file_changes_the_ids(tmp_path):
    import shutil

    shutil.copytree(Path(DEMO_TASKS_DIR, "demo_facts"), tmp_path / "tasks" / "demo_facts")
    sweep = {**tasks_sweep(), "tasks": {"names": ["demo_facts"], "include_path": "tasks"}}
    before = [job.id for job in expand_grid(sweep_from_dict(sweep, root=str(tmp_path)))]
    data = tmp_path / "tasks" / "demo_facts" / "demo_facts.jsonl"
    data.write_text("\n".join(data.read_text().splitlines()[:-1]) + "\n")  # one question less
    after = [job.id for job in expand_grid(sweep_from_dict(sweep, root=str(tmp_path)))]
    assert not set(before) & set(after)


@pytest.mark.parametrize("tasks, field, words", [
    ({"names": ["demo_factz"]}, "tasks.names[0]", "did you mean demo_facts"),
    ({"names": ["no_such_task_anywhere"]}, "tasks.names[0]", "no lm-eval task or group"),
    ({"names": []}, "tasks.names", "at least one"),
    ({"limit": 0}, "tasks.limit", "positive"),
    ({"num_fewshot": -1}, "tasks.num_fewshot", ">= 0"),
    ({"include_path": "no-such-folder"}, "tasks.include_path", "not a folder"),
    ({"batch": 4}, "tasks.batch", "unknown key"),
])
def test_bad_task_settings_are_refused_naming_the_field(tasks, field, words, write_sweep,
                                                        capsys):
    with pytest.raises(SpecError) as error:
        sweep_from_dict(tasks_sweep(**tasks))
    assert error.value.field == field
    assert words in error.value.message
    assert main(["plan", write_sweep(tasks_sweep(**tasks))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"quantdask: error: {field}: ") and "Traceback" not in err


def test_a_name_in_no_task_file_is_refused_without_lm_evals_built_in_index(monkeypatch):
    # lm-eval's index of its ~14,000 task files takes seconds of CPU; reading them as text to
    # look for the name takes a tenth of that (tasks.builtin_task_files).
    import quantdask.sweepfile.tasks

    built = quantdask.sweepfile.tasks._task_manager

    def without_the_built_in_index(include_paths, defaults, fingerprint):
        assert not defaults, "lm-eval's built-in index was built"
        return built(include_paths, defaults, fingerprint)

    monkeypatch.setattr(quantdask.sweepfile.tasks, "_task_manager", without_the_built_in_index)
    with pytest.raises(SpecError) as error:
        sweep_from_dict(tasks_sweep(names=["demo_facts", "hellaswg"]))
    assert error.value.field == "tasks.names[1]"
    assert "no lm-eval task or group is named 'hellaswg'" in error.value.message
    assert "did you mean hellaswag" in error.value.message  # a built-in name, from its file


def test_every_name_lm_evals_index_holds_is_in_the_task_files_text(tmp_path):
    """The shapes lm-eval's own task files take: quoted keys, tags as flow and block lists,
    a tag from an included file without the .yaml suffix, a name with parentheses."""
    from lm_eval.tasks._index import TaskIndex

    from quantdask.sweepfile.tasks import task_files

    (tmp_path / "a.yaml").write_text("task: alpha\ntag: [t_flow_1, t_flow_2]\n"
                                     "dataset_path: x\n")
    (tmp_path / "b.yaml").write_text('"task": "beta_(x)"\n"tag": "t_quoted"\n')
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "_base").write_text("tag:\n  - t_included\n  - t_two\n"
                                            "output_type: multiple_choice\n")
    (tmp_path / "sub" / "c.yaml").write_text("include: _base\ntask: gamma\n")
    (tmp_path / "g.yaml").write_text("group: grp\ntask:\n  - alpha\n  - gamma\n")
    index = TaskIndex.build([tmp_path])
    assert set(index) == {"alpha", "beta_(x)", "gamma", "grp", "t_flow_1", "t_flow_2",
                          "t_quoted", "t_included", "t_two"}
    files = task_files(tmp_path)
    assert all(name.encode() in files.text for name in index)
    assert set(files.names) == set(index)
    assert b"delta" not in files.text


def test_tasks_without_lm_eval_are_refused_with_the_install_command(monkeypatch, write_sweep,
                                                                    capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    assert main(["plan", write_sweep(tasks_sweep())]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quantdask: error: tasks: task accuracy needs lm-evaluation-harness")
    assert "pip install 'quantdask[tasks]'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("gates, field, words", [
    (["perplexity_ratio <= 2"], "gates[0]", "unknown gate metric 'perplexity_ratio'"),
    (["kl_divergence =< 0.1"], "gates[0]", "METRIC OP VALUE"),
    (["kl_divergence <= much"], "gates[0]", "must be a finite number"),
    (["kl_divergence <= inf"], "gates[0]", "must be a finite number"),
    ([{"gate": "recovery >= 0.9", "task": "mmlu"}], "gates[0].task", "no task"),
    ([{"gate": "kl_divergence <= 1", "model": "other"}], "gates[0].model", "no model"),
    ([{"gate": "kl_divergence <= 1", "when": 1}], "gates[0].when", "unknown key"),
])
def test_bad_gates_are_refused_naming_the_field(gates, field, words, write_sweep, capsys):
    data = {**tasks_sweep(), "gates": gates}
    with pytest.raises(SpecError) as error:
        sweep_from_dict(data)
    assert error.value.field == field and words in error.value.message
    assert main(["plan", write_sweep(data)]) == 2
    assert field in capsys.readouterr().err


def test_a_task_gate_needs_a_tasks_block():
    with pytest.raises(SpecError, match="add a tasks block"):
        sweep_from_dict(sweep_dict(gates=["recovery >= 0.95"]))


def test_every_gate_metric_is_a_numeric_result_column():
    import polars as pl

    for metric in GATE_METRICS:
        assert RESULT_SCHEMA[metric] in (pl.Float64(), pl.Int64()), metric


def test_gates_judge_each_figure_and_fail_an_unmeasured_one():
    gates = parse_gates(["kl_divergence <= 0.01", "bits_per_quantized_weight < 5",
                         {"gate": "recovery >= 0.95", "task": "t", "task_metric": "acc"},
                         {"gate": "top1_agreement >= 0.99", "model": "other"}],
                        models={"demo", "other"}, tasks=("t",))
    rows = [{"task": "t", "metric": "acc", "recovery": 0.96, "value": 0.5},
            {"task": "t", "metric": "acc_norm", "recovery": 0.5, "value": 0.4}]
    record = {"model": "demo", "kl_divergence": 0.02, "bits_per_quantized_weight": None,
              "top1_agreement": 0.5}
    columns = gate_columns(gates, record, rows, is_baseline=False)
    assert columns["gates_passed"] is False
    assert columns["gates_met"].splitlines() == [
        "recovery [t acc] >= 0.95", "top1_agreement >= 0.99 (model other)"]
    assert columns["gates_failed"].splitlines() == [
        "kl_divergence <= 0.01: kl_divergence is 0.02",
        "bits_per_quantized_weight < 5: bits_per_quantized_weight was not measured"]
    assert gate_columns(gates, record, rows, is_baseline=True)["gates_passed"] is None
    assert gate_columns((), record, rows, is_baseline=False)["gates_met"] is None
    every_task = Gate("recovery", ">=", 0.9)
    assert every_task.failures(record, rows) == ["recovery >= 0.9: t acc_norm is 0.5"]
    assert every_task.failures(record, []) == ["recovery >= 0.9: no task rows measured"]


# --- scores against an independent computation ----------------------------------------------


def choice_log_likelihoods(model, tokenizer, query: str, choices: list[str]) -> list[float]:
    """Sum of the log-probs of " " + choice after ``query``, with plain transformers, the
    log-softmax in float64: the whole string and the query tokenized with the tokenizer's
    defaults, the continuation being the whole's tokens past the query's. The choices go in
    one forward pass, each padded at its end: a causal model's logits at a position depend on
    the tokens before it only, so the padding changes none that is read."""
    context = tokenizer(query)["input_ids"]
    wholes = [tokenizer(query + " " + choice)["input_ids"] for choice in choices]
    width = max(len(whole) for whole in wholes) - 1
    inputs = torch.tensor([whole[:-1] + [0] * (width - len(whole) + 1) for whole in wholes])
    with torch.no_grad():
        logits = model(input_ids=inputs).logits.double()
    sums = []
    for row, whole in zip(logits, wholes):
        continuation = whole[len(context):]
        log_probs = torch.log_softmax(row[:len(whole) - 1], dim=-1)[-len(continuation):]
        sums.append(log_probs.gather(1, torch.tensor(continuation)[:, None]).sum().item())
    return sums


def hand_scores(model, tokenizer, docs: list[dict]) -> tuple[float, float, float, list[bool]]:
    """Accuracy (argmax of the summed log-likelihoods), the same over each choice's length in
    characters (lm-eval's acc_norm; the delimiter not counted), the smallest gap between the
    best two choices under either (how near a tie the closest call was), and each sample's
    argmax right or not."""
    correct_norm = 0
    right = []
    closest = float("inf")
    for doc in docs:
        sums = choice_log_likelihoods(model, tokenizer, doc["query"], doc["choices"])
        normed = [s / len(c) for s, c in zip(sums, doc["choices"])]
        right.append(max(range(len(sums)), key=lambda i: (sums[i], -i)) == doc["gold"])
        correct_norm += max(range(len(normed)), key=lambda i: (normed[i], -i)) == doc["gold"]
        for scores in (sums, normed):
            top = sorted(scores, reverse=True)
            closest = min(closest, top[0] - top[1])
    return sum(right) / len(docs), correct_norm / len(docs), closest, right


def realistic_task(folder: Path, n: int = 40) -> Path:
    """A local multiple-choice task on the realistic model's text: each sentence's last word,
    out of it and three others of the text, in a folder of its own (YAML + JSONL)."""
    import random

    sentences = [s.split() for s in Path(REALISTIC_EVAL_TEXT).read_text().split(" .")
                 if len(s.split()) >= 4][:n]
    words = sorted({w for s in sentences for w in s})
    rng = random.Random(0)
    docs = []
    for words_of in sentences:
        answer = words_of[-1]
        choices = rng.sample([w for w in words if w != answer], 3)
        choices.insert(rng.randrange(4), answer)
        docs.append({"query": " ".join(words_of[:-1]), "choices": choices,
                     "gold": choices.index(answer)})
    task = folder / "realistic_words"
    task.mkdir(parents=True)
    (task / "words.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    demo_yaml = Path(DEMO_TASKS_DIR, "demo_facts", "demo_facts.yaml").read_text()
    (task / "words.yaml").write_text(demo_yaml.replace("task: demo_facts",
                                                       "task: realistic_words")
                                     .replace("demo_facts.jsonl", "words.jsonl"))
    return folder


def _docs(settings: TaskSettings) -> list[dict]:
    [config] = settings.specs()
    path = config["dataset_kwargs"]["data_files"]["test"]
    docs = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return docs[:settings.limit] if settings.limit else docs


def _quantized(model_dir: str, bits: int):
    """The bitsandbytes model a job would score, made by the backend a job uses."""
    from quantdask.backends import get_backend
    from quantdask.process.model_source import load_model_source
    from quantdask.sweepfile.model import ModelSpec

    backend = get_backend("bitsandbytes")
    options = backend.normalize({"bits": bits}, "options")
    source = load_model_source(ModelSpec(path=model_dir))
    with source.weights():
        return backend.quantize(source, options, "cpu"), source.tokenizer


@pytest.mark.parametrize("regime, bits", [("peaked", 32), ("peaked", 4), ("realistic", 32),
                                          ("realistic", 4), ("flat", 32)])
def test_task_accuracy_equals_an_independent_argmax(regime, bits, tmp_path, monkeypatch):
    """quantdask's accuracy (the job's task phase: lm-eval on the model in memory) equals a
    hand-written argmax over per-choice log-likelihoods computed with plain transformers in
    float64, exactly and sample by sample, on a peaked, a realistic and a flat model,
    unquantized and nf4."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantdask.measure.tasks import evaluate_tasks

    if regime == "realistic":
        settings = TaskSettings(names=["realistic_words"],
                                include_path=str(realistic_task(tmp_path)))
        model_dir = REALISTIC_MODEL
    else:
        settings = TaskSettings(**DEMO_TASK, limit=96)
        model_dir = flat_model(tmp_path) if regime == "flat" else DEMO_MODEL_DIR
    if bits == 32:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    else:
        model, tokenizer = _quantized(model_dir, bits)
    scored, items = evaluate_tasks(model, tokenizer, settings)
    rows = {row.metric: row for row in scored}
    acc, acc_norm, closest, right = hand_scores(model, tokenizer, _docs(settings))
    # the task items frame: each question's correctness, as the hand computation has it
    accs = sorted((i.doc_id, i.value) for i in items if i.metric == "acc")
    assert [d for d, _ in accs] == list(range(len(right)))
    assert [bool(v) for _, v in accs] == right
    assert {i.metric for i in items} == {"acc", "acc_norm"}
    # lm-eval batches its requests its own way and sums in float32; the hand computation
    # batches one question's choices and sums in float64: a choice within float32's rounding
    # of the best would make the two disagree.
    assert closest > 1e-4, f"a near tie ({closest:.2g} nats): the comparison cannot decide it"
    assert rows["acc"].samples == len(_docs(settings))
    assert rows["acc"].value == acc
    assert rows["acc_norm"].value == acc_norm
    n = rows["acc"].samples
    assert rows["acc"].stderr == pytest.approx((acc * (1 - acc) / (n - 1)) ** 0.5)
    assert rows["acc"].truncated_samples == 0


class _Warnings:
    """Stands in for lm-eval's HFLM logger: keeps what it warns (past any log level)."""

    def __init__(self):
        self.lines: list[str] = []

    def warning(self, message, *args):
        self.lines.append(message % args if args else message)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_truncated_prompts_are_counted_as_lm_eval_cuts_them(monkeypatch):
    """A window shorter than the prompts: lm-eval cuts them from the left and only warns, once
    per request it cuts. Every row of the task counts the samples with any request cut: as
    many requests as lm-eval warned of, over exactly those samples."""
    import lm_eval.models.huggingface as hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantdask.measure.tasks import evaluate_tasks, truncated_total

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    settings = TaskSettings(**DEMO_TASK, limit=24)
    docs = _docs(settings)
    lengths = [[len(tokenizer(d["query"] + " " + c)["input_ids"]) for c in d["choices"]]
               for d in docs]
    window = max(max(ls) for ls in lengths) - 2  # the longest requests lose a token
    cut = [[n > window + 1 for n in ls] for ls in lengths]
    assert 0 < sum(map(any, cut)) < len(docs)

    warned = _Warnings()
    monkeypatch.setattr(hf, "eval_logger", warned)
    rows, _ = evaluate_tasks(model, tokenizer, dataclasses.replace(settings, max_length=window))
    lm_eval_cuts = [line for line in warned.lines if line.startswith("Combined length")]
    assert len(lm_eval_cuts) == sum(map(sum, cut))  # requests lm-eval cut
    assert {row.truncated_samples for row in rows} == {sum(map(any, cut))}
    assert truncated_total(rows) == sum(map(any, cut))  # one task: counted once, not per metric
    assert {row.truncated_samples for row in evaluate_tasks(model, tokenizer, settings)[0]} \
        == {0}


def test_generated_answers_count_prompts_cut_to_fit_the_new_tokens(tmp_path, monkeypatch):
    """A generate_until task: lm-eval keeps the last max_length - max_gen_toks tokens of a
    prompt (max_new_tokens spelled as the task spells it). Scoring starts no command (lm-eval
    would run git and torch's collect_env: pip, conda, nvidia-smi... at every job)."""
    import subprocess

    commands = []

    class RecordedPopen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            commands.append(args)
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", RecordedPopen)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantdask.measure.tasks import evaluate_tasks

    docs = write_generate_task(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    lengths = [len(tokenizer(d["query"])["input_ids"]) for d in docs]
    window = sorted(lengths)[len(lengths) // 2] + 4  # prompts longer than window - 4 are cut
    settings = TaskSettings(names=["demo_generate"], include_path=str(tmp_path),
                            max_length=window)
    [row], items = evaluate_tasks(model, tokenizer, settings)
    assert len(items) == 12 and {i.value for i in items} <= {0.0, 1.0}
    assert row.metric == "exact_match" and row.samples == 12
    assert row.truncated_samples == sum(n > window - 4 for n in lengths) > 0
    assert commands == []


# --- the task phase inside a job: failures and deadlines -------------------------------------


@pytest.fixture(scope="module")
def nf4_job_and_reference():
    from quantdask.measure.reference import compute_reference

    jobs = expand_grid(sweep_from_dict(tasks_sweep(limit=8)))
    job = next(j for j in jobs if not j.is_baseline)
    reference = compute_reference(job.model, job.eval, job.eval.read_text(), tasks=job.tasks)
    assert len(reference.baseline_tasks) == 2 and reference.tasks.seconds > 0
    return job, reference


def _run(job, reference):
    from quantdask.backends import get_backend
    from quantdask.job.job import run_job

    return run_job(job, get_backend(job.backend), 1, reference)


def test_a_failure_in_the_task_phase_is_classified_like_any_other(nf4_job_and_reference,
                                                                  monkeypatch):
    import quantdask.measure.tasks

    job, reference = nf4_job_and_reference
    done = _run(job, reference)
    assert done.record["status"] == "done" and len(done.rows["tasks"]) == 2
    assert done.record["tasks_s"] > 0 and done.record["eval_s"] > 0

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(quantdask.measure.tasks, "evaluate_tasks", out_of_memory)
    failed = _run(job, reference)
    assert failed.record["status"] == "failed"
    assert failed.record["failure_class"] == "out_of_memory"
    assert "in score_tasks" in failed.record["traceback"] and failed.rows == {}


def test_the_task_phase_counts_against_the_job_deadline(nf4_job_and_reference, monkeypatch):
    import time

    import quantdask.measure.tasks

    job, reference = nf4_job_and_reference
    job = dataclasses.replace(job, timeout_s=2.0)

    def slow(*args, **kwargs):
        time.sleep(2.5)
        return [], []

    monkeypatch.setattr(quantdask.measure.tasks, "evaluate_tasks", slow)
    late = _run(job, reference)
    assert late.record["status"] == "failed" and late.record["failure_class"] == "timeout"
    assert late.rows == {} and "tasks_s" not in late.record


def test_a_failed_baseline_scoring_fails_only_the_baselines_task_rows(monkeypatch):
    # Issue 39 item 5. Before: the baseline's scoring raised out of its part of the reference,
    # so the reference, the baseline's quality figures and every quantized job failed with it.
    import quantdask.measure.tasks
    from quantdask.measure.reference import compute_reference

    baseline_job, nf4 = expand_grid(sweep_from_dict(tasks_sweep(limit=8)))
    real, calls = quantdask.measure.tasks.evaluate_tasks, []

    def broken_the_first_time(*args, **kwargs):  # the first scoring is the baseline's
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("lm-eval broke on the unquantized model")
        return real(*args, **kwargs)

    monkeypatch.setattr(quantdask.measure.tasks, "evaluate_tasks", broken_the_first_time)
    reference = compute_reference(nf4.model, nf4.eval, nf4.eval.read_text(), tasks=nf4.tasks)
    reason = "RuntimeError: lm-eval broke on the unquantized model"
    assert reference.baseline is not None and reference.tasks.rows == []
    assert reference.tasks.error == reason

    base = _run(baseline_job, reference)  # done, with its quality figures; no task rows
    assert base.record["status"] == "done" and base.record["perplexity"] > 0
    assert base.record["tasks_error"] == reason and base.rows["tasks"] == []
    quantized = _run(nf4, reference)  # its own scores, recovery null with the reason
    assert quantized.record["status"] == "done" and quantized.record["tasks_error"] is None
    rows = quantized.rows["tasks"]
    assert [r["metric"] for r in rows] == ["acc", "acc_norm"] and len(calls) == 2
    assert all(r["value"] is not None and r["samples"] == 8 for r in rows)
    assert all(r["baseline_value"] is None and r["recovery"] is None for r in rows)
    assert {r["recovery_reason"] for r in rows} == {
        f"the baseline's task scoring failed: {reason}"}
    # A recovery gate fails on it, saying why; a gate on the config's own score is met.
    gates = parse_gates([{"gate": "recovery >= 0.95", "task_metric": "acc"},
                         "task_value >= 0"], models={"demo"}, tasks=("demo_facts",))
    columns = gate_columns(gates, quantized.record, rows, is_baseline=False)
    assert columns["gates_failed"] == (
        "recovery [acc] >= 0.95: demo_facts acc was not measured (the baseline's task "
        f"scoring failed: {reason})")
    assert columns["gates_met"] == "task_value >= 0"


def test_an_out_of_memory_retry_halves_the_task_batch_and_keeps_the_id():
    from quantdask.plan.retry import with_more_room

    job = expand_grid(sweep_from_dict(tasks_sweep(batch_size=16)))[1]
    roomier = with_more_room(job)
    assert roomier.tasks.batch_size == 8 and roomier.eval.batch_size == job.eval.batch_size // 2
    assert roomier.tasks.identity() == job.tasks.identity()


def test_the_demo_runs_without_lm_eval_less_its_tasks_and_gates(monkeypatch, capsys):
    import importlib.util

    from quantdask.demo_model import load_demo_sweep

    assert load_demo_sweep().tasks.names == ("demo_facts",)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lm_eval" else real(name, *a))
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    sweep = load_demo_sweep()
    assert sweep.tasks is None and sweep.gates == ()
    assert "pip install 'quantdask[tasks]'" in capsys.readouterr().out


def test_recovery_is_a_share_kept_whichever_way_the_metric_points():
    from quantdask.measure.tasks import with_baseline
    from quantdask.records import TaskRow

    def row(metric, value, higher):
        return TaskRow(task="t", is_group=False, metric=metric, filter="none", value=value,
                       stderr=None, samples=1, truncated_samples=0, num_fewshot=0,
                       higher_is_better=higher)

    baseline = [row("acc", 0.8, True), row("word_perplexity", 20.0, False), row("f1", 0.0, True)]
    joined = with_baseline([row("acc", 0.6, True), row("word_perplexity", 25.0, False),
                            row("f1", 0.3, True)], baseline)
    assert [r.recovery for r in joined] == [pytest.approx(0.75), pytest.approx(0.8), None]
    assert [r.baseline_value for r in joined] == [0.8, 20.0, 0.0]


def test_gates_from_python_are_checked_as_the_yaml_ones_are():
    base = sweep_dict(tasks=DEMO_TASK)
    sweep = sweep_from_dict({**base, "gates": [Gate("recovery", ">=", 0.95, task="demo_facts")]})
    assert sweep.gates[0].label == "recovery [demo_facts] >= 0.95"
    for gate, field in ((Gate("kl_divergence", "<=", 0.1, model="typo"), "gates[0].model"),
                        (Gate("kl_divergence", "=>", 0.1), "gates[0].gate"),
                        (Gate("kl_divergence", "<=", float("nan")), "gates[0].gate")):
        with pytest.raises(SpecError) as error:
            sweep_from_dict({**base, "gates": [gate]})
        assert error.value.field == field


def test_a_local_task_whose_data_is_missing_is_refused(tmp_path):
    import shutil

    shutil.copytree(Path(DEMO_TASKS_DIR, "demo_facts"), tmp_path / "demo_facts")
    (tmp_path / "demo_facts" / "demo_facts.jsonl").unlink()
    with pytest.raises(SpecError) as error:
        TaskSettings(names=["demo_facts"], include_path=str(tmp_path))
    assert error.value.field == "names[0]" and "not there" in error.value.message


def test_a_task_folder_reached_through_a_link_is_local(tmp_path):
    (tmp_path / "linked").symlink_to(DEMO_TASKS_DIR, target_is_directory=True)
    settings = TaskSettings(names=["demo_facts"], include_path=str(tmp_path / "linked"))
    direct = TaskSettings(names=["demo_facts"], include_path=DEMO_TASKS_DIR)
    assert settings.digests == direct.digests and len(settings.digests["demo_facts"]) == 64
    assert isinstance(settings.specs()[0], dict)


def test_each_template_of_a_task_is_compiled_once_per_process(monkeypatch):
    """lm-eval compiles a task's Jinja templates at every use (six times a question); jobs
    compile each once, and score the same (the argmax tests above check the scores)."""
    import lm_eval.utils
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantdask.measure import tasks

    tasks._compiled_template.cache_clear()
    compiled: list[str] = []
    real = lm_eval.utils.env.from_string
    monkeypatch.setattr(lm_eval.utils.env, "from_string",
                        lambda source, *args, **kwargs: compiled.append(source)
                        or real(source, *args, **kwargs))
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    rows, _ = tasks.evaluate_tasks(model, AutoTokenizer.from_pretrained(DEMO_MODEL_DIR),
                                   TaskSettings(**DEMO_TASK, limit=16))
    assert {row.samples for row in rows} == {16}
    # Before: 99 compiles of 3 templates for 16 questions.
    assert compiled and len(compiled) == len(set(compiled)), compiled


def test_each_string_of_a_loglikelihood_task_is_tokenized_once():
    """lm-eval encodes a question's context once per choice, and the truncation count encoded
    every pair again: each string is encoded once (16 questions of 4 choices: 512 calls
    before); the argmax tests above check the scores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantdask.measure.tasks import evaluate_tasks

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    encoded: list[tuple] = []
    real = tokenizer.encode
    tokenizer.encode = lambda text, *args, **kwargs: encoded.append(
        (text, *args, *sorted(kwargs.items()))) or real(text, *args, **kwargs)
    rows, _ = evaluate_tasks(model, tokenizer, TaskSettings(**DEMO_TASK, limit=16))
    assert {row.samples for row in rows} == {16} and rows[0].truncated_samples == 0
    assert encoded and len(encoded) == len(set(encoded)), len(encoded)
