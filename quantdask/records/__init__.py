"""The typed records of a run: what a job's phases produce (``records.phases``: the results
columns) and the rows of the secondary frames (``records.rows``), on one shared base
(``records.base``). ``store.schema`` derives every frame's schema from these types, so each
column is declared once, here, with its meaning.

Owns: the record types. Imports: nothing of quantdask's (the bottom layer; every layer may
import it).
"""

from quantdask.records.base import (
    FrameRow,
    PhaseRecord,
    Record,
    ResultRow,
    Row,
    frame_rows,
)
from quantdask.records.phases import (
    Artifact,
    Calibrated,
    Covered,
    Ended,
    GateVerdict,
    InRuntime,
    LayerWeights,
    Loaded,
    NotDone,
    Peaks,
    Quality,
    Quantized,
    Recorded,
    Scored,
    SearchedFor,
    Span,
    Speed,
    Streamed,
    TaskScores,
    Where,
)
from quantdask.records.rows import (
    AllocationRow,
    AttemptRow,
    EnvironmentRow,
    LayerRow,
    PhaseRow,
    RefinementRow,
    SampleRow,
    SensitivityRow,
    SessionRow,
    SpeedAsRead,
    SpeedRow,
    TaskItemRow,
    TaskRow,
    WindowRow,
    WorkerTaskRow,
)

__all__ = [
    "AllocationRow", "Artifact", "AttemptRow", "Calibrated", "Covered", "Ended", "FrameRow",
    "EnvironmentRow", "GateVerdict", "InRuntime", "LayerRow", "LayerWeights", "Loaded",
    "NotDone", "Peaks", "PhaseRecord", "PhaseRow", "Quality", "Quantized", "Record",
    "Recorded", "RefinementRow",
    "ResultRow", "Row", "SampleRow", "Scored", "SearchedFor", "SensitivityRow",
    "SessionRow", "Span", "Speed", "SpeedAsRead", "SpeedRow", "Streamed", "TaskItemRow",
    "TaskRow", "TaskScores", "WindowRow", "WorkerTaskRow", "Where", "frame_rows",
]
