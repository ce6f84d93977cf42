"""The paired tests ``quantdask compare`` decides with: a paired t-test over shared windows,
McNemar's exact test over questions, a paired bootstrap for non-binary per-question scores,
an unpaired test from two standard errors, and Holm's step-down over a comparison's verdicts.

Each returns a :class:`Difference`: B minus A, its standard error and a two-sided p-value.

>>> paired_difference([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
Difference(diff=0.0, se=0.0, p=1.0, n=3)
>>> mcnemar(flipped_to_wrong=0, flipped_to_right=6, n=20).p
0.03125
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 20261206


@dataclass(frozen=True)
class Difference:
    """B minus A: ``diff``, its standard error ``se`` (None: not estimable, one pair) and the
    two-sided ``p`` of no difference (None with ``se``), over ``n`` pairs (or items)."""

    diff: float
    se: float | None
    p: float | None
    n: int


def _scipy_stats():
    from quantdask.comparison.runs import need_scipy

    return need_scipy()


def paired_difference(a: Sequence[float], b: Sequence[float]) -> Difference:
    """The mean of ``b - a`` over pairs, its standard error (sample sd / sqrt n) and the
    paired t-test's two-sided p (n - 1 degrees of freedom). Identical pairs: 0, 0, p 1; a
    constant non-zero shift: se 0, p 0."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    n = int(d.size)
    if n == 0:
        raise ValueError("no pairs to compare")
    mean = math.fsum(d.tolist()) / n
    if n == 1:
        return Difference(mean, None, None, 1)
    se = float(np.std(d, ddof=1)) / math.sqrt(n)
    if se == 0.0:
        return Difference(mean, 0.0, 1.0 if mean == 0.0 else 0.0, n)
    t = abs(mean) / se
    return Difference(mean, se, float(2.0 * _scipy_stats().t.sf(t, n - 1)), n)


def unpaired_difference(a: float, se_a: float | None, b: float, se_b: float | None,
                        n: int) -> Difference:
    """``b - a`` of two independent estimates with their standard errors; p from the normal
    distribution (no se on either side: not estimable)."""
    if se_a is None or se_b is None or not (math.isfinite(se_a) and math.isfinite(se_b)):
        return Difference(b - a, None, None, n)
    se = math.hypot(se_a, se_b)
    if se == 0.0:
        return Difference(b - a, 0.0, 1.0 if b == a else 0.0, n)
    return Difference(b - a, se, float(2.0 * _scipy_stats().norm.sf(abs(b - a) / se)), n)


def mcnemar(flipped_to_wrong: int, flipped_to_right: int, n: int) -> Difference:
    """McNemar's exact test over ``n`` paired binary outcomes, ``flipped_to_wrong`` right in A
    and wrong in B, ``flipped_to_right`` the other way: the binomial test of the discordant
    pairs at one half (``scipy.stats.binomtest``'s two-sided p); diff is B's accuracy minus
    A's, its se the paired one."""
    discordant = flipped_to_wrong + flipped_to_right
    diff = (flipped_to_right - flipped_to_wrong) / n
    # the per-question differences are +1, -1 or 0: their sample variance, over n
    se = (math.sqrt(max(discordant / n - diff * diff, 0.0) * n / (n - 1) / n)
          if n > 1 else None)
    if discordant == 0:
        return Difference(0.0, se, 1.0, n)
    test = _scipy_stats().binomtest(flipped_to_right, discordant, 0.5)
    return Difference(diff, se, float(test.pvalue), n)


def paired_bootstrap(a: Sequence[float], b: Sequence[float],
                     resamples: int = BOOTSTRAP_RESAMPLES,
                     seed: int = BOOTSTRAP_SEED) -> Difference:
    """The mean of ``b - a`` over items, its bootstrap standard error, and the two-sided p of
    the differences resampled around zero (seeded: the same data give the same p)."""
    d = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    n = int(d.size)
    mean = float(d.mean())
    if n < 2 or np.all(d == d[0]):
        return paired_difference(a, b)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    se = float(means.std(ddof=1))
    centred = np.abs(means - mean)
    p = float((1 + np.count_nonzero(centred >= abs(mean))) / (resamples + 1))
    return Difference(mean, se, p, n)


def holm(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values (None, or a non-finite p, gives None): rejecting
    where an adjusted p is under alpha keeps the family-wise error rate at alpha over all of
    them."""
    indexed = sorted((p, i) for i, p in enumerate(p_values)
                     if p is not None and math.isfinite(p))
    m = len(indexed)
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(indexed):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted
