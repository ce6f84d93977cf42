"""A search's cells scored on the cluster, the driver's side: its units, its calibration
reference, and every (unit, format) cell, by the search's sensitivity method
(``search.pricing.choose_method``):

- ``kl``: chunks of ``cells_per_task`` cells, one task each, every cell measured with its unit
  swapped in (``search.probe_task``);
- ``fisher``: one forward and backward pass per batch of the calibration windows, one task each
  (``search.fisher_task.fisher_pass``), then chunks of cells scored on those captures, and the
  scores mapped to nats by each format's measured whole-model KL (``search.fisher.fit_ratio``).

Either way each format is also measured on every unit at once (unit ``(all)``), by its KL.
Each chunk's rows are written to the sensitivity frame as they arrive, atomically, so that a
rerun scores only the cells not yet there; every task is retried by failure class
(``search.probe_runs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

import polars as pl
from distributed import Client, Future, wait

from quantdask.records import SensitivityRow
from quantdask.run import LOG_CHANNEL
from quantdask.run.stages import StageWatch
from quantdask.search.cells import ProbedCell, ProbedChunk, SearchUnits
from quantdask.search.fisher import fit_ratio
from quantdask.search.identity import (
    embeddings_are_units,
    experts_are_units,
    model_of,
    probe_settings,
    search_key,
)
from quantdask.search.pricing import MethodChoice, captured_bytes, choose_method
from quantdask.search.probe_runs import ProbeRules, ProbeTask, Room, run_probe_tasks
from quantdask.store.run_store import RunStore
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.search import ALL_UNITS, SearchSpec
from quantdask.sweepfile.sweep import DEVICE_MEMORY, Sweep, search_fault_label

log = logging.getLogger(LOG_CHANNEL)


@dataclass
class Probed:
    """A search's scored cells: unit -> format -> (predicted KL, bytes), the bytes outside the
    units, the model's parameter count, the units' members, and how the cells were scored
    (with fisher, each format's fit: nats per unit of score)."""

    cells: dict[str, dict[str, tuple[float, int]]]
    rest_bytes: int
    param_count: int
    units: dict[str, tuple[str, ...]]
    method: MethodChoice | None = None
    fits: dict[str, float] = dataclasses.field(default_factory=dict)
    key: str = ""

    @property
    def method_name(self) -> str:
        return self.method.method if self.method is not None else "kl"


@dataclass
class _Probing:
    """One search's probing on the cluster: what its tasks share."""

    sweep: Sweep
    search: SearchSpec
    store: RunStore
    client: Client
    room: Room
    rules: ProbeRules
    tag: str
    watch: StageWatch

    @property
    def model(self) -> ModelSpec:
        return model_of(self.sweep, self.search)

    def one(self, what: str, function: Callable, *args) -> Future | None:
        """One task of the search run to its end: its finished future, or None when
        ``watch.stop`` ended it."""
        task = self.task(what, function, lambda room, attempt: args)
        # Closed here, not when collected: it unsubscribes and cancels as it closes.
        with contextlib.closing(self.run([task], what)) as finished:
            return next((future for _, future in finished), None)

    def task(self, what: str, function: Callable, args: Callable[[Room, int], tuple]
             ) -> ProbeTask:
        """A task of the search: ``function`` on ``args(room, attempt)``, in its room."""
        def submit(room: Room, key: str, attempt: int) -> Future:
            return self.client.submit(function, *args(room, attempt),
                                      resources=room.resources, key=key, pure=False)
        return ProbeTask(f"search {self.search.name}: {what}", submit)

    def faults(self, attempt: int, part: str = "") -> list:
        """The sweep's injected faults for this search's tasks, for attempt ``attempt``
        (``search:NAME`` for every task; ``search:NAME:refine`` for the offspring alone)."""
        label = search_fault_label(self.search.name)
        labels = {label, f"{label}:{part}"} if part else {label}
        return [(f["attempt"], f["kind"]) for f in self.sweep.faults
                if f["config"] in labels and f["attempt"] == attempt]

    def run(self, tasks: list[ProbeTask], what: str, room: Room | None = None
            ) -> Generator[tuple[int, Future], None, None]:
        """``tasks`` run to their ends (``probe_runs.run_probe_tasks``), each first in
        ``room`` (default: the search's)."""
        return run_probe_tasks(self.client, tasks, room or self.room, self.rules,
                               f"{self.tag}-{what}", self.watch.stop, self.watch.tick)


def probing_run(sweep: Sweep, search: SearchSpec, store: RunStore, client: Client,
                resources: dict[str, float] | None = None, watch: StageWatch | None = None
                ) -> _Probing:
    """What ``search``'s tasks share on the cluster: each holds ``resources`` (default: a
    job's share of a GPU), its failures handled as a job's, under this driver's keys."""
    watch = watch or StageWatch()
    settings = probe_settings(sweep, search)
    # This driver's own Dask keys, carrying its session's id (the time account's).
    tag = f"search-{search.name}-{watch.run_id or 'direct'}-{uuid.uuid4().hex[:8]}"
    return _Probing(sweep, search, store, client,
                    Room(resources or {"GPU": 1.0 / sweep.jobs_per_gpu}, settings.batch_size),
                    ProbeRules(sweep.retries, sweep.timeout_s, sweep.retry_backoff_s), tag,
                    watch)


def probe(sweep: Sweep, search: SearchSpec, store: RunStore, client: Client,
          resources: dict[str, float] | None = None, watch: StageWatch | None = None
          ) -> Probed | None:
    """Every cell of ``search`` scored (see the module): those already in ``store`` read
    back, the rest on the cluster (``probing_run``). None when ``watch.stop`` ended it
    early."""
    return probe_with(probing_run(sweep, search, store, client, resources, watch))


def probe_with(run: _Probing) -> Probed | None:
    """:func:`probe` on ``run``'s cluster."""
    from quantdask.search.probe_task import search_reference, search_units

    sweep, search, store, watch = run.sweep, run.search, run.store, run.watch
    settings = probe_settings(sweep, search)
    found = run.one("units", search_units, run.model, search.granularity,
                    embeddings_are_units(search), experts_are_units(search))
    if found is None:
        return None
    units = found.result()
    method = choose_method(sweep, search, units)
    log.info("search %s: sensitivity %s: %s", search.name, method.method, method.why)
    key = search_key(sweep, search, method.method)
    done = recorded(store, search.name, key)
    every = tuple(m for modules in units.units.values() for m in modules)
    per_unit = [(u, units.units[u], f) for u in units.units for f in search.formats]
    whole = [(ALL_UNITS, every, f) for f, o in search.format_options().items() if o is not None]
    todo = [(u, m, f) for u, m, f in per_unit + whole if (u, f) not in done]
    if watch.progress is not None:
        watch.progress.search_started(search.name, len(per_unit + whole),
                                      len(per_unit + whole) - len(todo))
    if todo:
        reference = run.one("reference", search_reference, run.model, settings,
                            settings.read_text())
        if reference is None:
            return None
        if not _score_cells(run, key, reference, todo, units, method, done):
            return None
        done = recorded(store, search.name, key)
    return _assembled(run, key, done, units, method)


def _score_cells(run: _Probing, key: str, reference: Future, todo: list,
                 found: SearchUnits, method: MethodChoice, done: dict) -> bool:
    """Score the cells ``todo`` (see the module), writing each chunk as it arrives; False
    when ``watch.stop`` ended it."""
    from quantdask.search.probe_task import probe_chunk

    search, formats, units = run.search, run.search.format_options(), found.units
    fisher = method.method == "fisher"
    measured = [c for c in todo if not fisher or c[0] == ALL_UNITS]
    scored = [c for c in todo if fisher and c[0] != ALL_UNITS]
    # a whole format's cell is a whole model's forward: a task of its own
    chunks = [*_chunks([c for c in measured if c[0] != ALL_UNITS], search.cells_per_task),
              *([c] for c in measured if c[0] == ALL_UNITS)]
    def probe_args(room: Room, attempt: int, chunk: list) -> tuple:
        return (run.model, reference, room.batch_size, search.backend, formats, chunk, units,
                run.faults(attempt))

    tasks = [run.task(f"probe chunk {i + 1} of {len(chunks)}", probe_chunk,
                      functools.partial(probe_args, chunk=chunk))
             for i, chunk in enumerate(chunks)]
    captures: list[Future] = []
    room = run.room
    if scored:  # the passes first; then their cells beside the whole formats' KL
        captures = [future for _, future in run.run(
            _pass_tasks(run, reference, units, method), "pass")]
        if run.watch.stop.is_set():
            return False
        more, room, parts = _fisher_tasks(run, captures, scored, found)
        chunks += list(_chunks(scored, search.cells_per_task))
        tasks += more
        # Once cut into the chunks' parts, the whole captures are let go (no future of
        # this client holds them: Dask drops them, and would run a pass again for a part
        # lost with its worker).
        wait(parts)
        captures.clear()
    for index, future in run.run(tasks, "probe", room):
        _write_chunk(run, key, chunks[index], future.result(), done)
    return not run.watch.stop.is_set()


def _pass_tasks(run: _Probing, reference: Future, units: dict[str, tuple[str, ...]],
                method: MethodChoice) -> list[ProbeTask]:
    """One forward and backward pass per batch of the calibration windows."""
    from quantdask.search.fisher_task import fisher_pass

    search, batch = run.search, run.room.batch_size
    members = [m for modules in units.values() for m in modules]
    batches = [(start, min(start + batch, search.windows))
               for start in range(0, search.windows, batch)]
    keep = math.ceil(search.fisher_tokens / len(batches))

    def pass_args(room: Room, attempt: int, rows: tuple[int, int], index: int) -> tuple:
        return (run.model, reference, rows, members, keep, _pass_seed(search, index),
                run.faults(attempt))

    return [run.task(f"fisher pass {i + 1} of {len(batches)}", fisher_pass,
                     functools.partial(pass_args, rows=rows, index=i))
            for i, rows in enumerate(batches)]


def _pass_seed(search: SearchSpec, index: int) -> int:
    """The seed of pass ``index``'s sampled tokens and kept positions (the same on a rerun)."""
    digest = hashlib.sha256(f"{search.name}-fisher-{index}".encode()).hexdigest()
    return int(digest[:8], 16)


def _fisher_tasks(run: _Probing, captures: list[Future], cells: list, found: SearchUnits
                  ) -> tuple[list[ProbeTask], Room, list[Future]]:
    """The Fisher chunks of ``cells``, scored on every pass's capture (each chunk on its
    part of them: :func:`_capture_parts`, all returned last), and their room: each holds
    its part too, so the captures' bytes over the chunks are added to its device memory
    where placement counts it (the whole formats' chunks beside them get the same room)."""
    from quantdask.search.fisher_task import fisher_chunk

    search, formats, units = run.search, run.search.format_options(), found.units
    chunks = list(_chunks(cells, search.cells_per_task))
    captured = captured_bytes(search, found)
    log.info("search %s: the Fisher captures hold about %s (%d positions x each unit's in + "
             "out widths, float32), each of %d chunks about 1/%d of it", search.name,
             f"{captured:,} bytes", search.fisher_tokens, len(chunks), len(chunks))
    room = run.room
    if DEVICE_MEMORY in room.resources:
        room = Room({**room.resources,
                     DEVICE_MEMORY: room.resources[DEVICE_MEMORY]
                     + math.ceil(captured / len(chunks))}, room.batch_size)

    def chunk_args(room: Room, attempt: int, chunk: list, parts: list[Future]) -> tuple:
        return (run.model, parts, search.backend, formats, chunk, units, run.faults(attempt))

    parts = [_capture_parts(run, captures, chunk) for chunk in chunks]
    return [run.task(f"fisher chunk {i + 1} of {len(chunks)}", fisher_chunk,
                     functools.partial(chunk_args, chunk=chunk, parts=parts[i]))
            for i, chunk in enumerate(chunks)], room, [p for part in parts for p in part]


def _capture_parts(run: _Probing, captures: list[Future], chunk: list) -> list[Future]:
    """Each pass's capture cut to what ``chunk``'s cells read, by a small task that runs
    where the capture is (Dask places it beside its input): a chunk's worker then fetches
    and holds its units' part (about 1/chunks of the whole), and no worker holds every
    pass's capture (a 1.5B model's: 2.7 GB beside its 6.2 GB model, on each slot)."""
    from quantdask.search.fisher_task import capture_part

    members = [*dict.fromkeys(m for _, modules, _ in chunk for m in modules)]
    return [run.client.submit(capture_part, captured, members, pure=False)
            for captured in captures]


def _assembled(run: _Probing, key: str, done: dict, units, method: MethodChoice) -> Probed:
    """The recorded cells as the allocator takes them: a Fisher cell's score mapped to nats
    by its format's fit (written back into its rows' ``kl``), a KL cell as measured."""
    fits: dict[str, float] = {}
    if method.method == "fisher":
        fits = _fits(run.search, done)
        _write_fitted(run, key, fits)
    measured: dict[str, dict[str, tuple[float, int]]] = {u: {} for u in units.units}
    for (unit, label), row in done.items():
        if unit not in measured or row["bytes"] is None:
            continue
        kl = row["kl"]
        if row["method"] == "fisher" and row["score"] is not None and label in fits:
            kl = fits[label] * row["score"]
        if kl is not None:
            measured[unit][label] = (kl, row["bytes"])
    return Probed(measured, int(done[("", "rest")]["bytes"]), units.param_count, units.units,
                  method, fits, key)


def _fits(search: SearchSpec, done: dict) -> dict[str, float]:
    """Each quantized format's fit: its measured whole-model KL over its cells' summed
    Fisher scores (``fisher.fit_ratio``); a format without both is left out."""
    fits = {}
    for label, options in search.format_options().items():
        if options is None:
            continue
        whole = done.get((ALL_UNITS, label), {}).get("kl")
        summed = math.fsum(row["score"] or 0.0 for (unit, f), row in sorted(done.items())
                           if f == label and unit not in ("", ALL_UNITS)
                           and row["method"] == "fisher")
        ratio = fit_ratio(whole, summed)
        if ratio is not None:
            fits[label] = ratio
    return fits


def _write_fitted(run: _Probing, key: str, fits: dict[str, float]) -> None:
    """Each Fisher chunk's rows with their fitted ``kl`` (the score times its format's fit;
    the standard error left null: the score has none), rewritten where it differs."""
    folder = run.store.frame_dir("sensitivity")
    for path in sorted(folder.glob(f"{run.search.name}-{key}-*.parquet")):
        rows = pl.read_parquet(path)
        if "method" not in rows.columns or not (rows["method"] == "fisher").any():
            continue
        fitted = [{**row, "kl": (fits[row["format"]] * row["score"]
                                 if row["format"] in fits and row["score"] is not None
                                 else row["kl"])}
                  for row in rows.iter_rows(named=True)]
        if any(new["kl"] is not None and (old["kl"] is None or not math.isclose(
                new["kl"], old["kl"], rel_tol=1e-12))
               for new, old in zip(fitted, rows.iter_rows(named=True), strict=True)):
            run.store.write_rows("sensitivity", path.stem, [SensitivityRow(**row)
                                                            for row in fitted])


def _write_chunk(run: _Probing, key: str, chunk: list, part: ProbedChunk, done: dict) -> None:
    """A scored chunk's rows in the sensitivity frame, in a file of their own; the first
    chunk also writes the bytes outside the units (a chunk on disk implies them)."""
    search, model = run.search, run.model.label
    if ("", "rest") not in done:
        done[("", "rest")] = {"kl": 0.0, "bytes": part.rest_bytes, "method": "kl",
                              "score": None}
        run.store.write_rows("sensitivity", f"rest-{search.name}-{key}",
                             [ProbedCell.rest(part.rest_bytes).row(search.name, key, model)])
    rows = [cell.row(search.name, key, model) for cell in part.cells]
    run.store.write_rows("sensitivity", _chunk_name(search.name, key, chunk), rows)
    log.info("search %s: %d cells scored", search.name, len(rows))
    if run.watch.progress is not None:
        run.watch.progress.cells_probed(search.name, len(chunk))


def recorded(store: RunStore, search: str, key: str) -> dict[tuple[str, str], dict]:
    """The cells of ``search`` under ``key`` already recorded: (unit, format) -> its row
    (``kl``, ``bytes``, ``method``, ``score``); the bytes outside the units under
    ("", "rest")."""
    frame = store.read("sensitivity").filter((pl.col("search") == search)
                                              & (pl.col("search_key") == key))
    return {(row["unit"], row["format"]): row for row in frame.iter_rows(named=True)}


def _chunk_name(search: str, key: str, chunk: list) -> str:
    """A chunk's file in the sensitivity frame: named by its cells, so that a rerun's chunks
    (cut from the cells still missing) never replace an earlier run's."""
    cells = json.dumps([(unit, label) for unit, _, label in chunk])
    return f"{search}-{key}-{hashlib.sha256(cells.encode()).hexdigest()[:12]}"


def _chunks(cells: list, size: int) -> Iterator[list]:
    for start in range(0, len(cells), size):
        yield cells[start:start + size]

