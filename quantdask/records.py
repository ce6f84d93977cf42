"""What each phase of a job produces, typed: the columns it adds to the job's results row and the
rows it adds to the secondary frames.

A phase returns one :class:`PhaseRecord` (a frozen dataclass): its plain fields are results
columns, a field made with :func:`frame_rows` holds rows of the frame it names, and a field
whose type is another record contributes that record's columns (the quality figures inside
the score's record). ``run_job`` assembles the row from the records of the phases that ran;
``tests/test_store.py`` checks from the return annotations that every results column comes
from exactly one place, so a misspelt column is a failing test, not a missing column in a
report.

>>> Loaded(load_s=0.5, source_cached=True, param_count=10).columns()
{'load_s': 0.5, 'source_cached': True, 'param_count': 10}
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quantdask.measure.usage import PeakMemory

Row = dict[str, Any]
"""One row of a secondary frame (the store checks it against the frame's schema)."""
ResultRow = dict[str, Any]
"""A job's flat row of the results frame, assembled from its phases' records (the store checks
it against the results schema)."""

_FRAME = "quantdask.frame"


def frame_rows(frame: str) -> Any:
    """A record field holding rows of the secondary frame ``frame`` (``store.schema.FRAMES``)."""
    return dataclasses.field(default_factory=list, metadata={_FRAME: frame})


@dataclasses.dataclass(frozen=True)
class PhaseRecord:
    """Base of the phases' records (see the module)."""

    def columns(self) -> ResultRow:
        """Its results columns, nested records' flattened in."""
        columns: ResultRow = {}
        nested = type(self).nested()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if _FRAME in f.metadata:
                continue
            if isinstance(value, PhaseRecord):
                columns.update(value.columns())
            elif f.name in nested:
                columns.update(dict.fromkeys(nested[f.name].column_names()))
            else:
                columns[f.name] = value
        return columns

    def rows(self) -> dict[str, list[Row]]:
        """Its rows of secondary frames, by frame name."""
        return {f.metadata[_FRAME]: list(getattr(self, f.name))
                for f in dataclasses.fields(self) if _FRAME in f.metadata}

    @classmethod
    def nested(cls) -> dict[str, type[PhaseRecord]]:
        """Fields that hold another record (or None: its columns then null)."""
        return _nested_fields(cls)

    @classmethod
    def column_names(cls) -> tuple[str, ...]:
        """The results columns a record of this type fills."""
        nested, names = cls.nested(), list[str]()
        for f in dataclasses.fields(cls):
            if _FRAME in f.metadata:
                continue
            names += nested[f.name].column_names() if f.name in nested else [f.name]
        return tuple(names)

    @classmethod
    def frame_names(cls) -> tuple[str, ...]:
        """The secondary frames a record of this type fills."""
        return tuple(f.metadata[_FRAME] for f in dataclasses.fields(cls) if _FRAME in f.metadata)


@dataclasses.dataclass(frozen=True)
class Where(PhaseRecord):
    """Where and when an attempt ran: kept whatever became of it."""

    worker: str | None
    host: str | None
    started_at: dt.datetime | None
    device: str | None = None


@dataclasses.dataclass(frozen=True)
class Peaks(PhaseRecord):
    """Peak device memory (allocated, reserved) and host RSS over a block (see
    ``measure.PeakMemory``); ``peak_shared``: other jobs on the worker ran meanwhile."""

    peak_device_mem_bytes: int
    peak_device_reserved_bytes: int
    peak_host_rss_bytes: int
    peak_shared: bool = False

    @classmethod
    def of(cls, peak: PeakMemory) -> Peaks:
        return cls(peak.peak_device_bytes, peak.peak_reserved_bytes, peak.peak_rss_bytes,
                   peak.shared)

    def max(self, other: Peaks) -> Peaks:
        """The larger of each figure (shared if either was)."""
        return Peaks(max(self.peak_device_mem_bytes, other.peak_device_mem_bytes),
                     max(self.peak_device_reserved_bytes, other.peak_device_reserved_bytes),
                     max(self.peak_host_rss_bytes, other.peak_host_rss_bytes),
                     self.peak_shared or other.peak_shared)


@dataclasses.dataclass(frozen=True)
class Span(PhaseRecord):
    """The whole attempt's wall time and peaks (a baseline's include its reference's), and
    each phase's own time and peaks (the phases frame)."""

    wall_s: float
    peaks: Peaks
    phases: list[Row] = frame_rows("phases")


@dataclasses.dataclass(frozen=True)
class Loaded(PhaseRecord):
    """The ``load`` phase: the model's source and its mapped weights."""

    load_s: float
    source_cached: bool
    param_count: int


@dataclasses.dataclass(frozen=True)
class Calibrated(PhaseRecord):
    """A calibrated backend's data-driven step, inside the quantize phase."""

    calibrate_s: float
    calibrate_peak_device_mem_bytes: int
    calibrate_peak_host_rss_bytes: int


@dataclasses.dataclass(frozen=True)
class Quantized(PhaseRecord):
    """The ``quantize`` phase (``calibration``: None for a backend that does not calibrate)."""

    quantize_s: float
    calibration: Calibrated | None = None


@dataclasses.dataclass(frozen=True)
class Streamed(PhaseRecord):
    """A streamed job's pass (``stream.streamed_job``): its layers read from the checkpoint
    one at a time."""

    quantized: Quantized  # its quantize_s: reading and quantizing the layers
    streamed: bool
    stream_bytes_read: int
    stream_layer_s: float
    stream_skipped: str


@dataclasses.dataclass(frozen=True)
class Covered(PhaseRecord):
    """The ``check_coverage`` phase: what was quantized, and the stored size split."""

    size_bytes: int
    bits_per_weight: float
    quantized_bytes: int
    bits_per_quantized_weight: float | None
    unquantized_bytes: int
    unquantized_dtypes: str
    quantized_params: int
    quantized_share: float
    full_precision: str | None


@dataclasses.dataclass(frozen=True)
class LayerWeights(PhaseRecord):
    """The ``layer_weights`` phase: how many quantized layers could not be measured."""

    layers_unmeasured: int


@dataclasses.dataclass(frozen=True)
class Quality(PhaseRecord):
    """Perplexity, KL, top-1 and the correct token's probability change, with their standard
    errors (``measure.statistics.quality_figures``; docs/quality.md)."""

    perplexity: float
    ln_ppl_se: float | None
    kl_divergence: float
    kl_se: float | None
    kl_median: float
    kl_p90: float
    kl_p99: float
    kl_p999: float
    kl_max: float
    top1_agreement: float
    top1_agreement_se: float | None
    eval_tokens: int
    delta_p_mean: float | None
    delta_p_se: float | None
    delta_p_rms: float | None
    delta_p_p01: float | None
    delta_p_p05: float | None
    delta_p_median: float | None
    delta_p_p95: float | None
    delta_p_p99: float | None
    ln_ppl_ratio: float | None
    ln_ppl_ratio_se: float | None


@dataclasses.dataclass(frozen=True)
class Scored(PhaseRecord):
    """The ``score`` phase: the quality figures against the reference, per window too, and the
    per-layer rows (weight errors, with the output errors measured during its passes)."""

    eval_s: float
    quality: Quality
    kl_kind: str
    kl_tail_mass: float
    windows: list[Row] = frame_rows("windows")
    layers: list[Row] = frame_rows("layers")


@dataclasses.dataclass(frozen=True)
class TaskScores(PhaseRecord):
    """The ``score_tasks`` phase (a sweep with a tasks block)."""

    tasks_s: float
    tasks_peak_device_mem_bytes: int
    tasks_peak_host_rss_bytes: int
    tasks_truncated_samples: int
    tasks_error: str | None = None  # the baseline's: why its tasks have no scores
    tasks: list[Row] = frame_rows("tasks")


@dataclasses.dataclass(frozen=True)
class Speed(PhaseRecord):
    """The ``time_generation`` phase (a sweep with a speed block)."""

    speed_s: float
    speed: list[Row] = frame_rows("speed")


@dataclasses.dataclass(frozen=True)
class Artifact(PhaseRecord):
    """The ``keep_artifacts`` phase: the saved model, or why it could not be saved."""

    artifact_uri: str | None = None
    artifact_bytes: int | None = None
    artifact_sha256: str | None = None
    artifact_kept: bool | None = None
    reload_kl_delta: float | None = None
    artifact_error: str | None = None


@dataclasses.dataclass(frozen=True)
class NotDone(PhaseRecord):
    """Why an attempt did not finish: its class, and the exception's type, message and
    traceback."""

    status: str
    failure_class: str
    error_class: str
    error_message: str
    traceback: str | None = None


_NESTED: dict[str, dict[str, type[PhaseRecord]]] = {}


def _nested_fields(record_type: type[PhaseRecord]) -> dict[str, type[PhaseRecord]]:
    """``PhaseRecord.nested``, read from the type hints once per record type (every job
    assembles its row through it)."""
    key = f"{record_type.__module__}.{record_type.__qualname__}"
    if key in _NESTED:
        return _NESTED[key]
    nested = {}
    for name, hint in typing.get_type_hints(record_type).items():
        for kind in typing.get_args(hint) or (hint,):
            if (isinstance(kind, type) and typing.get_origin(kind) is None
                    and issubclass(kind, PhaseRecord)):
                nested[name] = kind
    _NESTED[key] = nested
    return nested
