"""Gates (a sweep's ``gates:`` block): thresholds a quantized config must meet, for pipelines.

Each gate is ``"METRIC OP VALUE"`` (OP one of <=, >=, <, >), alone or in a mapping that narrows
it to one ``model`` and, for task metrics, one ``task`` and ``task_metric``::

    gates:
      - kl_divergence <= 0.05
      - top1_agreement >= 0.9
      - {gate: recovery >= 0.95, task: demo_facts, task_metric: acc}

METRIC is a quality or size column of the results (``GATE_METRICS``), or a task figure:
``recovery`` (the quantized score over the baseline's) or ``task_value`` (the score itself),
checked on every (task, metric) row the gate names. Gates apply to quantized configs, not to the
baseline they are measured against. A figure that was not measured fails its gate: a pipeline
must not pass a config on a number nobody took.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from quantdask.errors import SpecError
from quantdask.records import GateVerdict
from quantdask.sweepfile.fields import keyed, require
from quantdask.words import GateOperator

GATE_METRICS = ("perplexity", "ln_ppl_ratio", "kl_divergence", "kl_median", "kl_p90", "kl_p99",
                "kl_p999", "kl_max", "top1_agreement", "delta_p_mean", "delta_p_p01",
                "delta_p_p05", "bits_per_weight", "bits_per_quantized_weight", "size_bytes",
                "quantized_share", "peak_device_mem_bytes", "peak_host_rss_bytes", "wall_s")
"""Result columns a gate may test (tests/test_gates.py checks each is a numeric column)."""
TASK_METRICS = ("recovery", "task_value")
"""Task figures a gate may test, per (task, metric) row of the tasks frame."""

_OPS = {GateOperator.LE: operator.le, GateOperator.GE: operator.ge,
        GateOperator.LT: operator.lt, GateOperator.GT: operator.gt}
# The operators longest first (as GateOperator lists them), so that "<=" is not read as "<".
_EXPRESSION = re.compile(r"^\s*([A-Za-z_][\w]*)\s*(" + "|".join(map(re.escape, GateOperator))
                         + r")\s*(\S+)\s*$")


@dataclass(frozen=True)
class Gate:
    """One threshold: ``metric op threshold``, for ``model`` (None: every model) and, for a
    task metric, ``task`` and ``task_metric`` (None: every one)."""

    metric: str
    op: GateOperator
    threshold: float
    model: str | None = None
    task: str | None = None
    task_metric: str | None = None

    @property
    def label(self) -> str:
        """How reports and records name the gate."""
        where = [w for w in (self.task, self.task_metric) if w]
        scope = f" [{' '.join(where)}]" if where else ""
        model = f" (model {self.model})" if self.model else ""
        return f"{self.metric}{scope} {self.op} {self.threshold:g}{model}"

    @property
    def on_tasks(self) -> bool:
        return self.metric in TASK_METRICS

    def failures(self, record: dict[str, Any], task_rows: list[dict[str, Any]]) -> list[str]:
        """Why ``record`` (a done job's result, with its tasks frame rows) fails this gate:
        one line per figure that misses the threshold or was not measured; [] when it passes."""
        if self.model is not None and record.get("model") != self.model:
            return []
        if not self.on_tasks:
            return self._check(record.get(self.metric), self.metric)
        column = "recovery" if self.metric == "recovery" else "value"
        rows = [r for r in task_rows if (self.task is None or r["task"] == self.task)
                and (self.task_metric is None or r["metric"] == self.task_metric)]
        if not rows:
            return [f"{self.label}: no task rows measured"]
        # A null recovery carries its reason (the baseline's scoring failed, say): shown too.
        return [line for r in rows
                for line in self._check(r.get(column), f"{r['task']} {r['metric']}",
                                        r.get("recovery_reason") if column == "recovery"
                                        else None)]

    def _check(self, value: Any, what: str, why: str | None = None) -> list[str]:
        if value is None or value != value:  # None or NaN: not measured
            return [f"{self.label}: {what} was not measured" + (f" ({why})" if why else "")]
        if _OPS[self.op](value, self.threshold):
            return []
        return [f"{self.label}: {what} is {value:.4g}"]


def parse_gates(raw: Any, models: set[str], tasks: Sequence[str] | None) -> tuple[Gate, ...]:
    """The ``gates`` block as :class:`Gate` objects, each field checked (``models``: the model
    labels; ``tasks``: the task names, None without a tasks block). Errors name
    ``gates[i]`` for a string gate, ``gates[i].gate`` (or the key) for a mapping."""
    require("gates", raw, (list, tuple), "a list of gates such as 'kl_divergence <= 0.05'")
    gates = []
    for i, item in enumerate(raw):
        where = f"gates[{i}]"
        if isinstance(item, Gate):  # from Python: checked as its YAML form would be
            item = {"gate": f"{item.metric} {item.op} {item.threshold!r}", "model": item.model,
                    "task": item.task, "task_metric": item.task_metric}
            item = {k: v for k, v in item.items() if v is not None}
        fields = keyed(where, {"gate": item} if isinstance(item, str) else item,
                       ("gate", "model", "task", "task_metric"),
                       "'METRIC OP VALUE' or a mapping with gate and optionally model, task, "
                       "task_metric")
        gates.append(_gate(where if isinstance(item, str) else f"{where}.gate", fields,
                           models, tasks))
    return tuple(gates)


def _gate(where: str, fields: dict, models: set[str], tasks: Sequence[str] | None) -> Gate:
    scope = where.removesuffix(".gate")  # where model, task and task_metric live
    expression = fields.get("gate")
    found = _EXPRESSION.match(expression) if isinstance(expression, str) else None
    if found is None:
        raise SpecError(where, f"must read 'METRIC OP VALUE' (OP one of "
            f"{', '.join(GateOperator)}), such as 'kl_divergence <= 0.05', got {expression!r}")
    metric, op, text = found.groups()
    if metric not in GATE_METRICS + TASK_METRICS:
        raise SpecError(where, f"unknown gate metric {metric!r}; allowed: "
                               f"{', '.join(GATE_METRICS + TASK_METRICS)}")
    try:
        threshold = float(text)
    except ValueError:
        threshold = math.nan
    if not math.isfinite(threshold):
        raise SpecError(where, f"the threshold must be a finite number, got {text!r}")
    model, task = fields.get("model"), fields.get("task")
    if model is not None and model not in models:
        raise SpecError(f"{scope}.model", f"no model is named {model!r}; models: "
                                          f"{', '.join(sorted(models))}")
    if metric in TASK_METRICS and tasks is None:
        raise SpecError(where, f"{metric} is a task figure: add a tasks block "
                               "(tasks: {names: [...]}) or gate a results metric")
    if (task is not None or fields.get("task_metric") is not None) and metric not in TASK_METRICS:
        raise SpecError(f"{scope}.task", f"task and task_metric narrow a task figure "
                                         f"({', '.join(TASK_METRICS)}), not {metric}")
    if task is not None and task not in (tasks or ()):
        raise SpecError(f"{scope}.task", f"no task of the tasks block is named {task!r}; "
                                         f"tasks: {', '.join(tasks or ())}")
    task_metric = fields.get("task_metric")
    if task_metric is not None:
        require(f"{scope}.task_metric", task_metric, str, "a task metric name such as acc")
    return Gate(metric, GateOperator(op), threshold, model, task, task_metric)


def gate_columns(gates: tuple[Gate, ...], record: dict[str, Any],
                 task_rows: list[dict[str, Any]], is_baseline: bool) -> dict[str, Any]:
    """The results' gate columns of a done job's ``record`` (null without gates, and for the
    baseline they are measured against): ``gates_passed`` (all met), ``gates_met`` (their
    labels, one per line) and ``gates_failed`` (why each failing one failed, one per line)."""
    if not gates or is_baseline:
        return GateVerdict().columns()
    met, failed = [], []
    for gate in gates:
        reasons = gate.failures(record, task_rows)
        if reasons:
            failed.extend(reasons)
        else:
            met.append(gate.label)
    return GateVerdict(not failed, "\n".join(met), "\n".join(failed)).columns()
