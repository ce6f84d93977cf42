"""Task accuracy: lm-evaluation-harness tasks run on a model already in memory.

lm-eval's ``HFLM`` wraps the model object and its tokenizer where they are (the quantized model
on the job's device; nothing is saved or reloaded) and ``simple_evaluate`` runs the sweep's
tasks (:class:`~quantdask.sweepfile.tasks.TaskSettings`), batched. :func:`task_rows` turns its
result into the tasks frame's rows, one per (task, metric), and :func:`with_baseline` adds the
baseline's score and the recovery.

A prompt longer than the model's window is cut from the left by lm-eval with a warning in a log
nobody reads: a task scored on cut prompts measures something else (published gsm8k scores of
about 0 for every config came from this). ``TruncationAwareLM`` counts, per task, the samples
that had any request cut, and every row carries that count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from quantdask.randomness import global_generators
from quantdask.records import TaskItemRow, TaskRow
from quantdask.util import import_datasets_offline

if TYPE_CHECKING:
    from quantdask.sweepfile.tasks import TaskSettings

log = logging.getLogger("quantdask.job")

TASK_COLUMNS = ("tasks_s", "tasks_peak_device_mem_bytes", "tasks_peak_host_rss_bytes")
"""The results' columns of the task phase: its time and peak memory."""
BOOTSTRAP_ITERS = 1000
"""Bootstrap resamples for the standard error of a metric that is not a mean (a mean's, such as
accuracy's, is analytic)."""


class EncodesEachStringOnce:
    """For an lm-eval LM (``HFLM``, ``gguf.tasks_lm``): inside ``encoding_once()`` each string is
    tokenized once. Within one loglikelihood call each pair is encoded twice (by
    :class:`NotesCutPrompts`, to note the cuts, then by lm-eval) and a question's context once
    per choice (the demo task's phase: 1.26 s to 1.12 s of CPU)."""

    _encodings: dict[tuple, list[int]] | None = None

    def tok_encode(self, string, add_special_tokens=None, left_truncate_len=None, **kwargs):
        encode = super().tok_encode  # type: ignore[misc]  # the LM's, after this in the MRO
        if self._encodings is None or kwargs:
            return encode(string, add_special_tokens, left_truncate_len, **kwargs)
        key = (string, add_special_tokens, left_truncate_len)
        if key not in self._encodings:
            self._encodings[key] = encode(string, add_special_tokens, left_truncate_len)
        return list(self._encodings[key])

    @contextlib.contextmanager
    def encoding_once(self):
        self._encodings = {}
        try:
            yield
        finally:
            self._encodings = None


class NotesCutPrompts:
    """For an lm-eval LM that cuts as ``HFLM`` does: notes, per task, which samples had a
    request cut to the model's window (``truncated``: task -> doc ids). Put it before
    :class:`EncodesEachStringOnce` and the LM in the bases."""

    truncated: dict[str, set[int]]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.truncated = defaultdict(set)

    def _note(self, request, cut: bool) -> None:
        if cut:
            self.truncated[request.task_name].add(request.doc_id)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        with self.encoding_once():  # type: ignore[attr-defined]
            self._note_cut_pairs(requests)
            return super().loglikelihood(requests, disable_tqdm=True)  # type: ignore[misc]

    def _note_cut_pairs(self, requests) -> None:
        # The pairs as TemplateLM.loglikelihood encodes them, and the rule of
        # HFLM._loglikelihood_tokens: context + continuation longer than max_length + 1
        # tokens loses its left end.
        lm: Any = self
        for request in requests:
            context, continuation = request.args
            if context:
                context_enc, continuation_enc = lm._encode_pair(context, continuation)
            else:
                continuation_enc = lm.tok_encode(continuation, add_special_tokens=False)
                context_enc, continuation_enc = (
                    ([lm.prefix_token_id], continuation_enc)
                    if lm.prefix_token_id != continuation_enc[0]
                    else (continuation_enc[:1], continuation_enc[1:]))
            self._note(request, len(context_enc) + len(continuation_enc) > lm.max_length + 1)

    def generate_until(self, requests, disable_tqdm: bool = False):
        # HFLM.generate_until keeps the last max_length - max_gen_toks tokens of a prompt.
        from lm_eval.models.utils import normalize_gen_kwargs

        lm: Any = self
        for request in requests:
            context, gen_kwargs = request.args
            new_tokens = normalize_gen_kwargs(dict(gen_kwargs), lm.max_gen_toks)
            room = lm.max_length - new_tokens["max_gen_toks"]
            self._note(request, len(lm.tok_encode(context)) > room)
        return super().generate_until(requests, disable_tqdm=True)  # type: ignore[misc]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        # Rolling windows cover a long document whole: nothing is cut.
        return super().loglikelihood_rolling(requests, disable_tqdm=True)  # type: ignore[misc]


