"""The report's mixed-precision searches: how sensitive each unit is by depth and format, the
frontier (what the probes predict against what the jobs measured, mixed beside uniform) and
predicted against measured KL.

>>> frames = read_frames("runs/mix")  # doctest: +SKIP
>>> search_frontier_chart(frames["results"], frames["allocation"])  # doctest: +SKIP
"""

from __future__ import annotations

import altair as alt
import polars as pl

from quantdask.report.charts import JOB_TOOLTIP, _empty
from quantdask.search.agreement import agreement_line, prediction_agreement
from quantdask.search.answer import answer_lines
from quantdask.words import Status

NO_SEARCH = "no search in this run (a sweep's searches: block adds one)"


def _searched(results: pl.DataFrame) -> pl.DataFrame:
    """The done jobs a search made, with their KL's error bar (one standard error)."""
    done = results.filter((pl.col("status") == Status.DONE) & pl.col("search").is_not_null())
    se = pl.col("kl_se").fill_null(0.0)
    return done.with_columns((pl.col("kl_divergence") - se).alias("kl_low"),
                             (pl.col("kl_divergence") + se).alias("kl_high"))


def sensitivity_chart(sensitivity: pl.DataFrame) -> alt.Chart | alt.VConcatChart:
    """Each unit's KL alone in each format (log scale) by decoder layer, one panel per
    search: the fragile units stand out at the top."""
    cells = sensitivity.filter((pl.col("layer") >= 0) & (pl.col("kl") > 0))
    if cells.is_empty():
        return _empty(NO_SEARCH)
    cells = cells.with_columns(pl.col("unit").str.extract(r"([^.]+)$").alias("module"))
    tooltip = ["unit:N", "format:N", alt.Tooltip("kl:Q", format=".3g", title="KL alone"),
               alt.Tooltip("kl_se:Q", format=".2g", title="standard error"),
               alt.Tooltip("bytes:Q", format=","), alt.Tooltip("worker:N")]
    panels = [alt.Chart(part).mark_point(filled=True, size=60).encode(
        x=alt.X("layer:O", title="decoder layer"),
        y=alt.Y("kl:Q", scale=alt.Scale(type="log"), title="KL added alone (nats/token)"),
        color=alt.Color("format:N"), shape=alt.Shape("module:N"),
        tooltip=tooltip).properties(width=420, height=260, title=f"search {search}")
        for (search,), part in cells.group_by("search", maintain_order=True)]
    return alt.vconcat(*panels).properties(title="Sensitivity by depth and format")


def refinement_chart(refinement: pl.DataFrame) -> alt.Chart | alt.VConcatChart:
    """Per refined search: each scored mix's KL on the refinement windows by generation
    (points, with error bars), and the best so far (the line): the fitness per generation."""
    if refinement.is_empty():
        return _empty("no refinement in this run (a search's refine: block adds one)")
    scored = refinement.with_columns((pl.col("kl") - pl.col("kl_se")).alias("kl_low"),
                                     (pl.col("kl") + pl.col("kl_se")).alias("kl_high"))
    panels = []
    for (search,), part in scored.group_by("search", maintain_order=True):
        best = (part.group_by("generation").agg(pl.col("kl").min()).sort("generation")
                .with_columns(pl.col("kl").cum_min().alias("best")))
        base = alt.Chart(part).encode(x=alt.X("generation:O", title="generation"))
        tooltip = ["generation:Q", "candidate:Q", alt.Tooltip("kl:Q", format=".4g"),
                   alt.Tooltip("kl_se:Q", format=".2g", title="standard error"),
                   alt.Tooltip("kl_vs_parent:Q", format="+.3g", title="against its parent"),
                   alt.Tooltip("bytes:Q", format=","), "measured_in:N", "worker:N"]
        bars = base.mark_rule(opacity=0.4).encode(y="kl_low:Q", y2="kl_high:Q")
        points = base.mark_point(filled=True, size=50).encode(
            y=alt.Y("kl:Q", title="KL on the refinement windows"), tooltip=tooltip)
        line = alt.Chart(best).mark_line(color="black").encode(x="generation:O", y="best:Q")
        panels.append(alt.layer(bars, points, line).properties(
            width=420, height=240, title=f"search {search}: whole mixes scored, best so far"))
    return alt.vconcat(*panels).properties(title="Refinement: fitness per generation")


