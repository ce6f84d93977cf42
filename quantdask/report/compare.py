"""The compare report: two runs' paired differences as charts with error bars, the flipped
questions and the environment's differences (``notebooks/compare.ipynb``, exported to one HTML
file by :func:`write_compare_report`; ``quantdask compare A B --html FILE``).

>>> comparison = qd.compare("runs/demo", "runs/demo-upgraded")  # doctest: +SKIP
>>> difference_chart(comparison.quality)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from quantdask.comparison.verdicts import BETTER, NO_DIFFERENCE, NOT_TESTABLE, WORSE

if TYPE_CHECKING:
    import altair as alt

VERDICT_COLOURS = {WORSE: "#e45756", BETTER: "#54a24b", NO_DIFFERENCE: "#9d9d9d",
                   NOT_TESTABLE: "#bab0ac"}
Z95 = 1.959963984540054


def difference_chart(tests: pl.DataFrame, title: str = "Change from A to B"
                     ) -> alt.Chart | alt.FacetChart:
    """One panel per metric: each matched job's change B - A as a share of A's value, with
    its 95% interval (paired standard error), coloured by the verdict; the rule at 0 is no
    change."""
    import altair as alt

    frame = tests.filter(pl.col("a").is_not_null() & (pl.col("a") != 0)).with_columns(
        pl.concat_str("model", pl.lit("/"), "config_label").alias("job"),
        (pl.when(pl.col("task").is_not_null()).then(pl.concat_str("task", pl.lit(": "),
                                                                    "metric"))
         .otherwise(pl.col("metric")) if "task" in tests.columns else pl.col("metric"))
        .alias("panel"),
        (pl.col("diff") / pl.col("a").abs()).alias("change"),
        (Z95 * pl.col("se").fill_null(0.0) / pl.col("a").abs()).alias("half"))
    frame = frame.with_columns((pl.col("change") - pl.col("half")).alias("low"),
                               (pl.col("change") + pl.col("half")).alias("high"))
    colour = alt.Color("verdict:N", scale=alt.Scale(domain=list(VERDICT_COLOURS),
                                                    range=list(VERDICT_COLOURS.values())))
    tooltip = ["job:N", "panel:N", alt.Tooltip("a:Q", format=".6g"),
               alt.Tooltip("b:Q", format=".6g"), alt.Tooltip("change:Q", format="+.2%"),
               alt.Tooltip("p_adjusted:Q", format=".3g"), "pairing:N", "verdict:N"]
    if frame.is_empty():
        return alt.Chart(frame).mark_point().properties(title=f"{title}: nothing to compare")
    base = alt.Chart().encode(y=alt.Y("job:N", title=None))
    bars = base.mark_rule().encode(x=alt.X("low:Q", title="B - A, share of A (95% interval)",
                                           axis=alt.Axis(format="%")), x2="high:Q",
                                   color=colour)
    points = base.mark_point(filled=True, size=60).encode(x="change:Q", color=colour,
                                                          tooltip=tooltip)
    zero = alt.Chart().mark_rule(strokeDash=[4, 3], color="#555").encode(x=alt.datum(0))
    layered = alt.layer(zero, bars, points).properties(width=320)
    return layered.facet(facet=alt.Facet("panel:N", title=None), columns=2,
                         data=frame).properties(title=title)


def write_compare_report(run_a: str | os.PathLike, run_b: str | os.PathLike,
                         output: str | os.PathLike, pairs: dict[str, str] | None = None,
                         tolerances: dict[str, str] | None = None) -> Path:
    """Run the compare notebook on ``run_a`` and ``run_b`` and export it to ``output`` (HTML;
    the executed notebook beside it). Nothing is written into either run."""
    from quantdask.comparison.compare import compare
    from quantdask.report.html import execute_notebook, export_html

    output = Path(output)
    compare(run_a, run_b, pairs, tolerances)  # refused here, before a kernel starts
    output.parent.mkdir(parents=True, exist_ok=True)
    parameters = {"run_a": str(Path(run_a).resolve()), "run_b": str(Path(run_b).resolve()),
                  "pairs": pairs or {}, "tolerances": tolerances or {}}
    nb = execute_notebook("compare", parameters, output=output.with_suffix(".ipynb"),
                          cwd=output.parent)
    return export_html(nb, output, title=f"quantdask compare: {Path(run_a).name} vs "
                                         f"{Path(run_b).name}")
