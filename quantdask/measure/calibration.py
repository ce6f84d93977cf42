"""Calibration data on a worker: the token windows a calibrated backend (AutoRound) fits its
quantization to, and the measurement of that step.

The windows are cut once per model, with the model's reference (``reference.combine_reference``),
and reach each job of the model inside the reference, as one Dask dependency. A calibrated
backend's ``quantize`` gets them as ``calibration=`` (a :class:`Calibration`) and wraps its
data-driven step in ``calibration.measure()``: its wall time and peak memory are recorded
apart from the rest of quantizing (``calibrate_s``, ``calibrate_peak_*``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

from quantdask.measure.usage import PeakMemory
from quantdask.records import Calibrated

if TYPE_CHECKING:
    import torch

log = logging.getLogger("quantdask.job")


def calibration_windows(token_ids: list[int], seq_len: int, samples: int, seed: int,
                        bos_token_id: int | None = None) -> torch.Tensor:
    """``samples`` windows of ``seq_len`` tokens (samples x seq_len, int64) starting at offsets
    drawn uniformly with ``seed``: the same windows on every worker and every rerun. With
    ``bos_token_id``, each window is that token and ``seq_len`` - 1 tokens of the text, as the
    eval's are (``metrics.eval_windows``)."""
    import torch

    from quantdask.measure.metrics import with_bos

    body = seq_len - (bos_token_id is not None)
    if len(token_ids) < body:
        raise ValueError(f"calibration text has {len(token_ids)} tokens, fewer than "
                         f"calibration.seq_len ({seq_len}). Lower it or give a longer text")
    ids = torch.tensor(token_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(token_ids) - body + 1, (samples,), generator=generator)
    return with_bos(torch.stack([ids[start:start + body] for start in starts.tolist()]),
                    bos_token_id)


class Calibration:
    """What a calibrated backend's ``quantize`` gets: the ``windows`` (samples x seq_len token
    ids), and ``measure()``, the block to run its data-driven step in."""

    def __init__(self, windows: torch.Tensor, cuda: bool):
        self.windows = windows
        self.cuda = cuda
        self.seconds = 0.0
        self.peak_device_bytes = 0
        self.peak_rss_bytes = 0

    @contextlib.contextmanager
    def measure(self):
        """Time the calibration and take its peak memory (kept apart from the job's own)."""
        began = time.perf_counter()
        peak = PeakMemory(self.cuda)
        try:
            with peak:
                yield self
        except BaseException:
            log.error("calibration failed after %.2fs (%d windows of %d tokens)",
                      time.perf_counter() - began, *self.windows.shape)
            raise
        finally:
            self.seconds += time.perf_counter() - began
            self.peak_device_bytes = max(self.peak_device_bytes, peak.peak_device_bytes)
            self.peak_rss_bytes = max(self.peak_rss_bytes, peak.peak_rss_bytes)

    def figures(self) -> Calibrated:
        """The result's calibration columns."""
        return Calibrated(self.seconds, self.peak_device_bytes, self.peak_rss_bytes)
