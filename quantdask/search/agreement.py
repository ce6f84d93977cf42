"""How well a search's predictions held: for each search, its verified jobs' predicted KL (the
probes' sum of cells, on the calibration windows, in torch) beside the KL they measured (on the
eval windows, where the job runs), and the rank correlation between them (Spearman), which says
whether the probes order the allocations as the measurements do even where their levels differ.

Each search's row also says what its mix ships as: the file ``quantdask export allocation``
writes (GGUF), or why there is none (hqq: transformers keys a mix by a linear's tag, not by
layer).

A prediction is a proxy when the jobs are measured in another runtime than the probes' torch
(GGUF: llama.cpp quantizes activations to 8 bits on the CPU, which the probes do not): its
level is not the measurement's, and the report says so.

>>> prediction_agreement(read_results(run_dir))  # doctest: +SKIP
search  jobs  spearman  predicted_in  measured_in  proxy  measured_over_predicted  file
mix     5     1.0       torch         llama.cpp    True   0.71                     one file: ...
"""

from __future__ import annotations

from typing import cast

import polars as pl

from quantdask.words import Status

TORCH = "torch"


def prediction_agreement(results: pl.DataFrame) -> pl.DataFrame:
    """One row per search: its done verified jobs, the Spearman correlation of predicted and
    measured KL over them (null below three), where each was computed and whether the
    prediction is a proxy of another runtime's figure; empty when no search ran."""
    if "search" not in results.columns:
        return pl.DataFrame()
    jobs = results.filter(pl.col("search").is_not_null() & (pl.col("status") == Status.DONE)
                          & pl.col("predicted_kl").is_not_null()
                          & pl.col("kl_divergence").is_not_null())
    if jobs.is_empty():
        return pl.DataFrame()
    runtime = (pl.col("runtime").str.extract(r"^(\S+)") if "runtime" in jobs.columns
               else pl.lit(None, dtype=pl.String))
    jobs = jobs.with_columns(runtime.fill_null(TORCH).alias("measured_in"))
    rows = []
    for (search,), part in jobs.group_by("search", maintain_order=True):
        proxy = proxy_of(part["backend"][0])
        predicted = TORCH if proxy is None else f"{TORCH}, {proxy}"
        said = (part["predicted_in"].drop_nulls() if "predicted_in" in part.columns
                else pl.Series([], dtype=pl.String))
        if len(said) and FISHER_FIT in said[0]:
            predicted = f"{predicted}, {FISHER_FIT}"
        rows.append({
            "search": search, "jobs": part.height,
            "spearman": _spearman(part["predicted_kl"], part["kl_divergence"]),
            "predicted_in": predicted,
            "measured_in": ", ".join(sorted(set(part["measured_in"]))),
            "proxy": proxy is not None or bool((part["measured_in"] != TORCH).any()),
            "measured_over_predicted": _median(part["kl_divergence"] / part["predicted_kl"]),
            "file": _file(part["backend"][0]),
        })
    return pl.DataFrame(rows)


def read_allocation(run_dir) -> pl.DataFrame:
    """The allocation frame (one row per allocation and unit) with what each allocation's
    job measured (``status``, ``kl_divergence``, ``kl_se``, ``runtime``) beside its
    prediction, and its search's ``spearman`` and ``proxy`` (:func:`prediction_agreement`)."""
    from quantdask.store.run_store import RunStore, read_frame

    allocation = read_frame(run_dir, "allocation")
    if allocation.is_empty():
        return allocation
    results = RunStore(run_dir).read_results()
    measured = results.select("job_id", "status", "kl_divergence", "kl_se", *(
        ["runtime"] if "runtime" in results.columns else []))
    joined = allocation.join(measured, on="job_id", how="left")
    agreement = prediction_agreement(results)
    if agreement.is_empty():
        return joined.with_columns(pl.lit(None, dtype=pl.Float64).alias("spearman"),
                                   pl.lit(None, dtype=pl.Boolean).alias("proxy"))
    return joined.join(agreement.select("search", "spearman", "proxy"), on="search",
                       how="left")


def agreement_line(row: dict) -> str:
    """One sentence for a search's row of :func:`prediction_agreement`."""
    rho = "n/a (fewer than 3 jobs)" if row["spearman"] is None else f"{row['spearman']:.2f}"
    proxy = (f"; a proxy: predicted in {row['predicted_in']}, measured in "
             f"{row['measured_in']} (its runtime's own costs are not in the prediction)"
             if row["proxy"] else "")
    return (f"search {row['search']}: predicted against measured KL over {row['jobs']} jobs, "
            f"Spearman {rho}, measured/predicted median {row['measured_over_predicted'] or 0:.2f}"
            f"{proxy}; its mix: {row['file']}")


FISHER_FIT = "from fisher scores fitted to each format's measured KL"


def proxy_of(backend: str) -> str | None:
    """The stated proxy a search of ``backend`` probes with (``Searchable.proxy_is``), or
    None where it probes with the backend's own quantizer."""
    from quantdask.backends import get_backend
    from quantdask.backends.capabilities import Searchable

    searchable = get_backend(backend).has(Searchable)
    return searchable.proxy_is if searchable is not None and searchable.proxy else None


def predicted_in(backend: str, method: str = "kl") -> str:
    """Where a search of ``backend`` predicts (the allocation frame's ``predicted_in``): in
    torch, with the backend's own quantizer, a stated proxy of it, or as a proxy of the
    runtime its jobs measure in (``OwnRuntime``); with ``method`` fisher, from Fisher scores
    fitted to nats (``search.fisher``)."""
    from quantdask.backends import get_backend
    from quantdask.backends.capabilities import OwnRuntime

    proxy, runtime = proxy_of(backend), get_backend(backend).has(OwnRuntime)
    if proxy is not None:
        where = f"{TORCH}, {proxy}"
    else:
        where = TORCH if runtime is None else f"{TORCH}, a proxy for {runtime.runtime}"
    return where if method == "kl" else f"{where}, {FISHER_FIT}"


def _file(backend: str) -> str:
    """What a search's mix ships as: the file ``quantdask export allocation`` writes, or why
    there is none."""
    from quantdask.backends import get_backend
    from quantdask.backends.capabilities import Searchable

    searchable = get_backend(backend).has(Searchable)
    if searchable is not None and searchable.export is not None:
        return ("one file: quantdask export allocation RUN_DIR --search NAME --budget B --to DIR "
                "(refused, with the reason, for a mix holding a format its backend cannot save)")
    if searchable is not None and searchable.ships_as:
        return searchable.ships_as
    why = searchable.unexported_why if searchable is not None else "not searchable"
    return f"not saved as a file: {why}"


def _median(values: pl.Series) -> float | None:
    found = values.median()
    return None if found is None else float(cast("float", found))


def _spearman(predicted: pl.Series, measured: pl.Series) -> float | None:
    """The rank correlation (average ranks for ties); None below three pairs or without
    spread in either."""
    if len(predicted) < 3 or predicted.n_unique() < 2 or measured.n_unique() < 2:
        return None
    frame = pl.DataFrame({"p": predicted, "m": measured})
    return float(frame.select(pl.corr("p", "m", method="spearman")).item())
