"""The answer a search gives, in a few lines: at each budget, the mix to ship (the verified
allocation that measured the least KL), what it ships as (``agreement``: the file ``quantdask
export allocation`` writes, or why there is none), and its KL beside the uniform format a user
would ship instead (the largest one within the budget) and the mix re-solved at that uniform
format's bytes: mixed against uniform at equal bytes.

Everything comes from the run's records: the allocation frame (roles, budgets, bytes, each
allocation's job) and what those jobs measured (the results). The terminal summary of
``quantdask run`` and ``quantdask demo`` and the report's first section both read it here.

>>> answers = search_answers(read_results(run_dir), read_frame(run_dir, "allocation"), run_dir)
>>> print("\\n".join(answer_lines(answers)))  # doctest: +SKIP
answer: at 6.9 bits/weight (whole model; search mix, demo-llama), ship mix 6.9b #1: KL 0.00971 ...
  uniform b3 (hqq 3b g64), the largest within the budget: KL 0.0226 ± 0.0019, 6.890 bits/weight
  at equal bytes (6.890 bits/weight): mixed 0.00961 ± 0.00072 against uniform 0.0226 ± 0.0019 ...
  its file: not saved as a file: transformers' HqqConfig keys a mix by a linear's tag ...
"""

from __future__ import annotations

import json
import os
from typing import Any

import polars as pl

from quantdask.search.agreement import prediction_agreement
from quantdask.words import Status

_MEASURED = ("job_id", "config_label", "bits_per_weight", "kl_divergence", "kl_se")


def search_answers(results: pl.DataFrame, allocation: pl.DataFrame,
                   run_dir: str | os.PathLike | None = None) -> pl.DataFrame:
    """One row per (search, budget) whose mix finished: the mix to ship (``ship_*``), the
    largest uniform format within the budget (``uniform_*``; null where none fits), the mix
    at that format's bytes (``equal_*``) and what the mix ships as (``file``; with
    ``run_dir``, the export command for this run). Empty without a finished search job."""
    if allocation.is_empty() or "search" not in results.columns:
        return pl.DataFrame()
    done = results.filter(pl.col("status") == Status.DONE).select(*_MEASURED)
    jobs = (allocation.select("search", "model", "job_id", "role", "candidate",
                              "budget_bits_per_weight", "budget_bytes", "format", "backend",
                              "config")
            .unique(["search", "job_id", "role", "budget_bytes", "candidate"],
                    keep="first", maintain_order=True)
            .join(done, on="job_id", how="inner"))
    files = {row["search"]: row["file"]
             for row in prediction_agreement(results).iter_rows(named=True)}
    rows = []
    for (search,), part in jobs.group_by("search", maintain_order=True):
        mixed = part.filter(pl.col("role") == "mixed")
        for (budget,), at in mixed.group_by("budget_bits_per_weight", maintain_order=True):
            ship = at.sort("kl_divergence", "candidate").row(0, named=True)
            rows.append({"search": search, "model": ship["model"], "budget_bits_per_weight": budget,
                         **_prefixed("ship", ship), "ship_candidate": ship["candidate"],
                         **_uniform_beside(part, ship["budget_bytes"]),
                         "file": _file(ship, files.get(search), run_dir)})
    return pl.DataFrame(rows).sort("search", "budget_bits_per_weight") if rows else pl.DataFrame()


def _prefixed(prefix: str, row: dict[str, Any] | None) -> dict[str, Any]:
    """A job's label and figures under ``prefix_`` (nulls without a job)."""
    names = {"job_id": "job_id", "config_label": "label", "bits_per_weight": "bits_per_weight",
             "kl_divergence": "kl", "kl_se": "kl_se"}
    return {f"{prefix}_{short}": (row or {}).get(column) for column, short in names.items()}