def _truncation_aware_lm():
    """``HFLM`` that notes, per task, which samples lm-eval cuts to fit the model's window."""
    from lm_eval.models.huggingface import HFLM

    class TruncationAwareLM(NotesCutPrompts, EncodesEachStringOnce, HFLM):
        pass

    return TruncationAwareLM


def evaluate_tasks(model, tokenizer, settings: TaskSettings
                   ) -> tuple[list[TaskRow], list[TaskItemRow]]:
    """The tasks frame's rows for ``model`` (a transformers causal LM, on its device), and
    the task items frame's (each question's score): ``simple_evaluate`` over ``settings``'
    tasks, batched, seeded, offline."""
    with _offline_and_quiet():
        lm = _truncation_aware_lm()(pretrained=model, tokenizer=tokenizer,
                                    batch_size=settings.batch_size,
                                    max_length=settings.max_length)
    return evaluate_lm(lm, settings)


def evaluate_lm(lm: Any, settings: TaskSettings) -> tuple[list[TaskRow], list[TaskItemRow]]:
    """:func:`evaluate_tasks` on an lm-eval LM that notes its cut prompts
    (:class:`NotesCutPrompts`): ``HFLM``'s, or llama.cpp's (``gguf.tasks_lm``)."""
    import lm_eval
    import lm_eval.utils

    lm_eval.utils.apply_template = render_template  # (every caller looks it up there)
    seed = settings.seed
    # lm-eval seeds the process-global generators (random, numpy, torch) and draws from its own
    # (few-shot: random.Random(seed); bootstrap: random.Random(i); loglikelihood and greedy
    # scoring draw nothing): it runs beside other seeding calls, never while a packed job's
    # library draws from the global ones (quantdask.randomness).
    with _offline_and_quiet(), global_generators():
        results = lm_eval.simple_evaluate(
            model=lm, tasks=settings.specs(), task_manager=settings.manager(),
            num_fewshot=settings.num_fewshot, limit=settings.limit,
            bootstrap_iters=BOOTSTRAP_ITERS, log_samples=True, random_seed=seed,
            numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    rows = task_rows(results, {task: len(docs) for task, docs in lm.truncated.items()})
    for row in rows:
        if row.truncated_samples:
            log.warning("task %s: %d of %s samples had their prompt cut to the model's %d "
                        "tokens: its %s is not the task's", row.task, row.truncated_samples,
                        row.samples, lm.max_length, row.metric)
    return rows, item_rows(results.get("samples", {}))


@functools.lru_cache(maxsize=1024)
def _compiled_template(source: str):
    import lm_eval.utils

    return lm_eval.utils.env.from_string(source)


def render_template(template: str, doc: dict) -> str:
    """lm-eval's ``utils.apply_template`` (a task's Jinja ``doc_to_text``, ``doc_to_choice``,
    ``doc_to_target``... rendered on a document, in lm-eval's own Jinja environment), with each
    template compiled once per process: lm-eval compiles the template string at every call,
    about six times a question (the demo task's phase, 160 questions on a CPU slot: 1.41 s to
    1.20 s of CPU)."""
    return _compiled_template(template).render(**doc)


@contextlib.contextmanager
def _offline_and_quiet():
    """Nothing downloaded (a task's data comes from local files or the datasets cache, as the
    eval text does), no progress bars and only lm-eval's errors while tasks run: a worker's
    output is a log, and the truncation lm-eval warns of per request is counted and reported
    per task here. (The model's calls get ``disable_tqdm``; the requests' build has no such
    switch, and tqdm reads ``TQDM_DISABLE`` only when imported, so its bar is switched off
    where lm-eval imported it.)"""
    datasets = import_datasets_offline()
    import lm_eval.api.task as task_module
    import lm_eval.evaluator
    from tqdm import tqdm

    bar = getattr(task_module, "tqdm", None)
    if bar is not None and bar is tqdm:
        task_module.tqdm = functools.partial(bar, disable=True)
    # lm-eval records the git commit of the working directory by running `git describe`,
    # which prints "fatal: not a git repository" to the terminal anywhere else, and the
    # environment by running torch's collect_env (11 commands: pip, conda, nvidia-smi...,
    # 0.4 s of CPU a job); quantdask records neither from lm-eval's results.
    lm_eval.evaluator.get_git_commit_hash = lambda: None
    lm_eval.evaluator.add_env_info = lambda results: None
    datasets.disable_progress_bars()
    lm_eval_log = logging.getLogger("lm_eval")
    level = lm_eval_log.level
    lm_eval_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lm_eval_log.setLevel(level)


def _number(value: Any) -> float | None:
    """A finite float, or None (lm-eval writes "N/A" for a missing standard error)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def task_rows(results: dict[str, Any], truncated: dict[str, int]) -> list[TaskRow]:
    """One row per (task, metric, filter) of an lm-eval result (groups too: their ``samples``
    is their tasks' sum), with ``truncated`` samples per task (a group's: its tasks' sum)."""
    groups = results.get("group_subtasks", {})
    counts = {task: n["effective"] for task, n in results.get("n-samples", {}).items()}
    better = results.get("higher_is_better", {})
    rows = []
    for task, figures in results["results"].items():
        members = _leaves(task, groups) or [task]
        for key, value in figures.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filter_name = key.split(",", 1)
            rows.append(TaskRow(
                task=task, is_group=task in groups, metric=metric,
                filter=filter_name, value=_number(value),
                stderr=_number(figures.get(f"{metric}_stderr,{filter_name}")),
                samples=sum(counts.get(m, 0) for m in members) or None,
                truncated_samples=sum(truncated.get(m, 0) for m in members),
                num_fewshot=results.get("n-shot", {}).get(task),
                higher_is_better=better.get(task, {}).get(metric),
            ))
    return rows


def item_rows(samples: dict[str, list[dict[str, Any]]]) -> list[TaskItemRow]:
    """One row per (task, question, metric, filter) of lm-eval's logged samples: each
    question's numeric scores (a metric scored per corpus, e.g. BLEU's tuples, has none)."""
    rows = []
    for task, examples in samples.items():
        for example in examples:
            for metric in example.get("metrics", ()):
                value = example.get(metric)
                if isinstance(value, (bool, int, float)) and math.isfinite(value):
                    rows.append(TaskItemRow(task=task, doc_id=int(example["doc_id"]),
                                            metric=metric, filter=example["filter"],
                                            value=float(value)))
    return rows


def truncated_total(rows: list[TaskRow]) -> int:
    """Samples with a prompt cut, over the tasks of ``rows``: each task's once (its metrics
    share its samples; a group's rows add up tasks already counted)."""
    per_task = {row.task: row.truncated_samples for row in rows if not row.is_group}
    return sum(per_task.values())


def _leaves(task: str, groups: dict[str, list[str]]) -> list[str]:
    """The tasks under a group, through nested groups ([] for a task)."""
    return [leaf for child in groups.get(task, []) for leaf in (_leaves(child, groups) or [child])]


def with_baseline(rows: list[TaskRow], baseline: list[TaskRow],
                  baseline_error: str | None = None) -> list[TaskRow]:
    """``rows`` with the baseline's value and standard error of the same (task, metric, filter),
    and ``recovery``: value / baseline value, or baseline / value for a metric where lower is
    better (perplexity, bits per byte), so that 1.0 is no loss and below 1 a loss either way.
    Where it is null, ``recovery_reason`` says why: ``baseline_error`` (why the baseline's
    scoring failed), a figure missing on either side, or a divisor of 0."""
    by_key = {(b.task, b.metric, b.filter): b for b in baseline}
    joined = []
    for row in rows:
        base = by_key.get((row.task, row.metric, row.filter))
        recovery, reason = _recovery(row, base, baseline_error)
        joined.append(dataclasses.replace(
            row, baseline_value=base.value if base else None,
            baseline_stderr=base.stderr if base else None, recovery=recovery,
            recovery_reason=reason))
    return joined


def _recovery(row: TaskRow, base: TaskRow | None,
              baseline_error: str | None) -> tuple[float | None, str | None]:
    """(recovery, None), or (None, why there is none)."""
    if baseline_error is not None:
        return None, f"the baseline's task scoring failed: {baseline_error}"
    if base is None:
        return None, f"the baseline has no {row.metric} for {row.task}"
    value, base_value = row.value, base.value
    if value is None or base_value is None:
        return None, f"{'this config' if value is None else 'the baseline'} has no value"
    lower_is_better = row.higher_is_better is False
    divisor = value if lower_is_better else base_value
    if not divisor:
        return None, f"{'this config' if lower_is_better else 'the baseline'} scored 0"
    return (base_value if lower_is_better else value) / divisor, None
