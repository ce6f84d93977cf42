"""The closing summary of a finished run, in plain text (:func:`print_summary`, with the exit
code it calls for): each search's answer, every job's figures, the task accuracy and gates the
report's recovery table and gates banner show (``report.tasks``: the same functions, so the
same numbers), each search's predictions against its measurements.

>>> print("\\n".join(task_lines(results, read_tasks(run_dir))))  # doctest: +SKIP
task accuracy (score ± standard error; recovery = the share of the baseline's score kept):
model  config  task        metric  score            baseline  recovery  samples  note
demo   nf4     demo_facts  acc     0.4167 ± 0.1028  0.4583    90.9%     24       -
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from quantdask.cli.exits import EXIT_FAILED_JOBS, EXIT_GATE_FAILED
from quantdask.cli.render import table
from quantdask.store.run_store import RunStore
from quantdask.words import BASELINE, NO_FILTER, Status

if TYPE_CHECKING:
    import polars as pl

TASK_COLUMNS = ["model", "config", "task", "metric", "score", "baseline", "recovery", "samples",
                "note"]


def _one_line(text: str | None) -> str | None:
    return re.sub(r"\s+", " ", text).strip() if text else None


def task_lines(results: pl.DataFrame, tasks: pl.DataFrame) -> list[str]:
    """Each done config's task scores, one line per (task, metric): score ± standard error,
    the baseline's score and the recovery, as the report's recovery table has them, with why
    a recovery is missing or a job has no scores (the note); [] without task scores."""
    from quantdask.report.tasks import recovery_table

    recovery = recovery_table(results, tasks)
    if recovery.is_empty():
        return []
    rows: list[dict[str, Any]] = []
    for row in recovery.to_dicts():
        metric = row.get("metric")
        if metric is not None and row.get("filter") not in (None, NO_FILTER):
            metric = f"{metric} · {row['filter']}"
        cut = row.get("truncation") if (row.get("truncation") or "").startswith("TRUNC") else None
        share = row.get("recovery_%")
        base = row.get("baseline")  # written as the score is (both rounded to 4 places)
        rows.append({**row, "metric": metric, "baseline": None if base is None else str(base),
                     "recovery": None if share is None else f"{share:.1f}%",
                     "note": "; ".join(n for n in (cut, _one_line(row.get("note"))) if n) or None})
    return ["task accuracy (score ± standard error; recovery = the share of the baseline's "
            "score kept):", table(rows, TASK_COLUMNS)]


def gate_lines(results: pl.DataFrame) -> list[str]:
    """The gates' verdict over the done quantized configs, as the report's banner gives it:
    how many passed them all, and per gate how many met it and how many failed it ([] when
    the sweep set no gates). Which config failed and why follows (``gate failed:`` lines)."""
    import polars as pl

    judged = results.filter((pl.col("status") == Status.DONE)
                            & pl.col("gates_passed").is_not_null()).to_dicts()
    if not judged:
        return []
    met: dict[str, int] = {}
    failed: dict[str, int] = {}
    for row in judged:
        for label in (row["gates_met"] or "").splitlines():
            met[label] = met.get(label, 0) + 1
        # Each failing figure is a line "<gate label>: <why>"; a config counts once per gate.
        for label in {line.split(": ", 1)[0] for line in (row["gates_failed"] or "").splitlines()}:
            failed[label] = failed.get(label, 0) + 1
    passing = sum(bool(row["gates_passed"]) for row in judged)
    n = len(judged)
    verdict = (f"gates: passed: all {n} quantized configs meet every gate" if passing == n
               else f"gates: FAILED: {n - passing} of {n} quantized configs fail a gate "
                    f"({passing} pass them all)")
    gates = sorted(set(met) | set(failed), key=lambda g: (-failed.get(g, 0), g))
    rows = [{"gate": gate, "met_by": f"{met.get(gate, 0)} of {n}",
             "failed_by": f"{failed[gate]} of {n}" if gate in failed else "-"} for gate in gates]
    return [verdict, *("  " + line for line in table(rows, ["gate", "met_by", "failed_by"])
                       .splitlines())]


def answer_lines(run_dir, results: pl.DataFrame) -> list[str]:
    """Each search's answer (``search.answer``): the mix to ship at each budget, beside the
    uniform format within it and the two at equal bytes, and its file; [] without a search."""
    from quantdask.search import answer
    from quantdask.store.run_store import read_frame

    found = answer.search_answers(results, read_frame(run_dir, "allocation"), run_dir)
    return answer.answer_lines(found)


def search_lines(results: pl.DataFrame) -> list[str]:
    """Each search's predicted against measured KL (``search.agreement``), a line each."""
    from quantdask.search.agreement import agreement_line, prediction_agreement

    return [agreement_line(row) for row in prediction_agreement(results).to_dicts()]


