"""A sweep's mixed-precision searches on the cluster, before its jobs run: refuse what the
shapes and the tokenizer rule out (``search.pricing``), score every (unit, format) cell as Dask
tasks spread over the workers by the search's sensitivity method (``search.probing``: ``kl``
probes or ``fisher`` passes), solve the allocations, refine the main budget's over the cluster
where the search says (``search.refine``), and return the jobs that verify them beside the
uniform configs.

The allocator (``search.allocation``) picks one format per unit for each budget (the main one
and the ``frontier``), ``candidates`` each, and for each uniform format the allocation at that
format's bytes (the comparison at equal bytes); with ``refine``, the refinement's best mix too.
Each becomes a job whose options carry its per-module formats (``modules``), measured on the
eval windows like any other; the allocation frame records the formats and the predictions.
"""

from __future__ import annotations

import json
import logging

from distributed import Client

from quantdask.errors import SpecError
from quantdask.plan.model_facts import model_facts
from quantdask.records import AllocationRow
from quantdask.run import LOG_CHANNEL
from quantdask.run.stages import StageWatch
from quantdask.search.agreement import predicted_in
from quantdask.search.allocation import Allocation, allocate
from quantdask.search.identity import embeddings_are_units, model_of
from quantdask.search.pricing import check_budget_from_shapes, check_windows
from quantdask.search.probing import Probed, probe_with, probing_run
from quantdask.search.refine import Refined, mix_bytes, mix_options, refine
from quantdask.store.run_store import RunStore
from quantdask.sweepfile.search import SearchRole, SearchSpec
from quantdask.sweepfile.sweep import Job, Sweep, expand_grid, make_job

log = logging.getLogger(LOG_CHANNEL)


def run_searches(sweep: Sweep, store: RunStore, client: Client,
                 placed: list[Job] | None = None, watch: StageWatch | None = None
                 ) -> list[Job] | None:
    """Probe, allocate and make the verifying jobs of every search of ``sweep``; the probe
    tasks hold what the model's baseline job holds among ``placed`` (its device memory: a
    probe holds the full-precision model too). None when ``watch.stop`` ended them early;
    ``probe_runs.ProbeFailed`` when a task failed past the sweep's retries."""
    watch = watch or StageWatch()
    jobs: list[Job] = []
    check_searches(sweep)  # a library caller may not have asked before
    for search in sweep.searches:
        baseline = next((job for job in placed or [] if job.is_baseline
                         and job.model.label == search.model), None)
        run = probing_run(sweep, search, store, client,
                          baseline.resources if baseline is not None else None, watch)
        probed = probe_with(run)
        if probed is None:
            return None
        check_budgets(sweep, search, probed)
        refined = None
        if search.refinement() is not None:
            bits = _budgets(search, probed)[0]
            budget = int(bits * probed.param_count / 8) - probed.rest_bytes
            ties, fixed = search.ties_in(probed.units), search.fixed_in(probed.units)
            [start] = allocate(probed.cells, budget, ties=ties, fixed=fixed,
                               solver=search.solver)
            refined = refine(run, probed, start.formats, budget, ties, fixed)
            if refined is None:
                return None
            log.info("search %s: refined over %d generations (%s): KL %.5g -> %.5g on the "
                     "refinement windows", search.name, refined.generations, refined.stopped,
                     refined.start.kl, refined.best.kl)
        verifying = verifying_jobs(sweep, search, probed, store, refined)
        jobs += verifying
        if watch.progress is not None:
            watch.progress.search_finished(search.name, len(verifying))
    return jobs


def check_searches(sweep: Sweep) -> None:
    """Refuse what the sweep file, the model's shapes and its tokenizer rule out for each
    search (``search.pricing``): a budget below the least the shapes allow, windows the
    calibration text cannot fill."""
    baselines = {job.model.label: job for job in expand_grid(sweep) if job.is_baseline}
    for search in sweep.searches:
        if search.model in baselines:
            check_budget_from_shapes(sweep, search, model_facts(baselines[search.model]))
        check_windows(sweep, search)


def check_budgets(sweep: Sweep, search: SearchSpec, probed: Probed) -> None:
    """Refuse a budget below the least the model takes with the search's formats."""
    least = probed.rest_bytes + sum(min(size for _, size in probed.cells[u].values())
                                    for u in probed.units)
    for bits in _budgets(search, probed):
        if int(bits * probed.param_count / 8) < least:
            where = f"searches[{list(sweep.searches).index(search)}].budget"
            raise SpecError(where, f"{bits:g} bits per weight is below the least {search.model} "
                                   f"takes with these formats, "
                                   f"{8 * least / probed.param_count:.3f} (every unit at its "
                                   f"smallest; the {probed.rest_bytes:,} bytes outside the "
                                   "units, embeddings and head, stay as they are)")


def verifying_jobs(sweep: Sweep, search: SearchSpec, probed: Probed, store: RunStore,
                   refined: Refined | None = None) -> list[Job]:
    """The jobs that verify ``search``'s allocations (see the module; with ``refined``, the
    refinement's best mix too), and their rows of the allocation frame (written here); its
    budgets already checked against the probed cells (:func:`check_budgets`)."""
    model = model_of(sweep, search)
    formats = search.format_options()
    units = list(probed.units)
    ties, fixed = search.ties_in(units), search.fixed_in(units)
    made: list[tuple[str, SearchRole, dict[str, str], Allocation | None]] = []
    for bits in _budgets(search, probed):
        budget = int(bits * probed.param_count / 8) - probed.rest_bytes
        for found in allocate(probed.cells, budget, ties=ties, fixed=fixed,
                              candidates=search.candidates, solver=search.solver):
            role = _role(search, "mixed", found.rank, bits, found, probed)
            made.append((f"{search.name} {bits:g}b #{found.rank}", role, found.formats, found))
    if refined is not None:
        bits = _budgets(search, probed)[0]
        mix = refined.best.formats
        role = SearchRole(search.name, "refined", 1, bits,
                          sum(probed.cells[u][label][0] for u, label in mix.items()),
                          mix_bytes(mix, probed.cells) + probed.rest_bytes,
                          predicted_in(search.backend, probed.method_name))
        made.append((f"{search.name} {bits:g}b refined", role, mix, None))
    made += _at_uniform_bytes(search, probed, ties, fixed)
    embeddings = embeddings_are_units(search)
    jobs: dict[str, Job] = {}
    rows: list[AllocationRow] = []
    for config_label, role, chosen, allocation in made:
        # One quantized format everywhere is that format's plain config (one job for both),
        # where the units are the layers' linears (a plain config's format covers those).
        only = set(chosen.values())
        plain = formats[next(iter(only))] if len(only) == 1 and not embeddings else None
        options = plain if plain is not None else mix_options(search, probed.units, chosen)
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
                               solver=(allocation.solver if allocation
                                       else "refined" if role.role == "refined" else "uniform"),
                               predicted_in=predicted_in(search.backend, probed.method_name),
                               backend=search.backend,
                               config=json.dumps(job.options.as_dict(), sort_keys=True),
                               model_location=model.location)
                 for unit, label in chosen.items()]
    store.write_rows("allocation", f"{search.name}-{probed.key}", rows)
    return list(jobs.values())


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
                             size + probed.rest_bytes,
                             predicted_in(search.backend, probed.method_name))
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
    return SearchRole(search.name, role, rank, bits, found.kl, found.bytes + probed.rest_bytes,
                      predicted_in(search.backend, probed.method_name))
