"""Plain-text output of the command line: aligned tables (the live dashboard is ``dashboard``)."""

from __future__ import annotations

from typing import Any


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """``rows`` as aligned columns under a header line; ``-`` for a missing value."""
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    cells = [[cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)
