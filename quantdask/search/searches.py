"""A sweep's mixed-precision searches on the cluster, before its jobs run: probe every (unit,
format) cell as Dask tasks spread over the workers, solve the allocations, and return the jobs
that verify them beside the uniform configs.

For each search: the calibration reference (the full-precision model's log-probs on
``windows`` windows of the calibration text) is one task whose result every probe task shares;
the cells are cut into chunks of ``cells_per_task``, one task each (``retries`` as the sweep's),
and each chunk's rows are written to the sensitivity frame as it arrives, atomically, so that a
rerun probes only the cells not yet there. Each quantized format is also probed on every unit
at once (unit ``(all)``), which shows how far the additive prediction holds. The allocator
(``search.allocation``) then picks one format per unit for each budget (the main one and the
``frontier``), ``candidates`` each, and for each uniform format the allocation at that
format's bytes (the comparison at equal bytes).
Each becomes a job whose options carry its per-module formats (``modules``), measured on the
eval windows like any other; the allocation frame records the formats and the predictions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import polars as pl
from distributed import Client, Future

from quantdask.backends import BackendOptions, get_backend
from quantdask.backends.capabilities import Searchable
from quantdask.errors import SpecError
from quantdask.records import AllocationRow
from quantdask.run import LOG_CHANNEL
from quantdask.run.stages import StageWatch
from quantdask.search.agreement import predicted_in
from quantdask.search.allocation import Allocation, allocate
from quantdask.search.cells import ProbedCell, ProbedChunk
from quantdask.search.probe_runs import ProbeRules, ProbeTask, Room, run_probe_tasks
from quantdask.store.run_store import RunStore
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.search import ALL_UNITS, SearchRole, SearchSpec
from quantdask.sweepfile.settings import EvalSettings
from quantdask.sweepfile.sweep import Job, Sweep, make_job, search_fault_label
from quantdask.words import FaultKind

log = logging.getLogger(LOG_CHANNEL)


def probe_settings(sweep: Sweep, search: SearchSpec) -> EvalSettings:
    """The probes' windows: ``search.windows`` windows of the calibration text, as long as
    the eval's (or the calibration's, if shorter), measured as the eval measures KL."""
    calibration, evaluation = sweep.calibration, sweep.eval_for(_model(sweep, search))
    assert calibration is not None  # check_searches refuses a search without it
    return EvalSettings(text=calibration.text, dataset=calibration.dataset,
                        seq_len=min(calibration.seq_len, evaluation.seq_len),
                        samples=search.windows, batch_size=evaluation.batch_size,
                        kl_top_k=evaluation.kl_top_k, kl_tail_samples=evaluation.kl_tail_samples,
                        bos=evaluation.bos, root=calibration.root
                        ).with_bos(evaluation.bos_token_id)


def _model(sweep: Sweep, search: SearchSpec) -> ModelSpec:
    """The model ``search`` searches."""
    return next(m for m in sweep.models if m.label == search.model)


def search_key(sweep: Sweep, search: SearchSpec) -> str:
    """What a cell's figures depend on: the model, the backend and each format's options, the
    units' granularity and the probes' windows. Cells recorded under another key are stale."""
    model = _model(sweep, search)
    formats = {label: (o.as_dict() if o is not None else None)
               for label, o in search.format_options().items()}
    identity = {"model": model.identity(), "backend": search.backend, "formats": formats,
                "granularity": search.granularity,
                "windows": probe_settings(sweep, search).identity(),
                # what the backend makes units (cells of other units are another search's)
                "units": [_embeddings(search), _experts(search)]}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Probed:
    """A search's measured cells: unit -> format -> (KL, bytes), the bytes outside the units,
    the model's parameter count and the sensitivity rows."""

    cells: dict[str, dict[str, tuple[float, int]]]
    rest_bytes: int
    param_count: int
    units: dict[str, tuple[str, ...]]




