"""What a CPU slot offers jobs: the memory its nanny lets the worker process reach, less what
the process holds at rest.

Dask's nanny restarts a worker whose resident memory passes the terminate fraction
(``distributed.worker.memory.terminate``, 95%) of its ``memory_limit``, and the worker process
holds part of that before any job starts: the interpreter, torch, transformers and
bitsandbytes, the modules and caches a first job leaves behind. A slot that offered its whole
limit let a job in whose estimate sat within 1% of the kill line (issue 54), so a CPU slot
advertises ``terminate x limit - resting`` as its device memory (``DEVICE_MEMORY``), with
``resting`` its own RSS measured as it starts (``quantdask.preload``), and each job's estimate
counts what the job adds to the process.

>>> slot = SlotMemory.of(limit=1600 * 2**20, terminate=0.95, resting=470 * 2**20)
>>> slot.offered // 2**20, slot.kill_line // 2**20
(1050, 1520)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from quantdask.util import malloc_trim

METRIC = "quantdask_slot_memory"
"""The worker metric (``Worker.metrics``, sent to the scheduler with every heartbeat) under
which a CPU slot reports its :class:`SlotMemory`; the driver reads it from
``scheduler_info()``."""

FIRST_JOB_BYTES = 96 * 2**20
"""What a slot's first job adds to the process for good, beside its own memory: the pages of
torch's and transformers' libraries its code runs in (mapped at import, faulted in on first
use, counted in RSS), the modules a model's family and a backend import, the model's config
and tokenizer kept between jobs. Measured (benchmarks/RESULTS.md section 18): a slot forked
from the warm server rests at 362-372 MiB as it starts and at 442-471 MiB after its first
sweep, freed memory released; counted in the resting memory, so no job's estimate carries it."""


