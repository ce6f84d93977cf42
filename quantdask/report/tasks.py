"""The report's task accuracy and gates: a chart of each task's score against size, the
recovery table, and the pass/fail banner the report opens with.

>>> results, tasks = read_results("runs/demo"), read_tasks("runs/demo")  # doctest: +SKIP
>>> task_chart(results, tasks)  # doctest: +SKIP
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, cast

import polars as pl

from quantdask.store.figures import with_job_label
from quantdask.store.frontier import SIZE_BITS, with_size_bits
from quantdask.words import BASELINE, NO_FILTER, Status

if TYPE_CHECKING:
    import altair as alt


def gates_banner(results: pl.DataFrame) -> str:
    """HTML: whether every done quantized job met the sweep's gates, listing each failing
    config with why; says so when the sweep set no gates."""
    judged = results.filter((pl.col("status") == Status.DONE)
                            & pl.col("gates_passed").is_not_null())
    if judged.is_empty():
        return ("<p><b>Gates:</b> none set (a sweep's <code>gates:</code> block sets "
                "thresholds a pipeline can act on).</p>")
    failing = with_job_label(judged.filter(~pl.col("gates_passed"))).sort("job")
    gates = sorted({g for met in judged["gates_met"].drop_nulls() for g in met.splitlines() if g})
    if failing.is_empty():
        listed = ", ".join(html.escape(g) for g in gates)
        return (f'<div style="border-left:6px solid #54a24b;padding:6px 12px;background:#eef7ec">'
                f"<b>Gates passed</b>: all {judged.height} quantized configs meet {listed}.</div>")
    items = "".join(
        f"<li><b>{html.escape(row['job'])}</b>: "
        f"{html.escape('; '.join((row['gates_failed'] or '').splitlines()))}</li>"
        for row in failing.to_dicts())
    return (f'<div style="border-left:6px solid #e45756;padding:6px 12px;background:#fdeeee">'
            f"<b>Gates failed</b> by {failing.height} of {judged.height} quantized configs "
            f"(<code>quantdask run</code> and <code>quantdask status</code> exit 3):"
            f"<ul>{items}</ul></div>")


def _task_frame(results: pl.DataFrame, tasks: pl.DataFrame) -> pl.DataFrame:
    """The tasks frame joined with each job's label, size and config, error bar ends added."""
    done = results.filter(pl.col("status") == Status.DONE)
    jobs = with_size_bits(with_job_label(done)).select(
        "job_id", "job", "model", "config_label", "backend", "config", "bits_per_weight",
        "bits_per_quantized_weight", SIZE_BITS,
        *(pl.col(c) if c in done.columns else pl.lit(None, pl.String).alias(c)
          for c in ("runtime", "quantized_by")))
    stderr = pl.col("stderr").fill_null(0.0)
    return with_runtime_recovery(tasks.join(jobs, on="job_id")).with_columns(
        (pl.col("value") - stderr).alias("value_lo"), (pl.col("value") + stderr).alias("value_hi"),
        pl.concat_str("task", pl.lit(" · "), "metric",
                      pl.when(pl.col("filter") != NO_FILTER)
                      .then(pl.concat_str(pl.lit(" · "), "filter")).otherwise(pl.lit("")))
        .alias("panel"),
        pl.when(pl.col("truncated_samples") > 0)
        .then(pl.format("TRUNCATED: {} of {} samples cut", "truncated_samples", "samples"))
        .otherwise(pl.format("{} of {} samples cut", "truncated_samples", "samples"))
        .alias("truncation"))


RUNTIME_MATCH = ("model", "runtime", "task", "metric", "filter")
"""What a job's task row and its runtime's unquantized row share."""


def with_runtime_recovery(data: pl.DataFrame) -> pl.DataFrame:
    """Task rows joined with their jobs (``_task_frame``), with ``runtime_baseline_value`` and
    ``runtime_recovery``: for a job measured in a runtime of its own (GGUF: llama.cpp), its
    score against the same model's unquantized file in the same runtime and device (a config
    of type F32, else F16 or BF16: whichever keeps the most bits), as ``recovery`` is against
    the torch baseline; null where the sweep has no such config, and for a job in torch.

    ``recovery`` (against torch) is the report's: it is what every backend's row is read
    against, so rows compare across runtimes, and it counts what the runtime itself changes
    (llama.cpp's 8-bit activations in quantized matmuls). ``runtime_recovery`` isolates the
    quantization from the runtime."""
    unquantized = (pl.col("runtime").is_not_null() & pl.col("quantized_by").is_null()
                   & (pl.col("backend") != BASELINE))
    bases = (data.filter(unquantized).sort("bits_per_weight", descending=True)
             .unique(list(RUNTIME_MATCH), keep="first", maintain_order=True)
             .select(*RUNTIME_MATCH, pl.col("value").alias("runtime_baseline_value")))
    joined = data.join(bases, on=list(RUNTIME_MATCH), how="left")
    value, base = pl.col("value"), pl.col("runtime_baseline_value")
    lower = pl.col("higher_is_better").eq(False)  # (as recovery: 1.0 is no loss either way)
    numerator, divisor = pl.when(lower).then(base).otherwise(value), \
        pl.when(lower).then(value).otherwise(base)
    return joined.with_columns(pl.when(divisor.is_not_null() & (divisor != 0))
                               .then(numerator / divisor).alias("runtime_recovery"))