def run_searches(sweep: Sweep, store: RunStore, client: Client,
                 placed: list[Job] | None = None, watch: StageWatch | None = None
                 ) -> list[Job] | None:
    """Probe, allocate and make the verifying jobs of every search of ``sweep``; the probe
    tasks hold what the model's baseline job holds among ``placed`` (its device memory: a
    probe holds the full-precision model too). None when ``watch.stop`` ended them early;
    ``probe_runs.ProbeFailed`` when a task failed past the sweep's retries."""
    watch = watch or StageWatch()
    jobs: list[Job] = []
    for search in sweep.searches:
        baseline = next((job for job in placed or [] if job.is_baseline
                         and job.model.label == search.model), None)
        probed = probe(sweep, search, store, client,
                       baseline.resources if baseline is not None else None, watch)
        if probed is None:
            return None
        verifying = verifying_jobs(sweep, search, probed, store)
        jobs += verifying
        if watch.progress is not None:
            watch.progress.search_finished(search.name, len(verifying))
    return jobs


def probe(sweep: Sweep, search: SearchSpec, store: RunStore, client: Client,
          resources: dict[str, float] | None = None, watch: StageWatch | None = None
          ) -> Probed | None:
    """Every cell of ``search`` measured: those already in ``store`` read back, the rest
    probed on the cluster (see the module), each task holding ``resources`` (default: a
    job's share of a GPU), its failures handled as a job's (``search.probe_runs``). None
    when ``watch.stop`` ended it early."""
    from quantdask.search.probe_task import search_reference, search_units

    watch = watch or StageWatch()
    model = _model(sweep, search)
    settings, key = probe_settings(sweep, search), search_key(sweep, search)
    # This driver's own Dask keys, carrying its session's id (the time account's).
    tag = f"search-{search.name}-{watch.run_id or 'direct'}-{uuid.uuid4().hex[:8]}"
    room = Room(resources or {"GPU": 1.0 / sweep.jobs_per_gpu}, settings.batch_size)
    rules = ProbeRules(sweep.retries, sweep.timeout_s, sweep.retry_backoff_s)

    def one(what: str, function: Callable, *args) -> Future | None:
        return _run_one(client, f"search {search.name}: {what}", room, rules, f"{tag}-{what}",
                        watch, function, *args)

    found = one("units", search_units, model, search.granularity, _embeddings(search),
                _experts(search))
    if found is None:
        return None
    units = found.result().units
    done = _recorded(store, search.name, key)
    every = tuple(m for modules in units.values() for m in modules)
    cells = [(u, units[u], f) for u in units for f in search.formats]
    cells += [(ALL_UNITS, every, f) for f, o in search.format_options().items() if o is not None]
    todo = [(u, modules, f) for u, modules, f in cells if (u, f) not in done]
    if watch.progress is not None:
        watch.progress.search_started(search.name, len(cells), len(cells) - len(todo))
    if todo:
        reference = one("reference", search_reference, model, settings, settings.read_text())
        if reference is None:
            return None
        chunks = list(_chunks(todo, search.cells_per_task))
        formats = search.format_options()
        faults = [(f["attempt"], f["kind"]) for f in sweep.faults
                  if f["config"] == search_fault_label(search.name)]
        tasks = [ProbeTask(f"search {search.name}: probe chunk {i + 1} of {len(chunks)}",
                           _chunk_submit(client, model, reference, search, formats, chunk, units,
                                         faults))
                 for i, chunk in enumerate(chunks)]
        for index, future in run_probe_tasks(client, tasks, room, rules, f"{tag}-probe",
                                             watch.stop, watch.tick):
            _write_chunk(store, search, key, model.label, chunks[index], future.result(), done)
            if watch.progress is not None:
                watch.progress.cells_probed(search.name, len(chunks[index]))
        if watch.stop.is_set():
            return None
        done = _recorded(store, search.name, key)
    rest = done[("", "rest")]
    measured: dict[str, dict[str, tuple[float, int]]] = {u: {} for u in units}
    for (unit, label), (kl, size) in done.items():
        if unit in measured and kl is not None:
            measured[unit][label] = (kl, size)
    return Probed(measured, int(rest[1]), found.result().param_count, units)


def _run_one(client: Client, what: str, room: Room, rules: ProbeRules, tag: str,
             watch: StageWatch, function: Callable, *args) -> Future | None:
    """One task of a search run to its end (``probe_runs``): its finished future, or None
    when ``watch.stop`` ended it."""
    task = ProbeTask(what, lambda r, k, _: client.submit(function, *args, resources=r.resources,
                                                         key=k, pure=False))
    # Closed here, not when collected: it unsubscribes and cancels as it closes.
    with contextlib.closing(run_probe_tasks(client, [task], room, rules, tag, watch.stop,
                                            watch.tick)) as finished:
        return next((future for _, future in finished), None)