def search_frontier_chart(results: pl.DataFrame, allocation: pl.DataFrame
                          ) -> alt.Chart | alt.VConcatChart:
    """Per search: KL against bits per weight; the probes' prediction for each verified
    allocation as a line, and what each job measured (mixed and uniform) with its error bar."""
    jobs = _searched(results)
    if jobs.is_empty():
        return _empty(NO_SEARCH)
    tooltip = [*JOB_TOOLTIP, "search_role:N", alt.Tooltip("bits_per_weight:Q", format=".3f"),
               alt.Tooltip("predicted_kl:Q", format=".3g", title="predicted KL"),
               alt.Tooltip("kl_divergence:Q", format=".3g", title="measured KL"),
               alt.Tooltip("kl_se:Q", format=".2g", title="standard error")]
    panels = []
    for (search,), part in jobs.group_by("search", maintain_order=True):
        predicted = part.with_columns(  # the predicted bytes in bits per weight
            (pl.col("predicted_bytes") * pl.col("bits_per_weight") / pl.col("size_bytes"))
            .alias("predicted_bits")).sort("predicted_bits")
        line = alt.Chart(predicted).mark_line(color="gray", strokeDash=[5, 3], point=True).encode(
            x="predicted_bits:Q", y="predicted_kl:Q", tooltip=tooltip)
        base = alt.Chart(part).encode(
            x=alt.X("bits_per_weight:Q", title="bits per weight (whole model, as stored)",
                    scale=alt.Scale(zero=False, padding=12)))
        bars = base.mark_rule().encode(y="kl_low:Q", y2="kl_high:Q", color="search_role:N")
        points = base.mark_point(filled=True, size=90).encode(
            y=alt.Y("kl_divergence:Q", title="KL divergence (nats/token)",
                    scale=alt.Scale(type="log")),
            color=alt.Color("search_role:N", title="role"), tooltip=tooltip)
        panels.append(alt.layer(line, bars, points).properties(
            width=420, height=280, title=f"search {search}: measured (points), "
                                         "predicted (dashed)"))
    return alt.vconcat(*panels).properties(title="Mixed against uniform, by size")


def prediction_chart(results: pl.DataFrame) -> alt.TopLevelMixin:
    """Predicted KL (the sum of the probed cells, calibration windows) against the KL each
    search job measured (eval windows, with its error bar); the diagonal is agreement."""
    jobs = _searched(results)
    if jobs.is_empty():
        return _empty(NO_SEARCH)
    tooltip = [*JOB_TOOLTIP, "search_role:N",
               alt.Tooltip("predicted_kl:Q", format=".3g", title="predicted KL"),
               alt.Tooltip("kl_divergence:Q", format=".3g", title="measured KL")]
    values = [*jobs["predicted_kl"].drop_nulls(), *jobs["kl_divergence"].drop_nulls()]
    low, top = min(values), max(values)
    diagonal = alt.Chart(pl.DataFrame({"x": [low, top], "y": [low, top]})).mark_line(
        color="gray", strokeDash=[4, 4]).encode(x="x:Q", y="y:Q")
    base = alt.Chart(jobs).encode(x=alt.X("predicted_kl:Q", title="predicted KL",
                                          scale=alt.Scale(type="log")))
    bars = base.mark_rule().encode(y="kl_low:Q", y2="kl_high:Q", color="search_role:N")
    points = base.mark_point(filled=True, size=80).encode(
        y=alt.Y("kl_divergence:Q", title="measured KL", scale=alt.Scale(type="log")),
        color=alt.Color("search_role:N", title="role"), tooltip=tooltip)
    said = [agreement_line(row) for row in prediction_agreement(results).to_dicts()]
    return alt.layer(diagonal, bars, points).properties(
        width=420, height=300, title=alt.TitleParams("Predicted against measured KL",
                                                     subtitle=said))


def answer_markdown(answers: pl.DataFrame) -> str | None:
    """The answers of :func:`quantdask.search.answer.search_answers` as the report's opening
    Markdown: each answer's first line in bold, the rest as a list; None without one."""
    blocks: list[str] = []
    for line in answer_lines(answers):
        text = line.strip().replace("_", "\\_").replace("*", "\\*")
        if line.startswith(" ") and blocks:
            blocks[-1] += f"\n- {text}"
        else:
            blocks.append(f"**{text}**\n")
    return "\n\n".join(blocks) if blocks else None


def agreement_table(results: pl.DataFrame) -> pl.DataFrame:
    """Each search's rank correlation of predicted and measured KL over its verified jobs,
    where each was computed, and whether the prediction is a proxy of another runtime
    (``search.agreement``)."""
    return prediction_agreement(results)


def search_table(results: pl.DataFrame) -> pl.DataFrame:
    """Every search job: its role, size, predicted and measured KL (with its error), and
    their ratio, smallest first per search."""
    jobs = _searched(results)
    if jobs.is_empty():
        return pl.DataFrame()
    return jobs.sort("search", "bits_per_weight").select(
        "search", "config_label", pl.col("search_role").alias("role"), "bits_per_weight",
        "predicted_kl", "kl_divergence", "kl_se",
        (pl.col("kl_divergence") / pl.col("predicted_kl")).alias("measured_over_predicted"))
