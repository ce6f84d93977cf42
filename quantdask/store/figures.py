"""Quality figures as people read them: each value with its error, a bound marked as a bound.

>>> with_error(0.005934, 0.000121)
'0.00593 ± 0.00012'
>>> kl_text(0.000114, None, "lower_bound", 0.992)
'≥ 0.000114 (tail 99%)'
"""

from __future__ import annotations

import math

import polars as pl

from quantdask.words import KLKind, Status


def with_error(value: float | None, se: float | None) -> str | None:
    """``value ± se``, both to the second significant digit of ``se`` (the value alone to 4
    significant digits without an error)."""
    if value is None:
        return None
    if se is None or not math.isfinite(se):
        return f"{value:.4g}"
    if se == 0:
        return f"{value:.4g} ± 0"
    digits = max(0, 1 - math.floor(math.log10(se)))
    return f"{value:.{digits}f} ± {se:.{digits}f}"


def kl_text(kl: float | None, se: float | None, kind: str | None,
            tail_mass: float | None) -> str | None:
    """The KL as the terminal and the report show it: ``≥ x (tail y%)`` for a lower bound,
    else with its error."""
    if kl is None:
        return None
    if kind == KLKind.LOWER_BOUND:
        return f"≥ {kl:.3g} (tail {tail_mass or 0:.0%})"
    return with_error(kl, se)


def perplexity_text(perplexity: float | None, ln_ppl_se: float | None) -> str | None:
    """Perplexity with its error (from ln PPL's: PPL x se, to first order)."""
    if perplexity is None:
        return None
    return with_error(perplexity, None if ln_ppl_se is None else perplexity * ln_ppl_se)


def with_quality_text(results: pl.DataFrame) -> pl.DataFrame:
    """``results`` with the text columns ``ppl``, ``kl``, ``top1``, ``vs_baseline`` (ln of
    the perplexity ratio to the baseline's, with its paired error) and ``delta_p``: each figure
    with its error, a lower-bound KL marked so (null for jobs without figures)."""
    rows = results.select("perplexity", "ln_ppl_se", "kl_divergence", "kl_se", "kl_kind",
                          "kl_tail_mass", "top1_agreement", "top1_agreement_se",
                          "ln_ppl_ratio", "ln_ppl_ratio_se", "delta_p_mean", "delta_p_se").rows()
    return results.with_columns(
        pl.Series("ppl", [perplexity_text(r[0], r[1]) for r in rows], dtype=pl.String),
        pl.Series("kl", [kl_text(r[2], r[3], r[4], r[5]) for r in rows], dtype=pl.String),
        pl.Series("top1", [with_error(r[6], r[7]) for r in rows], dtype=pl.String),
        pl.Series("vs_baseline", [with_error(r[8], r[9]) for r in rows], dtype=pl.String),
        pl.Series("delta_p", [with_error(r[10], r[11]) for r in rows], dtype=pl.String))


def bos_text(bos_token_id: int | None) -> str:
    """How windows whose first token is ``bos_token_id`` (None: the text as tokenized) begin."""
    if bos_token_id is None:
        return "the text cut as tokenized, no BOS per window"
    return f"a BOS (token {bos_token_id}) at the start of every window, the text after it"


def window_protocol(results: pl.DataFrame) -> list[str]:
    """How each model's eval windows began (``eval_bos_token_id`` of its done jobs), one line
    per model: figures measured under two protocols are never read side by side unawares."""
    if results.is_empty() or "eval_bos_token_id" not in results.columns:
        return []
    done = results.filter(pl.col("status") == Status.DONE)
    lines = []
    for model, ids in sorted(done.group_by("model").agg(pl.col("eval_bos_token_id").unique())
                             .rows()):
        said = [bos_text(i) for i in sorted(ids, key=lambda i: -1 if i is None else i)]
        lines.append(f"{model}: " + "; and in other jobs, ".join(said))
    return lines


def with_job_label(frame: pl.DataFrame) -> pl.DataFrame:
    """``frame`` with a ``job`` column naming each job: its config label, prefixed by the model
    when the frame holds several (every model has a ``baseline``)."""
    if frame["model"].n_unique() > 1:
        return frame.with_columns(
            pl.concat_str("model", pl.lit(" · "), "config_label").alias("job"))
    return frame.with_columns(pl.col("config_label").alias("job"))
