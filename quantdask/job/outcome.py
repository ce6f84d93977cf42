"""What one attempt brings back to the driver, typed.

The words its outcome is said in (GUIDE's failure table: ``Status``, ``FailureClass``, and
``AttemptEnd`` for the attempts frame) are defined once in ``quantdask.words``; ``Status`` and
``FailureClass`` are importable from here too. ``JobOutcome`` is the row an attempt adds to the
attempts and results frames, and beside it what is stored elsewhere (per-layer rows, the
worker's device samples, the attempt's log), so that no layer has to pop transport keys out of
a dict. What each phase adds to the row and to the frames is typed in ``records``.

>>> Status.DONE == "done", f"{FailureClass.OUT_OF_MEMORY}"
(True, 'out_of_memory')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from quantdask.errors import JobTimeout
from quantdask.records import Ended, NotDone, PhaseRecord, ResultRow, Row, Where
from quantdask.util import utcnow
from quantdask.words import AttemptEnd, FailureClass, Status

RecordT = TypeVar("RecordT", bound=PhaseRecord)


_ALLOCATION_FAILED = ("out of memory", "can't allocate memory", "cannot allocate memory")


def failure_class_of(error: BaseException) -> FailureClass:
    """``timeout`` for a deadline, ``out_of_memory`` for an allocation failure on any device,
    else ``job_error``.

    >>> failure_class_of(MemoryError()), failure_class_of(ValueError("bad"))
    (<FailureClass.OUT_OF_MEMORY: 'out_of_memory'>, <FailureClass.JOB_ERROR: 'job_error'>)
    """
    import torch

    if isinstance(error, JobTimeout):
        return FailureClass.TIMEOUT
    if isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)):
        return FailureClass.OUT_OF_MEMORY
    message = str(error).lower()
    if any(words in message for words in _ALLOCATION_FAILED):
        return FailureClass.OUT_OF_MEMORY
    return FailureClass.JOB_ERROR


@dataclass
class JobOutcome:
    """One attempt's outcome, made by ``run_job`` on a worker or by the driver when the attempt
    ended outside it (its worker lost, its deadline passed, no worker left).

    ``records`` are what it produced, typed (``records``): where it ran (``Where``), how it
    ended (``Ended``), and the phases' records when done or why not (``NotDone``); ``record``
    is their flat columns, as the results and attempts frames hold them.
    """

    records: tuple[PhaseRecord, ...]
    device_samples: list[Row] = field(default_factory=list)
    log: str = ""  # the attempt's own log lines (empty when it ended outside the job)
    # Whether ``log`` is every line the attempt logged (run_job's): it then replaces the lines
    # its worker sent while it ran (process.live_log); else those stay, and ``log`` follows.
    whole_log: bool = False

    @property
    def record(self) -> ResultRow:
        """The flat columns of its records (``status``; the measurements when done;
        ``failure_class``, ``error_class``, ``error_message``, ``traceback`` when not; where
        and when it ran)."""
        columns: ResultRow = {}
        for record in self.records:
            columns.update(record.columns())
        return columns

    @property
    def rows(self) -> dict[str, list[Row]]:
        """A done attempt's rows of the per-job frames, by frame name (``store.schema.FRAMES``),
        from its records: the frames of the phases that ran, each written by the recorder with
        the job's result."""
        rows: dict[str, list[Row]] = {}
        for record in self.records:
            rows.update(record.rows())
        return rows

    def find(self, kind: type[RecordT]) -> RecordT | None:
        """Its record of type ``kind``, or None."""
        return next((r for r in self.records if isinstance(r, kind)), None)

    @property
    def status(self) -> Status:
        ended = self.find(Ended)
        if ended is None:
            raise ValueError("an outcome without its Ended record")
        return Status(ended.status)

    @property
    def failure_class(self) -> FailureClass | None:
        not_done = self.find(NotDone)
        value = None if not_done is None else not_done.failure_class
        return None if value is None else FailureClass(value)

    @classmethod
    def cancelled(cls, job_id: str, number: int, worker: str | None) -> JobOutcome:
        """The outcome of attempt ``number`` of ``job_id`` that ``SweepHandle.cancel()``
        stopped (the next run of the sweep runs the job again)."""
        return cls.outside(None, "Cancelled", "cancelled by SweepHandle.cancel()",
                           worker=worker, status=AttemptEnd.CANCELLED, log=(
                               f"{utcnow().isoformat()} WARNING {job_id} attempt={number} "
                               "cancelled by SweepHandle.cancel(); the next run of the sweep "
                               "runs it again\n"))

    @classmethod
    def outside(cls, failure_class: FailureClass | None, error_class: str, message: str,
                tb: str = "", worker: str | None = None, status: str = Status.FAILED,
                log: str = "") -> JobOutcome:
        """The outcome of an attempt that ended outside ``run_job``."""
        return cls((Where(worker, None, None), Ended(status, utcnow()),
                    NotDone(failure_class, error_class, message, tb or None)), log=log)
