"""Sweep specs: what to quantize, how, and how to evaluate it; grid expansion; job ids.

A sweep is validated completely when it is built, so a bad field fails before any job runs.

>>> sweep = Sweep(
...     name="demo",
...     models=[ModelSpec(path="data/demo-model")],
...     backends=[BackendBlock("bitsandbytes", grid={"bits": [4], "quant_type": ["nf4", "fp4"]})],
...     eval=EvalSettings(text="data/demo/eval.txt"),
... )
>>> [job.config_label for job in expand_grid(sweep)]
['baseline', 'nf4', 'fp4']
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from quantdask.backends import BASELINE, BackendOptions, get_backend
from quantdask.backends.capabilities import Calibrated
from quantdask.errors import SpecError
from quantdask.sweepfile.bos import window_bos
from quantdask.sweepfile.fields import NAME, keyed, positive_int, require
from quantdask.sweepfile.gates import Gate, parse_gates
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.search import SearchRole, SearchSpec, check_searches
from quantdask.sweepfile.settings import ArtifactSettings, CalibrationSettings, EvalSettings
from quantdask.sweepfile.speed import SpeedSettings
from quantdask.sweepfile.tasks import TaskSettings
from quantdask.words import FaultKind

log = logging.getLogger("quantdask.spec")

SIXTEEN_BIT_DTYPES = frozenset({"bfloat16", "float16"})
"""The dtypes whose model's reference ``eval.reference_dtype: float32`` computes in float32."""
DEVICE_MEMORY = "DEVICE_MEMORY"
"""The Dask resource a worker advertises for its device's memory in bytes (``dask worker
--resources GPU=1,DEVICE_MEMORY=80e9``, or measured by the ``quantdask.preload`` preload)."""


@dataclass(frozen=True)
class BackendBlock:
    """Configs of one backend: the cartesian product of ``grid`` plus explicit ``configs``."""

    backend: str
    grid: dict[str, list] = field(default_factory=dict)
    configs: list[dict] = field(default_factory=list)
    priority: int | None = None
    _option_sets: list[BackendOptions] = field(default_factory=list, init=False, repr=False,
                                               compare=False)  # set by __post_init__

    def __post_init__(self):
        backend = get_backend(self.backend, "backend")
        if self.backend == BASELINE:
            raise SpecError("backend", "the unquantized baseline is part of every sweep; "
                                       "remove this block")
        require("grid", self.grid, dict, "a mapping of option to a list of values")
        require("configs", self.configs, (list, tuple), "a list of option mappings")
        if not self.grid and not self.configs:
            raise SpecError("grid", "empty: give `grid` (option: [values]) and/or `configs`")
        for name, values in self.grid.items():
            if not isinstance(values, (list, tuple)):
                raise SpecError(f"grid.{name}", f"must be a list of values, got {values!r}")
            if not values:
                raise SpecError(f"grid.{name}", "is an empty list; give at least one value")
        if self.priority is not None:
            require("priority", self.priority, int, "an integer")
        # Normalizing validates every option; the result is cached for expand_grid.
        object.__setattr__(self, "_option_sets", [
            backend.normalize(options, where) for options, where in self._raw_option_sets()
        ])

    def _raw_option_sets(self):
        names = list(self.grid)
        for values in itertools.product(*(self.grid[n] for n in names)):
            if names:
                yield dict(zip(names, values)), "grid"
        for i, options in enumerate(self.configs):
            yield options, f"configs[{i}]"

    def option_sets(self) -> list[BackendOptions]:
        """Every canonical (validated, defaults filled) option set of this block."""
        return list(self._option_sets)


