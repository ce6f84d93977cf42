"""The regression gates of ``quantdask compare --fail-on``: their grammar, and which jobs fail
them.

Grammar: ``METRIC worse by N%`` (relative to run A's value) or ``METRIC worse by X`` (an
absolute amount, in the metric's unit: nats, a share, tokens/s, bytes), METRIC one of
``kl_divergence``, ``perplexity``, ``top1_agreement``, a task metric (``acc``, ``acc_norm``,
``exact_match``... any task's; ``TASK:METRIC`` for one task's), ``decode_tokens_per_s`` or
``peak_device_mem_bytes``. A gate fails where its metric is worse by more than its amount and
the difference is significant (the comparison's Holm-adjusted p; speed: beyond both runs'
spread; memory: on GPUs, peaks not shared), exactly the verdict rule with the gate's tolerance.

>>> gate = parse_gate("kl_divergence worse by 5%")
>>> gate.metric, gate.tolerance
('kl_divergence', Tolerance(amount=0.05, relative=True))
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quantdask.comparison.resources import memory_verdict, speed_verdict
from quantdask.comparison.verdicts import HIGHER_IS_WORSE, WORSE, Tolerance, verdict
from quantdask.errors import CompareError

if TYPE_CHECKING:
    from quantdask.comparison.compare import Comparison


@dataclass(frozen=True)
class Gate:
    """One ``--fail-on`` gate: fails when ``metric`` is worse by more than ``tolerance`` and
    the difference is significant."""

    text: str
    metric: str
    tolerance: Tolerance

    def applies_to(self, metric: str, task: str | None = None) -> bool:
        """Whether a row of ``metric`` (of ``task``, for a task metric) is this gate's."""
        return self.metric in (metric, f"{task}:{metric}")


_GATE = re.compile(r"\s*([A-Za-z_][\w.:/-]*)\s+worse\s+by\s+(\S+)\s*")


def parse_gate(text: str) -> Gate:
    """A gate from its text (the module's grammar), or a :class:`CompareError` naming it."""
    match = _GATE.fullmatch(text)
    if match is None:
        raise CompareError(f"--fail-on {text!r}: write METRIC worse by N% (relative to run A) "
                           "or METRIC worse by X (absolute), e.g. 'kl_divergence worse by 5%'")
    try:
        tolerance = Tolerance.parse(match.group(2))
    except CompareError as bad:
        raise CompareError(f"--fail-on {text!r}: {bad}") from None
    return Gate(text.strip(), match.group(1), tolerance)


def failed_gates(comparison: Comparison, gates: list[Gate]) -> list[str]:
    """One line per (gate, job) that failed. Raises :class:`CompareError` for a gate naming a
    metric this comparison has no comparable figure of (a speed gate on runs without a speed
    block, a memory gate on CPU slots)."""
    known = set(comparison.quality["metric"]) | set(comparison.tasks["metric"]) | {
        f"{t}:{m}" for t, m in comparison.tasks.select("task", "metric").iter_rows()}
    # speed and memory gates need figures that compare: timings that held their device alone,
    # peaks on GPUs (a CPU slot's is its process's RSS)
    if comparison.speed["testable"].any():
        known.add("decode_tokens_per_s")
    if comparison.memory["testable"].any():
        known.add("peak_device_mem_bytes")
    failures = []
    for gate in gates:
        if gate.metric not in known:
            raise CompareError(f"--fail-on {gate.text!r}: no comparable figure of "
                               f"{gate.metric!r} in both runs (speed: timings that held "
                               "their device alone; memory: peaks on GPUs); their metrics: "
                               f"{', '.join(sorted(known))}")
        failures += [f"{gate.text}: {line}" for line in _failures(comparison, gate)]
    return failures


def _failures(comparison: Comparison, gate: Gate) -> list[str]:
    tests = [(row, None, HIGHER_IS_WORSE[row["metric"]])
             for row in comparison.quality.iter_rows(named=True)]
    tests += [(row, row["task"], row["higher_is_better"] is False)
              for row in comparison.tasks.iter_rows(named=True)]
    lines = []
    for row, task, worse_up in tests:
        if not gate.applies_to(row["metric"], task) or verdict(
                row["diff"], row["a"], row["p_adjusted"], gate.tolerance, worse_up) != WORSE:
            continue
        lines.append(f"{row['model']}/{row['config_label']}{f' {task}' if task else ''}: "
                     f"{row['metric']} {row['a']:.6g} -> {row['b']:.6g} "
                     f"({_change(row['diff'], row['a'])}, adjusted p {row['p_adjusted']:.2g})")
    if gate.metric == "decode_tokens_per_s":
        lines += [f"{r['model']}/{r['config_label']} batch {r['batch_size']}: decode "
                  f"{r['decode_tokens_per_s_a']:.4g} -> {r['decode_tokens_per_s_b']:.4g} "
                  f"tokens/s, median step {r['decode_s_p50_a']:.4g} s (p90 "
                  f"{r['decode_s_p90_a']:.4g}) -> {r['decode_s_p50_b']:.4g} s"
                  for r in comparison.speed.iter_rows(named=True)
                  if speed_verdict(r, gate.tolerance) == WORSE]
    if gate.metric == "peak_device_mem_bytes":
        for r in comparison.memory.iter_rows(named=True):
            if memory_verdict(r, gate.tolerance) == WORSE:
                a, b = r["peak_device_mem_bytes_a"], r["peak_device_mem_bytes_b"]
                lines.append(f"{r['model']}/{r['config_label']}: peak device memory {a} -> "
                             f"{b} bytes ({_change(b - a, a)})")
    return lines


def _change(diff: float, base: float) -> str:
    return f"{diff:+.3g}" + (f", {diff / base:+.1%}" if base else "")