@dataclass(frozen=True)
class SlotMemory:
    """A CPU slot's memory as its nanny sees it: Dask's ``limit`` (bytes), the ``terminate``
    fraction past which the nanny restarts the worker, the worker's ``resting`` RSS (bytes),
    and what that leaves jobs (``offered``)."""

    limit: int
    terminate: float
    resting: int
    offered: int

    @classmethod
    def of(cls, limit: int, terminate: float, resting: int) -> SlotMemory:
        """The slot's figures, ``offered`` derived (never below 0)."""
        return cls(limit, terminate, resting, max(0, int(terminate * limit) - resting))

    @property
    def kill_line(self) -> int:
        """The RSS past which the nanny restarts the worker."""
        return int(self.terminate * self.limit)

    def describe(self) -> str:
        """How the offer is made, in words."""
        from quantdask.util import format_bytes

        return (f"a CPU slot whose nanny restarts it past {self.terminate:.0%} of its "
                f"{format_bytes(self.limit)} memory limit, at {format_bytes(self.kill_line)}, "
                f"less the {format_bytes(self.resting)} it holds at rest")

    def as_metric(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_metric(cls, metric: Any) -> SlotMemory | None:
        """The figures a worker reported (None: none, or not in this form)."""
        try:
            return cls(**metric)
        except TypeError:
            return None


def terminate_fraction() -> float:
    """Dask's terminate fraction as the nanny reads it (False, no restarts: the whole limit)."""
    import dask

    fraction = dask.config.get("distributed.worker.memory.terminate")
    return float(fraction) if fraction else 1.0


def release_memory() -> None:
    """Free what a finished task left: the garbage only the cycle collector frees (quantized
    models hold reference cycles: bitsandbytes' parameters point back at their module), then
    the freed heap, back to the OS (glibc keeps freed chunks in its arenas). The nanny counts
    both in the worker's RSS: left, they are the next job's, which the nanny may kill for
    them. The collection runs only in a process whose startup objects are frozen
    (``freeze_startup_objects``: a worker started with quantdask's preload), where it costs a
    few milliseconds; elsewhere (a job run in a notebook's or a test's process) it walked the
    whole heap and doubled the test suite's time, and no nanny counts
    that process's RSS."""
    import gc

    if gc.get_freeze_count():
        gc.collect()
    trim = malloc_trim()
    if trim is not None:
        trim(0)


def freeze_startup_objects() -> None:
    """Leave the objects of the worker's imports out of every later collection (``gc.freeze``):
    they live as long as the process, and a full collection over them took 0.17 s, which
    ``release_memory`` would pay at every task's end; after this, a few milliseconds."""
    import gc

    gc.collect()
    gc.freeze()


def resting_rss() -> int:
    """This process's resident memory at rest (its freed memory released first), and what a
    first job adds for good (``FIRST_JOB_BYTES``)."""
    import psutil

    release_memory()
    return int(psutil.Process().memory_info().rss) + FIRST_JOB_BYTES


def slot_memory(limit: int) -> SlotMemory:
    """This worker process's figures under Dask memory limit ``limit``."""
    return SlotMemory.of(limit, terminate_fraction(), resting_rss())


def check_offers(slots: dict[str, SlotMemory]) -> dict[str, SlotMemory]:
    """``slots``, refused (:class:`SpecError`, ``memory_limit``) where every CPU slot leaves
    jobs nothing (a memory limit at or below what a slot holds at rest): nothing could be
    placed, and a sweep would wait for room that never comes."""
    from quantdask.errors import SpecError
    from quantdask.util import format_bytes

    if not slots or any(slot.offered for slot in slots.values()):
        return slots
    slot = max(slots.values(), key=lambda s: s.resting)
    least = int((slot.resting + 256 * 2**20) / slot.terminate)
    raise SpecError("memory_limit", f"every CPU slot leaves jobs 0 B ({slot.describe()}): "
                                    f"give --memory-limit at least {format_bytes(least)} "
                                    "(its resting memory and 256 MiB for a job, over the "
                                    "nanny's fraction), e.g. 1600MiB")


LEAST_SLOT_BYTES = 600 * 2**20
"""The least ``memory_limit`` a CPU slot is started with: its worker's resting RSS (about
450-500 MiB measured here, ``process.slot_memory``) over its nanny's 95%, with room for a job."""


def slot_memory_limit(value: int | str | None, elsewhere: bool) -> int | None:
    """A CPU slot's memory limit in bytes, as Dask reads it (``1600MiB``, ``2GB``, bytes;
    None: Dask's default); refused for workers this process does not start."""
    from dask.utils import parse_bytes

    from quantdask.errors import SpecError
    from quantdask.util import format_bytes

    if value is None:
        return None
    if elsewhere:
        raise SpecError("memory_limit", "--memory-limit sets the memory limit of the CPU slots "
                                        "quantdask starts; the workers of a scheduler reached "
                                        "by address were started elsewhere: give each `dask "
                                        "worker ... --memory-limit 1600MiB` where it starts, or "
                                        "drop --memory-limit")
    if isinstance(value, str) and value.strip().isdigit():
        raise SpecError("memory_limit", f"give a unit: {value.strip()}MiB or {value.strip()}MB "
                                        f"(a bare number would be bytes, got {value!r})")
    try:
        limit = int(parse_bytes(value)) if isinstance(value, str) else int(value)
    except (ValueError, TypeError):
        limit = 0
    if isinstance(value, bool) or limit <= 0:
        raise SpecError("memory_limit", f"must be a size such as 1600MiB or 2GB (or bytes), "
                                        f"got {value!r}")
    if limit < LEAST_SLOT_BYTES:
        raise SpecError("memory_limit", f"{format_bytes(limit)} is less than a CPU slot holds "
                                        f"at rest (Python, torch and Dask: about 450-500 MiB "
                                        f"here) before any job: give at least "
                                        f"{format_bytes(LEAST_SLOT_BYTES)}, e.g. 1600MiB")
    return limit