@dataclass(frozen=True)
class Sweep:
    """Models x backend configs, with evaluation and scheduling settings."""

    name: str
    models: list[ModelSpec]
    backends: list[BackendBlock]
    eval: EvalSettings
    seed: int = 0
    retries: int = 2
    timeout_s: float = 3600.0
    priority: int = 0
    jobs_per_gpu: int = 1
    retry_backoff_s: float = 2.0
    exclude_device_after: int = 3
    faults: list[dict] = field(default_factory=list)
    layer_stats: bool = True  # per-layer weight and output errors (cost: docs/results.md)
    calibration: CalibrationSettings | None = None  # data for the calibrated backends
    artifacts: ArtifactSettings | None = None  # which quantized models are kept, and where
    tasks: TaskSettings | None = None  # lm-eval task accuracy of every job (sweepfile.tasks)
    gates: list[str | dict | Gate] = field(default_factory=list)  # thresholds (sweepfile.gates)
    speed: SpeedSettings | None = None  # generation speed of every job (sweepfile.speed)
    searches: list[SearchSpec] = field(default_factory=list)  # mixed precision (sweepfile.search)
    # auto: a job whose model does not fit resident streams its layers (placement decides);
    # always: every job streams; never: a model that does not fit is refused (stream.streaming)
    stream: str = "auto"

    def __post_init__(self):
        if not (isinstance(self.name, str) and NAME.match(self.name)):
            raise SpecError("name", f"must be letters, digits, '.', '_' or '-', got {self.name!r}")
        for attr, kind, what in (("models", ModelSpec, "model"),
                                 ("backends", BackendBlock, "backend block")):
            items = getattr(self, attr)
            require(attr, items, (list, tuple), f"a non-empty list of {what}s")
            if not items and not (attr == "backends" and self.searches):
                raise SpecError(attr, f"is empty; give at least one {what}")
            for i, item in enumerate(items):
                require(f"{attr}[{i}]", item, kind, f"a {kind.__name__}")
            object.__setattr__(self, attr, tuple(items))
        labels = [m.label for m in self.models]
        for i, label in enumerate(labels):
            if labels.index(label) != i:
                raise SpecError(f"models[{i}].name", f"two models are named {label!r}; "
                                                     "give each a distinct `name`")
        identities = [json.dumps(m.identity(), sort_keys=True) for m in self.models]
        for i, identity in enumerate(identities):
            first = identities.index(identity)
            if first != i:  # same files, dtype and code: the same jobs, which would run once
                raise SpecError(f"models[{i}]", f"is the same model as models[{first}] "
                                                f"({labels[first]!r}: the same files and dtype), "
                                                "so its jobs would run only once; remove one")
        require("eval", self.eval, EvalSettings, "the eval settings")
        require("seed", self.seed, int, "an integer")
        if not 0 <= self.seed < 2**63:
            raise SpecError("seed", f"must be between 0 and 2**63 - 1, got {self.seed}")
        require("retries", self.retries, int, "an integer >= 0")
        if self.retries < 0:
            raise SpecError("retries", f"must be an integer >= 0, got {self.retries}")
        require("timeout_s", self.timeout_s, (int, float), "a number of seconds > 0")
        if not self.timeout_s > 0 or self.timeout_s == float("inf"):  # also rejects NaN
            raise SpecError("timeout_s", f"must be a finite number of seconds > 0, "
                                         f"got {self.timeout_s}")
        require("priority", self.priority, int, "an integer")
        positive_int("jobs_per_gpu", self.jobs_per_gpu)
        require("retry_backoff_s", self.retry_backoff_s, (int, float), "a number of seconds >= 0")
        if self.retry_backoff_s < 0:
            raise SpecError("retry_backoff_s", f"must be >= 0, got {self.retry_backoff_s}")
        positive_int("exclude_device_after", self.exclude_device_after)
        require("layer_stats", self.layer_stats, bool, "true or false")
        if self.stream not in STREAM_CHOICES:
            raise SpecError("stream", f"must be {', '.join(STREAM_CHOICES)}, got {self.stream!r}")
        self._check_blocks(labels)
        object.__setattr__(self, "faults", tuple(self._checked_faults()))

    @property
    def checked_gates(self) -> tuple[Gate, ...]:
        """The gates as ``__post_init__`` parsed them (the field takes strings and dicts)."""
        return cast("tuple[Gate, ...]", self.gates)

    def check_workers(self, elsewhere: str | None) -> None:
        """The checks that depend on where the workers run, made before anything runs: by
        ``run.sweep.start_session`` (every ``submit_sweep`` and ``run_sweep``) and by
        ``quantdask run`` before it connects. ``elsewhere`` names what may put the workers on
        other machines (``--scheduler``, ``the scheduler at tcp://...``); None when they all
        run on this one.

        >>> sweep.check_workers("--scheduler")  # doctest: +SKIP
        Traceback (most recent call last):
        quantdask.errors.SpecError: artifacts.to: models is a local path, and workers of ...
        """
        artifacts = self.artifacts
        if elsewhere and artifacts is not None and artifacts.enabled \
                and not artifacts.is_url and not artifacts.shared:
            raise SpecError("artifacts.to", f"{artifacts.to} is a local path, and workers of "
                            f"{elsewhere} may be on other machines, each writing to its own "
                            "disk: give a directory every worker shares and set "
                            "artifacts.shared: true, or an fsspec URL (s3://bucket/prefix)")

    def eval_for(self, model: ModelSpec) -> EvalSettings:
        """The eval settings of ``model``'s jobs: ``eval.bos`` resolved with its tokenizer
        (``sweepfile.bos``; refused here, before anything runs, where it cannot apply), and
        ``eval.reference_dtype`` with the dtype it loads in."""
        float32 = (self.eval.reference_dtype == "float32"
                   and model.loaded_dtype() in SIXTEEN_BIT_DTYPES)
        return self.eval.with_bos(window_bos(self.eval.bos, model), float32)

    def check_searches_resident(self, jobs: list[Job]) -> None:
        """Refuse a search whose model streams (``stream: always``, or placement found it fits
        no worker resident): its probes hold the whole model on a worker."""
        streamed = {job.model.label for job in jobs if job.streamed}
        for i, search in enumerate(self.searches):
            if search.model in streamed:
                why = ("the sweep says stream: always" if self.stream == "always"
                       else "it fits no worker resident")
                raise SpecError(f"searches[{i}].model",
                                f"{search.model!r} streams one decoder layer at a time ({why}), "
                                "and a search's probes hold the whole model on a worker: search it "
                                "on workers whose memory holds it (with stream: auto), or drop the "
                                "search")

    def _check_blocks(self, labels: list[str]) -> None:
        """The optional blocks: calibration (with the backends that need it), artifacts,
        tasks, speed and the gates."""
        for name, kind in (("calibration", CalibrationSettings), ("artifacts", ArtifactSettings),
                           ("tasks", TaskSettings), ("speed", SpeedSettings)):
            if getattr(self, name) is not None:
                require(name, getattr(self, name), kind, f"the {name} settings")
        object.__setattr__(self, "gates", parse_gates(
            self.gates, set(labels), self.tasks.names if self.tasks else None))
        require("searches", self.searches, (list, tuple), "a list of searches")
        object.__setattr__(self, "searches", tuple(
            SearchSpec(**search) if isinstance(search, dict) else search
            for search in self.searches))
        check_searches(list(self.searches), labels, self.calibration)
        calibrated = [get_backend(b.backend).calibrated for b in self.backends]
        if self.calibration is not None and not any(calibrated) and not self.searches:
            log.warning("calibration: no backend of this sweep calibrates on data (autoround "
                        "does), so the calibration block is not used; remove it, or add such "
                        "a backend")
        for i, block in enumerate(self.backends):
            backend = get_backend(block.backend)
            if self.calibration is None and calibrated[i] and any(
                    backend.calibrates(options) for options in block.option_sets()):
                raise SpecError(f"backends[{i}].backend", Calibrated.needs_block(block.backend))

    def _checked_faults(self):
        require("faults", self.faults, (list, tuple), "a list of fault mappings")
        labels = {"baseline"} | {get_backend(b.backend).config_label(o)
                                 for b in self.backends for o in b.option_sets()}
        labels |= {label for search in self.searches
                   for label in (search_fault_label(search.name),
                                 f"{search_fault_label(search.name)}:refine")}
        models = {m.label for m in self.models}
        for i, fault in enumerate(self.faults):
            where = f"faults[{i}]"
            keyed(where, fault, ("config", "kind", "attempt", "model"),
                  "a mapping with config, kind and optionally attempt and model")
            if fault.get("config") not in labels:
                raise SpecError(f"{where}.config", f"no job has config label "
                                f"{fault.get('config')!r}; labels: {', '.join(sorted(labels))}")
            if fault.get("kind") not in tuple(FaultKind):
                raise SpecError(f"{where}.kind", f"must be one of {', '.join(FaultKind)}, "
                                                 f"got {fault.get('kind')!r}")
            if "model" in fault and fault["model"] not in models:
                raise SpecError(f"{where}.model", f"no model is named {fault['model']!r}; "
                                                  f"models: {', '.join(sorted(models))}")
            positive_int(f"{where}.attempt", fault.get("attempt", 1))
            yield {"attempt": 1, **fault, "kind": FaultKind(fault["kind"])}