def _uniform_beside(jobs: pl.DataFrame, budget_bytes: int) -> dict[str, Any]:
    """The finished uniform job with the most bytes within ``budget_bytes`` (its format and
    its backend's config label), and the finished mix re-solved at its bytes."""
    fits = jobs.filter((pl.col("role") == "uniform") & (pl.col("budget_bytes") <= budget_bytes))
    uniform = fits.sort("budget_bytes", descending=True).row(0, named=True) if fits.height \
        else None
    equal = None
    if uniform is not None:
        same = jobs.filter((pl.col("role") == "equal-bytes")
                           & (pl.col("budget_bytes") == uniform["budget_bytes"]))
        equal = same.row(0, named=True) if same.height else None
    return {**_prefixed("uniform", uniform), **_prefixed("equal", equal),
            "uniform_format": uniform["format"] if uniform else None,
            "uniform_config": _config_label(uniform) if uniform else None}


def _config_label(row: dict[str, Any]) -> str | None:
    """The backend's own name for a uniform job's options (``hqq 3b g64``)."""
    from quantdask.backends import get_backend

    backend = get_backend(row["backend"])
    if backend.label is None or not row.get("config"):
        return None
    return backend.label(backend.normalize(json.loads(row["config"]), "config"))


def _file(ship: dict[str, Any], agreement_file: str | None,
          run_dir: str | os.PathLike | None) -> str | None:
    """What the shipped mix is saved as: for a backend that writes its allocation as one file,
    the command that writes this one; else the agreement's reason why there is none."""
    from quantdask.backends import get_backend
    from quantdask.backends.capabilities import Searchable

    searchable = get_backend(ship["backend"]).has(Searchable)
    if searchable is None or searchable.export is None:
        return agreement_file
    candidate = f" --candidate {ship['candidate']}" if ship["candidate"] != 1 else ""
    return (f"quantdask export allocation {run_dir or 'RUN_DIR'} --search {ship['search']} "
            f"--budget {ship['budget_bits_per_weight']:g}{candidate} --to DIR writes it")


def answer_lines(answers: pl.DataFrame) -> list[str]:
    """The answers as text, a short block each: the mix to ship, the uniform format beside it
    and the two at equal bytes, and its file; [] without one."""
    lines: list[str] = []
    for row in answers.iter_rows(named=True):
        lines.append(f"answer: at {row['budget_bits_per_weight']:g} bits/weight (whole model; "
                     f"search {row['search']}, {row['model']}), ship {row['ship_label']}: "
                     f"{_kl(row, 'ship')}, {row['ship_bits_per_weight']:.3f} bits/weight")
        if row["uniform_label"] is None:
            lines.append("  no uniform format fits within the budget")
        else:
            config = f" ({row['uniform_config']})" if row["uniform_config"] else ""
            lines.append(f"  uniform {row['uniform_format']}{config}, the largest within the "
                         f"budget: {_kl(row, 'uniform')}, "
                         f"{row['uniform_bits_per_weight']:.3f} bits/weight")
            if row["equal_label"] is not None and row["equal_job_id"] != row["uniform_job_id"]:
                lines.append(f"  at equal bytes ({row['uniform_bits_per_weight']:.3f} "
                             f"bits/weight): mixed {_kl(row, 'equal', '')} against uniform "
                             f"{_kl(row, 'uniform', '')}{_ratio(row)}")
        lines.append(f"  its file: {row['file']}")
    return lines


def _kl(row: dict[str, Any], prefix: str, word: str = "KL ") -> str:
    from quantdask.store.figures import with_error

    return f"{word}{with_error(row[f'{prefix}_kl'], row[f'{prefix}_kl_se'])}"


def _ratio(row: dict[str, Any]) -> str:
    """How many times less KL the mix has than uniform at equal bytes, or that the two are
    within two standard errors of their difference (taken as independent, which overstates
    it: both are measured on the same windows), so the measurement does not rank them."""
    mixed, uniform = row["equal_kl"], row["uniform_kl"]
    noise = ((row["equal_kl_se"] or 0.0) ** 2 + (row["uniform_kl_se"] or 0.0) ** 2) ** 0.5
    if abs(uniform - mixed) <= 2 * noise or not mixed or not uniform:
        return " (within 2 standard errors: not ranked)"
    return (f" ({uniform / mixed:.1f}x less)" if uniform > mixed
            else f" ({mixed / uniform:.1f}x more)")