def _chunk_submit(client: Client, model: ModelSpec, reference: Future, search: SearchSpec,
                  formats: dict[str, BackendOptions | None], chunk: list,
                  units: dict[str, tuple[str, ...]], faults: list[tuple[int, FaultKind]]
                  ) -> Callable[[Room, str, int], Future]:
    """How to submit an attempt of a probe chunk (with the sweep's ``faults`` for it)."""
    from quantdask.search.probe_task import probe_chunk

    return lambda room, key, attempt: client.submit(
        probe_chunk, model, reference, room.batch_size, search.backend, formats, chunk, units,
        [(a, kind) for a, kind in faults if a == attempt], resources=room.resources, key=key,
        pure=False)


def _write_chunk(store: RunStore, search: SearchSpec, key: str, model: str, chunk: list,
                 part: ProbedChunk, done: dict[tuple[str, str], tuple]) -> None:
    """A probed chunk's rows in the sensitivity frame, in a file of their own; the first
    chunk also writes the bytes outside the units (a chunk on disk implies them)."""
    if ("", "rest") not in done:
        done[("", "rest")] = (0.0, part.rest_bytes)
        store.write_rows("sensitivity", f"rest-{search.name}-{key}",
                         [ProbedCell.rest(part.rest_bytes).row(search.name, key, model)])
    rows = [cell.row(search.name, key, model) for cell in part.cells]
    store.write_rows("sensitivity", _chunk_name(search.name, key, chunk), rows)
    log.info("search %s: %d cells probed", search.name, len(rows))


def _recorded(store: RunStore, search: str, key: str) -> dict[tuple[str, str], tuple]:
    """The cells of ``search`` under ``key`` already recorded: (unit, format) -> (kl, bytes);
    the bytes outside the units under ("", "rest")."""
    frame = store.read("sensitivity").filter((pl.col("search") == search)
                                              & (pl.col("search_key") == key))
    return {(row["unit"], row["format"]): (row["kl"], row["bytes"])
            for row in frame.iter_rows(named=True)}


def _chunk_name(search: str, key: str, chunk: list) -> str:
    """A chunk's file in the sensitivity frame: named by its cells, so that a rerun's chunks
    (cut from the cells still missing) never replace an earlier run's."""
    cells = json.dumps([(unit, label) for unit, _, label in chunk])
    return f"{search}-{key}-{hashlib.sha256(cells.encode()).hexdigest()[:12]}"


def _chunks(cells: list, size: int) -> Iterator[list]:
    for start in range(0, len(cells), size):
        yield cells[start:start + size]


def verifying_jobs(sweep: Sweep, search: SearchSpec, probed: Probed, store: RunStore
                   ) -> list[Job]:
    """The jobs that verify ``search``'s allocations (see the module), and their rows of the
    allocation frame (written here)."""
    model = _model(sweep, search)
    formats = search.format_options()
    units = list(probed.units)
    ties, fixed = search.ties_in(units), search.fixed_in(units)
    made: list[tuple[str, SearchRole, dict[str, str], Allocation | None]] = []
    least = probed.rest_bytes + sum(min(size for _, size in probed.cells[u].values())
                                    for u in units)
    for bits in _budgets(search, probed):
        budget = int(bits * probed.param_count / 8) - probed.rest_bytes
        if budget + probed.rest_bytes < least:
            where = f"searches[{list(sweep.searches).index(search)}].budget"
            raise SpecError(where, f"{bits:g} bits per weight is below the least {model.label} "
                                   f"takes with these formats, "
                                   f"{8 * least / probed.param_count:.3f} (every unit at its "
                                   f"smallest; the {probed.rest_bytes:,} bytes outside the "
                                   "units, embeddings and head, stay as they are)")
        for found in allocate(probed.cells, budget, ties=ties, fixed=fixed,
                              candidates=search.candidates, solver=search.solver):
            role = _role(search, "mixed", found.rank, bits, found, probed)
            made.append((f"{search.name} {bits:g}b #{found.rank}", role, found.formats, found))
    made += _at_uniform_bytes(search, probed, ties, fixed)
    embeddings = _embeddings(search)
    jobs: dict[str, Job] = {}
    rows: list[AllocationRow] = []
    for config_label, role, chosen, allocation in made:
        # One quantized format everywhere is that format's plain config (one job for both),
        # where the units are the layers' linears (a plain config's format covers those).
        only = set(chosen.values())
        plain = formats[next(iter(only))] if len(only) == 1 and not embeddings else None
        options = plain if plain is not None else _options(search, probed, formats, chosen)
        job = make_job(sweep, model, search.backend, options, sweep.priority, config_label,
                       role)
        jobs.setdefault(job.id, job)
        budget_bytes = (allocation.budget_bytes if allocation
                        else role.predicted_bytes - probed.rest_bytes)
        rows += [AllocationRow(search=search.name, model=model.label, job_id=job.id,
                               role=role.role, candidate=role.candidate,
                               budget_bits_per_weight=role.budget_bits_per_weight,
                               budget_bytes=budget_bytes + probed.rest_bytes, unit=unit,
                               format=label, predicted_kl=role.predicted_kl,
                               predicted_bytes=role.predicted_bytes,
                               solver=allocation.solver if allocation else "uniform",
                               predicted_in=predicted_in(search.backend),
                               backend=search.backend,
                               config=json.dumps(job.options.as_dict(), sort_keys=True),
                               model_location=model.location)
                 for unit, label in chosen.items()]
    store.write_rows("allocation", f"{search.name}-{search_key(sweep, search)}", rows)
    return list(jobs.values())