STREAM_CHOICES = ("auto", "always", "never")


def search_fault_label(search: str) -> str:
    """The ``faults[].config`` that injects a fault into every probe chunk of ``search``."""
    return f"search:{search}"


@dataclass(frozen=True)
class Job:
    """One (model, config) pair of a sweep: what a worker runs. ``id`` is deterministic."""

    id: str
    sweep: str
    model: ModelSpec
    backend: str
    options: BackendOptions  # the backend's options dataclass; as_dict() is in the id
    config_label: str
    eval: EvalSettings
    seed: int
    priority: int
    retries: int
    timeout_s: float
    gpu_share: float
    faults: tuple[tuple[int, FaultKind], ...] = ()  # (attempt, kind) to inject; not in the id
    # Estimated device memory it needs (0: unknown, or placement by memory is off); set by
    # ``placement.place_jobs`` for the cluster at hand, not part of the id.
    device_memory_bytes: int = 0
    layer_stats: bool = True  # measure per-layer errors; not part of the id
    # The sweep's calibration data, on every job so that a model's jobs share one reference
    # (which carries its tokens); part of the id only for calibrated backends.
    calibration: CalibrationSettings | None = None
    artifacts: ArtifactSettings | None = None  # keep the quantized model; not part of the id
    tasks: TaskSettings | None = None  # lm-eval tasks to score; part of the id when given
    speed: SpeedSettings | None = None  # generation to time; part of the id when given
    search: SearchRole | None = None  # the search that made it a candidate; not in the id
    # Its decoder layers read from the checkpoint and run one at a time (stream.streamed_job):
    # the same figures, so not in the id; set by the sweep's ``stream`` and by placement.
    streamed: bool = False

    @property
    def is_baseline(self) -> bool:
        return self.backend == BASELINE

    @property
    def resources(self) -> dict[str, float]:
        """Dask resources one attempt holds while it runs: its share of a GPU and, when known,
        its device memory (workers advertise theirs as ``DEVICE_MEMORY``)."""
        if self.device_memory_bytes:
            return {"GPU": self.gpu_share, DEVICE_MEMORY: float(self.device_memory_bytes)}
        return {"GPU": self.gpu_share}


