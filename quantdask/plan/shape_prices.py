"""Time estimates from a model's shapes, for a plan with no history yet: the multiply-adds of a
job's or a search's forward and backward passes, at this machine's own rate, timed once per
process on one thread (a CPU slot's; a GPU's is far higher, and is not timed here).

What is counted: a window's forward costs its tokens x the model's weights (attention's
quadratic term left out); a job is its eval forward plus its calibration's (a calibrated
backend runs its calibration windows through the model about once per layer it fits, counted
as one forward per decoder layer), and the weights read from disk at :data:`READ_BYTES_PER_S`.
Quantization's own arithmetic (a round, a solve) is not counted: the estimate is a lower bound
for slow quantizers, and the plan says what it rests on.

>>> job_seconds(job, facts)  # doctest: +SKIP
(41.0, 'shapes: eval and calibration forwards at 3.1e+09 multiply-adds/s, ...')
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from quantdask.backends import get_backend

if TYPE_CHECKING:
    from quantdask.backends.base import ModelFacts
    from quantdask.sweepfile.sweep import Job

READ_BYTES_PER_S = 400e6
"""The checkpoint's read rate a job's load is priced at (a local disk, safetensors)."""


@functools.lru_cache(maxsize=1)
def multiply_adds_per_s() -> float:
    """This process's float32 matmul rate on one thread (multiply-adds per second), timed
    once: the best of three 512 x 512 x 512 products."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        a @ b  # warm
        best = min(_timed(lambda: a @ b) for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    return 512 ** 3 / best


def _timed(work) -> float:
    began = time.perf_counter()
    work()
    return max(time.perf_counter() - began, 1e-9)


def job_seconds(job: Job, facts: ModelFacts) -> tuple[float | None, str]:
    """(seconds, what it rests on) for ``job`` on one CPU thread, from ``facts``' shapes;
    None where the shapes are unknown."""
    if not facts.param_count:
        return None, "nothing run yet, and the model's shapes are unknown"
    rate = multiply_adds_per_s()
    evaluation = job.eval
    work = evaluation.samples * evaluation.seq_len * facts.param_count
    calibration = job.calibration
    if get_backend(job.backend).calibrates(job.options) and calibration is not None:
        work += (calibration.samples * calibration.seq_len * facts.param_count
                 * max(1, facts.layers))
    seconds = work / rate + facts.weight_bytes / READ_BYTES_PER_S
    return seconds, (f"shapes: its forwards at {rate:.2g} multiply-adds/s (one thread here) "
                     "and its load; the quantizer's own work not counted")
