"""Error bars and percentiles of the quality metrics, from their per-position values.

A job's eval scores ``samples`` windows of ``seq_len`` tokens; every position but the last of a
window predicts one token. Positions of one window share their context, so their errors are
correlated: the standard errors of the means (ln perplexity, KL, the change in the correct
token's probability, the paired ln PPL ratio) are taken over **windows** (the spread of the
window means over the square root of their number), which counts each window as one
independent draw of text. Top-1 agreement's is the binomial error over predicted tokens, as
llama.cpp reports it. Percentiles are over positions (numpy's linear interpolation).

Nothing here is a per-position array in the record: the record keeps the figures below only,
and the windows frame one row per window (:func:`window_rows`), which is what comparing two
configs on the same windows needs (the pairs share each window's difficulty).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from quantdask.records import Quality, WindowRow

if TYPE_CHECKING:
    import numpy as np

KL_PERCENTILES = {"kl_median": 50.0, "kl_p90": 90.0, "kl_p99": 99.0, "kl_p999": 99.9}
DELTA_P_PERCENTILES = {"delta_p_p01": 1.0, "delta_p_p05": 5.0, "delta_p_median": 50.0,
                       "delta_p_p95": 95.0, "delta_p_p99": 99.0}

QUALITY_COLUMNS = Quality.column_names()
"""The record's quality columns (:class:`~quantdask.records.Quality`)."""


def mean_and_window_se(values: np.ndarray) -> tuple[float, float | None]:
    """The mean of ``values`` (windows x positions) over every position, and its standard
    error over windows: the sample standard deviation of the window means over sqrt(windows).
    None with a single window (no spread to measure)."""
    import numpy as np

    windows = values.shape[0]
    mean = math.fsum(values.ravel().tolist()) / values.size
    if windows < 2:
        return mean, None
    means = np.array([math.fsum(row.tolist()) / row.size for row in values])
    centre = math.fsum(means.tolist()) / windows
    spread = math.fsum(((means - centre) ** 2).tolist()) / (windows - 1)
    return mean, math.sqrt(spread / windows)


def window_rows(nll: np.ndarray, kl: np.ndarray, agree: np.ndarray,
                delta_p: np.ndarray, token_hashes: list[str] | None = None) -> list[WindowRow]:
    """One row per window (windows x positions in): its tokens, mean negative log-likelihood,
    KL, top-1 agreement and change in the correct token's probability, and the hash of its
    token ids (``token_hashes``, one per window) when given."""
    return [WindowRow(window=w, tokens=int(nll.shape[1]),
                      ln_ppl=math.fsum(nll[w].tolist()) / nll.shape[1],
                      kl=math.fsum(kl[w].tolist()) / nll.shape[1],
                      top1_agreement=float(agree[w].sum()) / nll.shape[1],
                      delta_p=math.fsum(delta_p[w].tolist()) / nll.shape[1],
                      token_hash=token_hashes[w] if token_hashes is not None else None)
            for w in range(nll.shape[0])]


def token_hash(ids: np.ndarray) -> str:
    """A window's token ids as the windows frame's ``token_hash``: sha256 of them as
    little-endian int64, its first 16 hex digits."""
    import hashlib

    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes()).hexdigest()[:16]


def binomial_se(share: float, trials: int) -> float:
    """The standard error of a share measured over ``trials`` independent trials."""
    return math.sqrt(share * (1.0 - share) / trials)


def percentiles(values: np.ndarray, named: dict[str, float]) -> dict[str, float]:
    import numpy as np

    found = np.percentile(values.ravel(), list(named.values()))
    return {name: float(value) for name, value in zip(named, found)}


def quality_figures(nll: np.ndarray, kl: np.ndarray, agree: np.ndarray,
                    delta_p: np.ndarray | None, reference_nll: np.ndarray | None
                    ) -> Quality:
    """Every quality column of a record from the per-position values (windows x positions, in
    float64): the model's negative log-likelihood of the correct token, its KL from the
    reference, whether its top-1 token is the reference's, the change in the correct token's
    probability, and the reference's own negative log-likelihood (None: no reference figures
    to pair with, the columns that need them are None)."""
    tokens = nll.size
    ln_ppl, ln_ppl_se = mean_and_window_se(nll)
    kl_mean, kl_se = mean_and_window_se(kl)
    top1 = float(agree.sum()) / tokens
    figures: dict[str, Any] = {
        "perplexity": math.exp(ln_ppl), "ln_ppl_se": ln_ppl_se,
        "kl_divergence": max(kl_mean, 0.0), "kl_se": kl_se, **percentiles(kl, KL_PERCENTILES),
        "kl_max": float(kl.max()), "top1_agreement": top1,
        "top1_agreement_se": binomial_se(top1, tokens), "eval_tokens": tokens,
    }
    if delta_p is not None:
        mean, se = mean_and_window_se(delta_p)
        figures.update(delta_p_mean=mean, delta_p_se=se,
                       delta_p_rms=math.sqrt(math.fsum((delta_p ** 2).ravel().tolist())
                                             / tokens),
                       **percentiles(delta_p, DELTA_P_PERCENTILES))
    if reference_nll is not None:
        # Paired: the same tokens under both models, so what the two share (hard text) cancels.
        ratio, ratio_se = mean_and_window_se(nll - reference_nll)
        figures.update(ln_ppl_ratio=ratio, ln_ppl_ratio_se=ratio_se)
    columns: dict[str, Any] = {name: figures.get(name) for name in QUALITY_COLUMNS}
    return Quality(**columns)
