"""Each job's own random numbers, and the one lock over the process-global generators.

Jobs packed on one worker (``jobs_per_gpu`` > 1) run as threads of one process, and torch's,
numpy's and Python's default generators belong to that process: a job that seeded or drew from
them would re-seed or advance the generator its neighbour is drawing from, and its numbers would
depend on when the neighbour started. So each attempt draws from generators of its own, seeded
with the job's ``seed`` when the attempt starts: ``job_generator(device)`` in the thread that
runs it (``job.job.run_job`` opens them with ``job_random``). A backend that draws random
numbers passes it: ``torch.rand(n, generator=qd.job_generator(device))``.

A library that takes no generator and seeds and draws from the global ones itself (AutoRound
seeds them and shuffles its calibration batches with Python's ``random``) runs inside
``global_generators(draws=True)``, alone; one that only seeds them and draws from generators of
its own (lm-eval: its few-shot and bootstrap draws are ``random.Random`` instances of its own)
runs inside ``global_generators()``, beside others like it but never during a drawing one.

>>> import torch
>>> with job_random(7):
...     a = torch.rand(3, generator=job_generator())
...     _ = torch.rand(3)  # the process-global generator: not the job's
...     b = torch.rand(3, generator=job_generator())
>>> with job_random(7):
...     first = torch.rand(3, generator=job_generator())
>>> bool((a == first).all()), bool((a == b).all())
(True, False)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class _JobGenerators:
    """One attempt's generators, one per device, each seeded with the job's seed when first
    asked for."""

    def __init__(self, seed: int):
        self.seed = seed
        self.by_device: dict[str, torch.Generator] = {}

    def on(self, device: str | torch.device) -> torch.Generator:
        import torch

        where = torch.device(device)
        if where.type == "cuda" and where.index is None:
            where = torch.device("cuda", torch.cuda.current_device())
        generator = self.by_device.get(str(where))
        if generator is None:
            generator = self.by_device[str(where)] = torch.Generator(where).manual_seed(self.seed)
        return generator


_current: ContextVar[_JobGenerators | None] = ContextVar("quantdask_job_generators",
                                                          default=None)


def job_generator(device: str | torch.device = "cpu") -> torch.Generator:
    """The running job's own generator on ``device``, seeded with the job's ``seed`` when the
    attempt started (each device its own). Outside a job (a backend called by hand) it is
    torch's default generator of the device."""
    generators = _current.get()
    if generators is not None:
        return generators.on(device)
    import torch

    where = torch.device(device)
    if where.type == "cuda":
        index = torch.cuda.current_device() if where.index is None else where.index
        return torch.cuda.default_generators[index]
    return torch.default_generator if where.type == "cpu" else torch.Generator(where)


@contextlib.contextmanager
def job_random(seed: int) -> Iterator[None]:
    """Give the job running in this thread generators of its own, seeded with ``seed``."""
    token = _current.set(_JobGenerators(seed))
    try:
        yield
    finally:
        _current.reset(token)


class _GlobalGenerators:
    """Readers and writers over the process-global generators: any number of sections that
    only seed them, or one that draws from them too (a writer waits for the readers to leave,
    and new readers wait while one waits)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._seeding = 0
        self._drawing = False
        self._waiting_to_draw = 0

    @contextlib.contextmanager
    def held(self, draws: bool) -> Iterator[None]:
        with self._changed:
            if draws:
                self._waiting_to_draw += 1
                self._changed.wait_for(lambda: not self._drawing and not self._seeding)
                self._waiting_to_draw -= 1
                self._drawing = True
            else:
                self._changed.wait_for(lambda: not self._drawing and not self._waiting_to_draw)
                self._seeding += 1
        try:
            yield
        finally:
            with self._changed:
                if draws:
                    self._drawing = False
                else:
                    self._seeding -= 1
                self._changed.notify_all()


_GLOBAL = _GlobalGenerators()


def global_generators(draws: bool = False) -> contextlib.AbstractContextManager[None]:
    """Hold the process-global generators (Python's ``random``, numpy's, torch's default) for
    a library call that seeds them: alone if it also ``draws`` from them (its numbers then
    depend on its seed only), else beside other seeding calls (see the module)."""
    return _GLOBAL.held(draws)