def task_chart(results: pl.DataFrame, tasks: pl.DataFrame) -> alt.Chart | alt.VConcatChart:
    """Each task's score against bits per weight, one panel per (model, task, metric): every
    done job with its error bar (one standard error), the unquantized baseline as a dashed
    rule. A panel whose prompts were cut to the model's window says so in its title, in red."""
    # Altair here, not at the top: the CLI's closing summary uses this module's tables, and
    # importing Altair (jsonschema's format checkers) costs a command about 1.5 s of CPU.
    import altair as alt

    from quantdask.report.charts import JOB_TOOLTIP, _empty

    if tasks.is_empty():
        return _empty("no task scores (a sweep's tasks: block adds them)")
    data = _task_frame(results, tasks)
    tooltip = [*JOB_TOOLTIP, alt.Tooltip("panel:N", title="task"),
               alt.Tooltip("value:Q", format=".4f"), alt.Tooltip("stderr:Q", format=".4f"),
               alt.Tooltip("baseline_value:Q", title="baseline", format=".4f"),
               alt.Tooltip("recovery:Q", format=".1%"),
               alt.Tooltip("runtime_recovery:Q", title="recovery against its runtime's "
                           "unquantized file", format=".1%"), alt.Tooltip("samples:Q"),
               alt.Tooltip("bits_per_weight:Q", title="bits per weight (whole model)",
                           format=".3f"),
               alt.Tooltip("bits_per_quantized_weight:Q", title="bits per quantized weight",
                           format=".3f"),
               alt.Tooltip("truncation:N", title="prompts cut")]
    panels = []
    for (model, panel), part in data.group_by("model", "panel", maintain_order=True):
        # polars types a column's max as any scalar; truncated_samples is an integer column
        truncated = int(cast(int | None, part["truncated_samples"].max()) or 0)
        title = alt.TitleParams(
            f"{model}: {panel}" + (f"  (TRUNCATED PROMPTS: up to {truncated} samples cut; not "
                                   "the task's score)" if truncated else ""),
            color="#e45756" if truncated else "black")
        # the baseline is its rule alone (see charts.quality_chart): the axis fits the rest
        base = alt.Chart(part.filter(pl.col("backend") != BASELINE)).encode(x=alt.X(
            f"{SIZE_BITS}:Q", title="bits per weight, whole model as stored (the file that "
                                    "ships)", scale=alt.Scale(zero=False, padding=12)))
        bars = base.mark_rule(strokeWidth=2, opacity=0.6).encode(
            y="value_lo:Q", y2="value_hi:Q", color="backend:N", tooltip=tooltip)
        points = base.mark_point(size=90, filled=True).encode(
            y=alt.Y("value:Q", title=f"{panel} (score, ± 1 s.e.)",
                    scale=alt.Scale(zero=False, padding=12)),
            color="backend:N", tooltip=tooltip)
        rule = alt.Chart(part.filter(pl.col("backend") == BASELINE)).mark_rule(
            color="gray", strokeDash=[6, 3]).encode(y="value:Q", tooltip=tooltip)
        panels.append(alt.layer(rule, bars, points).properties(width=360, height=240,
                                                               title=title))
    rows = [alt.hconcat(*panels[i:i + 2]) for i in range(0, len(panels), 2)]
    return alt.vconcat(*rows).properties(title="Task accuracy vs size (higher is better for "
                                               "accuracy; the dashed rule is the baseline)")


def recovery_table(results: pl.DataFrame, tasks: pl.DataFrame) -> pl.DataFrame:
    """Per config and task metric: its score ± standard error, the baseline's, the recovery
    (score / baseline), for a job in a runtime of its own the same against that runtime's
    unquantized file (``with_runtime_recovery``: ``runtime_baseline``,
    ``runtime_recovery_%``), and whether prompts were cut; lowest recovery first per model. ``note``
    says why a recovery is null (the tasks frame's ``recovery_reason``: the baseline's scoring
    failed, say), and a done job whose tasks have no scores (the baseline's, when scoring it
    failed: ``tasks_error``) is a row of its own, first in its model, saying why."""
    unscored = results.filter((pl.col("status") == Status.DONE)
                              & pl.col("tasks_error").is_not_null())
    if tasks.is_empty() and unscored.is_empty():
        return pl.DataFrame()
    data = _task_frame(results, tasks)
    scored = data.sort("model", "recovery", "job", nulls_last=True).select(
        "model", pl.col("config_label").alias("config"), "task", "metric", "filter",
        pl.when(pl.col("stderr").is_null())  # lm-eval gives some metrics no error
        .then(pl.col("value").round(4).cast(pl.String))
        .otherwise(pl.format("{} ± {}", pl.col("value").round(4), pl.col("stderr").round(4)))
        .alias("score"),
        pl.col("baseline_value").round(4).alias("baseline"),
        (pl.col("recovery") * 100).round(2).alias("recovery_%"),
        pl.col("runtime_baseline_value").round(4).alias("runtime_baseline"),
        (pl.col("runtime_recovery") * 100).round(2).alias("runtime_recovery_%"), "samples",
        "truncation", pl.col("recovery_reason").alias("note"), "job_id")
    not_scored = unscored.select("model", pl.col("config_label").alias("config"),
                                 pl.format("no task scores: {}", "tasks_error").alias("note"),
                                 "job_id")
    return pl.concat([not_scored, scored], how="diagonal_relaxed").select(scored.columns).sort(
        "model", maintain_order=True)
