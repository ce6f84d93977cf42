"""The Pareto frontier of size against quality, with ties: configs whose quality differs by
less than its noise are not ranked (docs/quality.md, Error bars).

A tie is decided per pair of configs of one model from the standard error of their difference:
paired over the eval windows both were measured on (the windows frame) when it is given, else
from each config's own standard error.
"""

from __future__ import annotations

import math

import polars as pl

from quantdask.measure.statistics import mean_and_window_se
from quantdask.words import Status

TIE_SIGMAS = 2.0
"""Two configs are tied on a metric when they differ by less than this many standard errors of
their difference (docs/quality.md, Ties)."""

WINDOW_COLUMNS = {"kl_divergence": "kl", "top1_agreement": "top1_agreement",
                  "delta_p_mean": "delta_p", "ln_ppl_ratio": "ln_ppl"}
"""The windows frame's column of each metric (its per-window means)."""

STANDARD_ERRORS = {"kl_divergence": "kl_se", "top1_agreement": "top1_agreement_se",
                   "ln_ppl_ratio": "ln_ppl_ratio_se", "delta_p_mean": "delta_p_se"}
"""The column holding each metric's standard error."""


class TieMargins:
    """How far apart two jobs' ``loss`` must be to differ: ``TIE_SIGMAS`` standard errors of
    their difference. With the jobs' per-window values (``windows``, the windows frame) the
    error is the paired one, over the windows both were measured on: what makes a window
    hard for both cancels. Without, sqrt(se_a^2 + se_b^2) from the results' standard errors,
    which ignores that they share their windows (so it calls more ties); without those either,
    0: every difference counts."""

    def __init__(self, results: pl.DataFrame, loss: str, loss_se: str | None = None,
                 windows: pl.DataFrame | None = None):
        name = loss_se or STANDARD_ERRORS.get(loss, f"{loss}_se")
        self.se = name if name in results.columns else None
        column = WINDOW_COLUMNS.get(loss)
        self.by_window: dict[str, dict[int, float]] = {}
        if windows is not None and column is not None and not windows.is_empty():
            for job_id, window, value in windows.select("job_id", "window", column).rows():
                self.by_window.setdefault(job_id, {})[window] = value

    def __call__(self, a: dict, b: dict) -> float:
        """The margin between two rows of the results."""
        paired = self._paired_se(a.get("job_id"), b.get("job_id"))
        if paired is not None:
            return TIE_SIGMAS * paired
        if self.se is None:
            return 0.0
        return TIE_SIGMAS * math.sqrt((a[self.se] or 0.0) ** 2 + (b[self.se] or 0.0) ** 2)

    def _paired_se(self, a: str | None, b: str | None) -> float | None:
        import numpy as np

        if a is None or b is None:
            return None
        first, second = self.by_window.get(a), self.by_window.get(b)
        if not first or not second or first.keys() != second.keys():
            return None
        differences = np.array([[first[w] - second[w]] for w in first])  # windows x 1
        return mean_and_window_se(differences)[1]


SIZE_BITS = "size_bits"
"""The size configs are compared on: the whole model's bits per weight as stored (8 x
``size_bytes`` / ``param_count``: the file a user ships, its embeddings and head included), so
the frontier and "which config to ship" rank by the bytes that ship. A config that leaves a
large embedding in bfloat16 is larger there than its bits per quantized weight say (nf4 of a
1.5B model with a 151,936-token vocabulary: 4.5 bits per quantized weight, a 1.6 GiB file,
beside a 1.0 GiB Q4_K_M file at 5.0); bits per quantized weight stay beside it, a second view."""


def with_size_bits(results: pl.DataFrame) -> pl.DataFrame:
    """``results`` with the ``SIZE_BITS`` column (frames without a whole-model figure: bits
    per quantized weight)."""
    sizes = [c for c in ("bits_per_weight", "bits_per_quantized_weight") if c in results.columns]
    return results.with_columns(pl.coalesce(sizes).alias(SIZE_BITS))


def pareto_frontier(results: pl.DataFrame, cost: str = SIZE_BITS,
                    loss: str = "kl_divergence", loss_se: str | None = None,
                    windows: pl.DataFrame | None = None) -> pl.DataFrame:
    """``results`` (done jobs) with a ``pareto`` column and ``tied_with`` (the configs of the
    same model tied with each on ``loss``, comma-separated, or null).

    A job is on the frontier unless another job of the same model is at most as large
    (``cost``: by default the whole model's bits as stored, ``SIZE_BITS``) and significantly better
    (``loss`` lower by more than their tie margin, see :class:`TieMargins`: paired over
    ``windows`` when given), or smaller and not significantly worse: tied configs are not
    ranked, so a larger config is on the frontier only when it beats every smaller one by
    more than the noise.

    >>> frame = pl.DataFrame({"model": ["m"] * 3, "status": ["done"] * 3,
    ...     "config_label": ["a", "b", "c"], "bits_per_quantized_weight": [4.0, 4.5, 8.0],
    ...     "bits_per_weight": [9.0, 9.5, 12.0],
    ...     "kl_divergence": [0.010, 0.009, 0.001], "kl_se": [0.001] * 3})
    >>> pareto_frontier(frame)["pareto"].to_list()  # b ties a and is larger: not on it
    [True, False, True]
    """
    if cost == SIZE_BITS and SIZE_BITS not in results.columns:
        results = with_size_bits(results)
    done = results.filter((pl.col("status") == Status.DONE) & pl.col(cost).is_not_null()
                          & pl.col(loss).is_not_null())
    margin = TieMargins(done, loss, loss_se, windows)
    rows = done.to_dicts()
    frontier, tied = [], []
    for a in rows:
        others = [(b, margin(a, b)) for b in rows
                  if b is not a and b["model"] == a["model"]]
        frontier.append(not any(
            (b[cost] <= a[cost] and b[loss] < a[loss] - m)
            or (b[cost] < a[cost] and b[loss] <= a[loss] + m) for b, m in others))
        ties = [b["config_label"] for b, m in others if abs(b[loss] - a[loss]) < m]
        tied.append(", ".join(ties) if ties else None)
    return done.with_columns(pl.Series("pareto", frontier, dtype=pl.Boolean),
                             pl.Series("tied_with", tied, dtype=pl.String))


def kl_ties(results: pl.DataFrame, windows: pl.DataFrame | None = None,
            loss: str = "kl_divergence", loss_se: str | None = None) -> pl.DataFrame:
    """The pairs of done configs of one model whose ``loss`` differ by less than their tie
    margin (:class:`TieMargins`, paired over ``windows`` when given): one row per pair
    (model, the two configs, their difference and the margin)."""
    done = results.filter((pl.col("status") == Status.DONE) & pl.col(loss).is_not_null())
    margin = TieMargins(done, loss, loss_se, windows)
    rows = done.sort("model", loss).to_dicts()
    pairs = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if a["model"] != b["model"]:
                continue
            m = margin(a, b)
            if abs(b[loss] - a[loss]) < m:
                pairs.append({"model": a["model"], "config": a["config_label"],
                              "tied_with": b["config_label"], "difference": b[loss] - a[loss],
                              "margin": m})
    return pl.DataFrame(pairs, schema={"model": pl.String, "config": pl.String,
                                       "tied_with": pl.String, "difference": pl.Float64,
                                       "margin": pl.Float64})