def print_gate_failures(results) -> int:
    """Print the gates' verdict (``cli.summary.gate_lines``) and each done job that failed a
    gate, with why; return the exit code it calls for."""
    import polars as pl

    for line in gate_lines(results):
        print(line)
    failing = results.filter(pl.col("gates_passed").eq(False)).to_dicts()
    for row in failing:
        reasons = "; ".join((row["gates_failed"] or "").splitlines())
        print(f"gate failed: {row['job_id']} {row['model']} {row['config_label']}: {reasons}")
    if failing:
        print(f"{len(failing)} done jobs failed a gate (exit {EXIT_GATE_FAILED})")
    return EXIT_GATE_FAILED if failing else 0




def print_summary(run_dir, results) -> int:
    """The terminal summary of a finished run: each search's answer, every job's figures, the
    protocol, the tasks, the counts, where the results and logs are, each job not done; the
    exit code."""
    import polars as pl

    from quantdask.store.figures import with_quality_text
    from quantdask.store.readers import read_attempts

    for line in answer_lines(run_dir, results):  # the answer first, then the long tables
        print(line)
    rows = with_quality_text(results).sort(
        pl.col("model"), pl.col("backend") != BASELINE, pl.col("bits_per_weight"),
        pl.col("config_label"), descending=[False, False, True, False], nulls_last=True)
    # Each quality figure with its standard error; a KL that is only a bound says so.
    print(table(rows.to_dicts(), ["model", "config_label", "status", "attempts", "worker",
                                   "bits_per_weight", "quantized_share", "ppl", "vs_baseline",
                                   "kl", "top1", "wall_s"]))
    print_protocol(results)
    _print_tasks(run_dir, results)
    counts = {s: results.filter(pl.col("status") == s).height for s in Status}
    attempts = read_attempts(run_dir).filter(pl.col("job_id").is_in(results["job_id"].to_list()))
    retried = attempts.filter(pl.col("status") == Status.FAILED).height
    print(f"{results.height} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + f" ({retried} failed attempts in this run directory)")
    for excluded in RunStore(run_dir).read_excluded_workers():
        print(f"worker {excluded['worker']} taken out of rotation: {excluded['reason']}")
    store = RunStore(run_dir)
    print(f"results: {store.results_dir}  (python: quantdask.read_results({run_dir!r}))")
    print(f"logs: {store.logs_dir}")
    for row in results.filter(pl.col("status") != Status.DONE).to_dicts():
        log_path = store.job_log_path(row["job_id"])
        message = (row["error_message"] or "").splitlines()[0] if row["error_message"] else ""
        print(f"{row['status']}: {row['job_id']} {row['config_label']} ({row['failure_class']}): "
              f"{row['error_class']}: {message} (log: {log_path})")
    gated = print_gate_failures(results)
    if counts[Status.FAILED]:
        print(f"{counts[Status.FAILED]} jobs failed; their logs are in {store.job_logs_dir}")
        return EXIT_FAILED_JOBS
    return gated


def print_protocol(results) -> None:
    """How each model's eval windows began (eval.bos): the figures' protocol."""
    from quantdask.store.figures import window_protocol

    for line in window_protocol(results):
        print(f"eval windows of {line}")


def _print_tasks(run_dir: str, results) -> None:
    """The task accuracy of this sweep's jobs, as the report's recovery table gives it, and
    how well each search's predictions held."""
    import polars as pl

    from quantdask.store.readers import read_tasks

    tasks = read_tasks(run_dir).filter(pl.col("job_id").is_in(results["job_id"].to_list()))
    for line in [*task_lines(results, tasks), *search_lines(results)]:
        print(line)
