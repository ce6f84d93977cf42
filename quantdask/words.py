"""The words quantdask's frames, sweep files and reports are said in, each vocabulary once.

Every closed set of words (a job's status, why it failed, how an attempt ended, the sweep file's
``artifacts.keep`` and fault kinds, the gate operators, ...) is a ``StrEnum`` here, and every
other module compares against these members, never against a spelled-out string: a typo is then
an ``AttributeError``, never a silent new word. Members are ``str``, so frames, JSON (job ids)
and messages carry the same spellings as before. A leaf: it imports nothing from quantdask, so
every layer (the spec included) may use it.

>>> Status.DONE == "done", f"{FailureClass.OUT_OF_MEMORY}", ", ".join(ArtifactKeep)
(True, 'out_of_memory', 'none, done, pareto')
"""

from __future__ import annotations

from enum import StrEnum

BASELINE = "none"
"""The unquantized baseline's backend name (the ``backend`` column of its rows)."""

NO_FILTER = "none"
"""lm-eval's name for a task's answers taken unfiltered (the tasks frame's ``filter``)."""


class Status(StrEnum):
    """How a job (or one attempt of it) ended."""

    DONE = "done"
    FAILED = "failed"
    SKIPPED = "skipped"  # unsupported here: recorded with the reason, never retried


class AttemptEnd(StrEnum):
    """How one attempt ended (the attempts frame's ``status``): a job's status, or cancelled."""

    DONE = Status.DONE.value
    FAILED = Status.FAILED.value
    SKIPPED = Status.SKIPPED.value
    # Stopped by SweepHandle.cancel(): its job has no result, so the next run of the sweep runs it.
    CANCELLED = "cancelled"


class WorkerTaskEnd(StrEnum):
    """How a task other than a job's attempt ended (the worker_tasks frame's ``status``)."""

    DONE = Status.DONE.value
    FAILED = Status.FAILED.value
    # Its worker died with it: no end was told; its span is from the start it told to when the
    # driver saw its worker gone from the scheduler.
    LOST = "lost"


class WorkerTaskKind(StrEnum):
    """What a task the run schedules on a worker does (the time account: the attempts frame
    holds the jobs' tries, the worker_tasks frame every other kind)."""

    JOB = "job"  # an attempt of a job
    REFERENCE = "reference"  # a part of a model's reference, or the task joining them
    BASELINE_TASKS = "baseline tasks"  # the unquantized model's lm-eval tasks
    SEARCH_UNITS = "search units"  # a search's units, read from its model
    SEARCH_REFERENCE = "search reference"  # a search's calibration reference
    PROBE = "probe"  # a chunk of a search's (unit, format) cells
    FISHER_PASS = "fisher pass"  # a search's forward and backward pass over one batch
    OFFSPRING = "offspring"  # a whole mix of a search's refinement, scored
    CONVERT = "convert"  # a model converted to a runtime's own format (a GGUF), once a sweep


class FailureClass(StrEnum):
    """Why a job failed or was skipped, and so what the driver does about it (``retry``)."""

    UNSUPPORTED = "unsupported"
    OUT_OF_MEMORY = "out_of_memory"
    WORKER_LOST = "worker_lost"
    TIMEOUT = "timeout"
    JOB_ERROR = "job_error"


class PlanState(StrEnum):
    """Where a planned job stands (the plan's ``state``)."""

    TO_RUN = "to run"
    FINISHED = "finished"  # done in the run directory: a rerun skips it
    UNSUPPORTED = FailureClass.UNSUPPORTED.value  # a check says it cannot run here


class KLKind(StrEnum):
    """What a record's ``kl_divergence`` is (column ``kl_kind``)."""

    EXACT = "exact"  # over every token of the vocabulary
    ESTIMATE = "estimate"  # exact over the top k, the tail estimated from samples (unbiased)
    LOWER_BOUND = "lower_bound"  # the tail as one bucket (eval.kl_tail_samples: 0)


class ArtifactKeep(StrEnum):
    """Which done jobs' quantized models a sweep keeps (``artifacts.keep``)."""

    NONE = "none"
    DONE = "done"  # every done job's
    PARETO = "pareto"  # those on each model's size/KL frontier, once the sweep ends


class FaultKind(StrEnum):
    """A fault a sweep injects for tests and demos (``faults[].kind``)."""

    RAISE = "raise"  # an exception in the job
    OOM = "oom"  # CUDA out of memory
    KILL = "kill"  # the worker process killed (SIGKILL)
    HANG = "hang"  # a hang past any deadline
    MEMORY = "memory"  # host memory grown until the worker's nanny restarts it at its limit
    SLOW = "slow"  # a delay only: the attempt then runs as usual


class GateOperator(StrEnum):
    """How a gate compares a figure with its threshold (``gates``); longest spellings first."""

    LE = "<="
    GE = ">="
    LT = "<"
    GT = ">"
