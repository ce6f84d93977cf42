"""Streaming, whole: a model too large for a worker's memory run one decoder layer at a time,
its weights read from the checkpoint as each layer's turn comes, so a job measures it with the
same figures as a resident one.

- ``streaming``: the layer-by-layer forward (``StreamedModel``) over a checkpoint.
- ``streamed_job``: a streamed job's phases (its one pass quantizes, counts and scores each
  layer, then drops it).
- ``saved_layers``: the layers of a checkpoint a calibrated backend fitted block by block and
  saved, read back one at a time.

Its sweep-file setting is ``Sweep.stream``; placement (``plan.placement``) decides which jobs
stream. It may import the core (``job``, ``measure``, ``process``, ``sweepfile``,
``backends``), never ``search``, ``report`` or ``cli``; the core reaches it only through what
it registers here: the streamed job's phases (``job.phases``) and the streamed reference's
forward (``measure.logits``).
"""

from __future__ import annotations

from quantdask.job.phases import register_streamed_phases
from quantdask.measure.logits import register_streamed_log_probs
from quantdask.stream.streamed_job import STREAMED_PHASES


def _streamed_log_probs(source, windows, batch_size: int, device: str):
    from quantdask.stream.streaming import StreamedModel

    return StreamedModel(source, device).log_probs(windows, batch_size)


register_streamed_phases(STREAMED_PHASES)
register_streamed_log_probs(_streamed_log_probs)
