"""When a difference between two runs is a verdict: beyond a practical tolerance and
significant after Holm's adjustment over every test of the comparison (so the error rate at
``ALPHA`` is family-wise, not per verdict). The gates of ``quantdask compare --fail-on`` apply
the same rule with their own tolerance (``gates``).

>>> Tolerance.parse("0.01").exceeds(0.02, base=0.5)
True
>>> Tolerance.parse("5%").exceeds(0.02, base=0.5)
False
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantdask.errors import CompareError

ALPHA = 0.05
"""The family-wise error rate of a comparison's verdicts (Holm over all its tests)."""

NO_DIFFERENCE = "no detectable difference"
NOT_TESTABLE = "not testable"
WORSE, BETTER = "worse", "better"

HIGHER_IS_WORSE = {"kl_divergence": True, "perplexity": True, "top1_agreement": False,
                   "decode_tokens_per_s": False, "peak_device_mem_bytes": True}
"""The direction of each non-task metric (a task metric's comes from lm-eval)."""


@dataclass(frozen=True)
class Tolerance:
    """A practical tolerance: ``amount`` of A's value (``relative``) or in the metric's unit."""

    amount: float
    relative: bool

    @classmethod
    def parse(cls, text: str) -> Tolerance:
        """``5%`` (relative) or ``0.01`` (absolute)."""
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE]-?\d+)?|\.\d+)\s*(%?)\s*", text)
        if match is None:
            raise CompareError(f"tolerance {text!r}: give a number, with % for a share of run "
                               "A's value (5%), without for an amount in the metric's unit")
        amount = float(match.group(1))
        return cls(amount / 100 if match.group(2) else amount, bool(match.group(2)))

    def exceeds(self, diff: float, base: float) -> bool:
        """Whether a difference ``diff`` from ``base`` (A's value) is beyond it."""
        return abs(diff) > (self.amount * abs(base) if self.relative else self.amount)

    def __str__(self) -> str:
        return f"{self.amount * 100:g}%" if self.relative else f"{self.amount:g}"


DEFAULT_TOLERANCES = {
    "kl_divergence": Tolerance(0.05, True), "perplexity": Tolerance(0.01, True),
    "top1_agreement": Tolerance(0.005, False), "task": Tolerance(0.01, False),
    "decode_tokens_per_s": Tolerance(0.10, True), "peak_device_mem_bytes": Tolerance(0.05, True),
}
"""What counts as a practical difference when the caller names none (``task``: every task
metric's, an absolute share of questions)."""


def tolerance_for(metric: str, tolerances: dict[str, Tolerance]) -> Tolerance:
    """The tolerance of ``metric`` (a task metric's own, else the ``task`` one)."""
    if metric in tolerances:
        return tolerances[metric]
    return tolerances.get(metric.split(":")[-1], tolerances["task"])


def verdict(diff: float, base: float, p_adjusted: float | None, tolerance: Tolerance,
            higher_is_worse: bool) -> str:
    """worse, better, no detectable difference (within the tolerance, or not significant), or
    not testable (no standard error: one window, one question)."""
    if p_adjusted is None:
        return NOT_TESTABLE
    if p_adjusted >= ALPHA or not tolerance.exceeds(diff, base):
        return NO_DIFFERENCE
    return WORSE if (diff > 0) == higher_is_worse else BETTER