def job_identity(model: ModelSpec, backend: str, options: BackendOptions, eval: EvalSettings,
                 seed: int, calibration: CalibrationSettings | None = None,
                 tasks: TaskSettings | None = None, speed: SpeedSettings | None = None) -> dict:
    """The canonical job spec: every field that changes what the job measures, nothing else
    (``calibration`` only for a backend that calibrates; ``tasks`` and ``speed`` only when
    given, so a sweep without them keeps its ids)."""
    identity = {"model": model.identity(), "backend": backend, "options": options.as_dict(),
                "eval": eval.identity(), "seed": seed}
    if calibration is not None:
        identity["calibration"] = calibration.identity()
    if tasks is not None:
        identity["tasks"] = tasks.identity()
    if speed is not None:
        identity["speed"] = speed.identity()
    return identity


def job_id(identity: dict) -> str:
    """``<backend>-<16 hex>``: a sha256 of the canonical JSON of ``identity``.

    The backend prefix groups a sweep's tasks by backend in the Dask dashboard.
    """
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{identity['backend']}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


def expand_grid(sweep: Sweep) -> list[Job]:
    """Every job of ``sweep``: per model, the baseline first, then each block's configs.

    Configs that normalize to the same options (given twice, or once with defaults spelled
    out) are one job.
    """
    jobs: dict[str, Job] = {}
    for model in sweep.models:
        # The baseline is what every config is compared to: it goes first.
        entries = [(BASELINE, get_backend(BASELINE).normalize({}, "options"), sweep.priority + 1)]
        for block in sweep.backends:
            priority = sweep.priority if block.priority is None else block.priority
            entries += [(block.backend, options, priority) for options in block.option_sets()]
        for backend, options, priority in entries:
            job = make_job(sweep, model, backend, options, priority)
            jobs.setdefault(job.id, job)
    return list(jobs.values())