def _embeddings(search: SearchSpec) -> bool:
    """Whether the search's backend makes the token embedding and output units too."""
    searchable = get_backend(search.backend).has(Searchable)
    return bool(searchable and searchable.embeddings)


def _experts(search: SearchSpec) -> bool:
    """Whether the search's backend makes fused experts units (``search.members``)."""
    searchable = get_backend(search.backend).has(Searchable)
    return bool(searchable and searchable.experts)


def _at_uniform_bytes(search: SearchSpec, probed: Probed, ties: list[list[str]],
                      fixed: dict[str, str]) -> list:
    """Each uniform format (one every unit can take) and the allocation re-solved at its
    bytes: the comparison at equal bytes."""
    made: list = []
    units = list(probed.units)
    for label, options in search.format_options().items():
        if options is None or any(label not in probed.cells[u] for u in units):
            continue  # keep everywhere is the baseline; a format some unit cannot take
        size = sum(probed.cells[u][label][1] for u in units)
        bits = 8 * (size + probed.rest_bytes) / probed.param_count
        uniform = SearchRole(search.name, "uniform", 1, bits,
                             sum(probed.cells[u][label][0] for u in units),
                             size + probed.rest_bytes)
        made.append((f"{search.name} uniform {label}", uniform, dict.fromkeys(units, label),
                     None))
        [equal] = allocate(probed.cells, size, ties=ties, fixed=fixed, solver=search.solver)
        # Where the best at these bytes is this format everywhere, its options are the uniform
        # config's: the uniform job (made first) stands for it, and the allocation frame says so.
        made.append((f"{search.name} mixed at {label} bytes",
                     _role(search, "equal-bytes", 1, bits, equal, probed), equal.formats, equal))
    return made


def _budgets(search: SearchSpec, probed: Probed) -> list[float]:
    """The budgets in bits per weight (a bytes budget converted with the parameter count)."""
    if "bytes" in search.budget:
        return [8 * search.budget["bytes"] / probed.param_count, *search.budgets()]
    return list(search.budgets())


def _role(search: SearchSpec, role: str, rank: int, bits: float, found: Allocation,
          probed: Probed) -> SearchRole:
    return SearchRole(search.name, role, rank, bits, found.kl, found.bytes + probed.rest_bytes)


def _options(search: SearchSpec, probed: Probed, formats: dict[str, BackendOptions | None],
             chosen: dict[str, str]) -> BackendOptions:
    """An allocation as the backend's options: those of its most used quantized format, and
    every unit's modules given their own format (``modules``; null where kept)."""
    used = [label for label in chosen.values() if formats[label] is not None]
    base = formats[max(sorted(set(used)), key=used.count)] if used else None
    base = base or next(o for o in formats.values() if o is not None)
    backend = get_backend(search.backend)
    modules: dict[str, Any] = {}
    for unit, label in chosen.items():
        own = formats[label]
        for module in probed.units[unit]:
            modules[module] = None if own is None else {
                key: own.get(key) for key in backend.module_keys}
    return backend.normalize({**base.as_dict(), "modules": modules}, f"searches.{search.name}")