def make_job(sweep: Sweep, model: ModelSpec, backend: str, options: BackendOptions,
             priority: int, config_label: str | None = None,
             search: SearchRole | None = None) -> Job:
    """The job of ``model`` quantized by ``backend`` with ``options`` in ``sweep`` (its
    ``config_label`` the backend's label unless given; ``search``: the search that made it)."""
    # A job timing generation holds its whole device: packed jobs would time each other.
    share = 1.0 if sweep.speed is not None else 1.0 / sweep.jobs_per_gpu
    calibration = sweep.calibration if get_backend(backend).calibrates(options) else None
    evaluation = sweep.eval_for(model)
    identity = job_identity(model, backend, options, evaluation, sweep.seed, calibration,
                            sweep.tasks, sweep.speed)
    label = config_label or get_backend(backend).config_label(options)
    return Job(
        id=job_id(identity), sweep=sweep.name, model=model, backend=backend, options=options,
        config_label=label, eval=evaluation, seed=sweep.seed, priority=priority,
        retries=sweep.retries, timeout_s=float(sweep.timeout_s), gpu_share=share,
        layer_stats=sweep.layer_stats, calibration=sweep.calibration,
        artifacts=sweep.artifacts, tasks=sweep.tasks, speed=sweep.speed, search=search,
        streamed=sweep.stream == "always",
        faults=tuple((f["attempt"], f["kind"]) for f in sweep.faults
                     if f["config"] == label and f.get("model", model.label) == model.label),
    )


def start_rank(job: Job) -> int:
    """The sort key of the order jobs start in, as Dask's scheduler starts them: the higher
    ``priority`` first; a stable sort keeps the given order (``expand_grid``'s, the order
    they are submitted in) among equals. ``start_order`` sorts by it; so does the driver when
    it submits the jobs that waited for their model's reference."""
    return -job.priority


def start_order(jobs: Iterable[Job]) -> list[Job]:
    """``jobs`` in the order they start (``start_rank``): the plan's order.

    >>> [job.config_label for job in start_order(expand_grid(sweep))]  # doctest: +SKIP
    ['baseline', 'nf4', 'fp4']
    """
    return sorted(jobs, key=start_rank)


def plan_rows(jobs: list[Job]) -> list[dict[str, Any]]:
    """Plain rows describing planned jobs (what ``quantdask plan`` prints and jobs.json holds)."""
    return [
        {"job_id": j.id, "model": j.model.label, "backend": j.backend,
         "config_label": j.config_label, "config": json.dumps(j.options.as_dict(), sort_keys=True),
         "priority": j.priority, "gpu_share": j.gpu_share}
        for j in start_order(jobs)
    ]
