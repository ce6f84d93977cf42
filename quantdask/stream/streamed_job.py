"""The phases of a streamed job (``Job.streamed``): its model never resident, its decoder layers
read from the checkpoint, quantized and run one at a time (``stream.streaming``).

One pass (``stream``) reads each layer, quantizes it as the backend quantizes it whole, counts
its coverage and weight errors against its full-precision tensors, runs every eval window
through it and drops it; the final norm and head then give the log-probs the quality meter
takes, as for a resident job. The later phases hand on what the pass measured (in the stage it
returns, ``job.phases.Made``: each phase takes the attempt's ``JobContext`` and the stage so
far, and returns the next with its record), so the job's row has the same columns as a
resident job's, plus the stream's own (``Streamed``): its bytes read and its seconds per
layer. Task accuracy, generation speed and artifacts need the model resident: a streamed job
skips them and says so (``stream_skipped``), never fails them.
"""

from __future__ import annotations

import functools
import logging
import tempfile
from dataclasses import replace
from typing import TYPE_CHECKING

from quantdask.backends.capabilities import Dequantizes, ModuleAlone, StreamedFit
from quantdask.errors import UnsupportedHere
from quantdask.job.phases import (
    PROBE_WINDOWS,
    JobContext,
    Made,
    Phase,
    calibration_of,
    check_coverage,
    layer_weights,
    need,
    score,
)
from quantdask.measure.calibration import Calibration
from quantdask.measure.coverage import Coverage, coverage
from quantdask.measure.layers import OutputErrors, weight_errors
from quantdask.measure.metrics import QualityMeter
from quantdask.process.model_source import cached_model_source
from quantdask.records import Loaded, Quantized, Streamed, TaskScores
from quantdask.util import scratch_root

if TYPE_CHECKING:
    import torch

    from quantdask.process.model_source import ModelSource
    from quantdask.stream.streaming import LayerHook

log = logging.getLogger("quantdask.job")

RESIDENT_ONLY = "task accuracy, generation speed and artifacts need the model resident"
"""Why a streamed job skips them."""


def load_streamed(run: JobContext, made: Made) -> tuple[Made, Loaded]:
    """The model's config, tokenizer and class (no weights: counted on the meta device)."""
    with run.watch("load"):
        source, cached = cached_model_source(run.job.model, weights=False)
    return (replace(made, source=source, originals={}),
            Loaded(run.watch.seconds["load"], cached, source.param_count))


def stream(run: JobContext, made: Made) -> tuple[Made, Streamed]:
    """The one pass over the layers (see the module): coverage, weight errors and, but for
    the baseline (whose figures are the reference's, unless that was computed in float32),
    the quality meter."""
    from quantdask.stream.saved_layers import SavedLayers
    from quantdask.stream.streaming import StreamedModel

    backend, job, source = run.backend, run.job, need(made.source, "source")
    parts: list[Coverage] = []
    measured: list[tuple[str, OutputErrors]] = []
    unmeasured = dict(made.unmeasured)

    def seen(prefix: str, layer: torch.nn.Module, originals: dict[str, torch.Tensor]
             ) -> OutputErrors | None:
        parts.append(coverage(layer, originals, backend.sizing.stored_bytes))
        dequantizes = backend.has(Dequantizes)
        if not (job.layer_stats and dequantizes is not None and backend.sizing.quantizes):
            return None
        rows, skipped = weight_errors(layer, dequantizes.dequantize, originals)
        unmeasured.update({f"{prefix}.{k}": v for k, v in skipped.items()})
        # Each measured linear's output error on the first PROBE_WINDOWS windows, taken by
        # hooks while the layer runs over them, as a resident job's (phases.score).
        outputs = OutputErrors(layer, rows, originals, PROBE_WINDOWS)
        measured.append((prefix, outputs))
        return outputs

    with run.watch("quantize"):  # a calibrated fit, then the rest of the model read
        hook, calibration = _layer_hook(run, source)
        model = StreamedModel(source, run.device, hook, seen)
        with model.outside_layers() as outside:
            parts.append(coverage(outside, None, backend.sizing.stored_bytes))
    meter = None
    if job.is_baseline and not job.eval.reference_float32:  # its figures are the reference's
        model.read_layers()
    else:
        meter = QualityMeter(run.reference.windows, run.reference.distribution)
        with run.watch("eval"):
            for piece in model.log_probs(run.reference.windows, job.eval.batch_size):
                meter.add(piece.rows, piece.positions, piece.log_probs)
    layers = list(made.layers)
    for prefix, outputs in measured:
        for name, reason in outputs.failed.items():
            log.warning("per-layer output error skips %s.%s: %s", prefix, name, reason)
        layers += [{**row, "layer": f"{prefix}.{row['layer']}"} for row in outputs.rows()]
    # The layers are read and quantized as the pass reaches them: that part of the pass is
    # the quantize time, the rest the eval's.
    reading = sum(t.load_s for t in model.timings)
    seconds = run.watch.seconds
    seconds["quantize"] += reading
    if "eval" in seconds:
        seconds["eval"] -= reading
    figures = calibration.figures() if calibration is not None else None
    return replace(made, calibration=calibration, covered=functools.reduce(_joined, parts),
                   meter=meter, layers=tuple(layers), unmeasured=unmeasured), Streamed(
        Quantized(seconds["quantize"], figures), streamed=True,
        # (and a calibrated fit's saved layers, read in their turn)
        stream_bytes_read=model.reader.bytes_read + (
            hook.reader.bytes_read if isinstance(hook, SavedLayers) else 0),
        stream_layer_s=sum(t.load_s + t.run_s for t in model.timings) / len(model.skeletons),
        stream_skipped=RESIDENT_ONLY)


def _layer_hook(run: JobContext, source: ModelSource
                ) -> tuple[LayerHook | None, Calibration | None]:
    """What each streamed layer becomes: the backend's own quantization of it, module by
    module; for a calibrated backend that fits block by block from the checkpoint
    (``StreamedFit``), its fit first, then each layer as saved (with the calibration it fit
    on, for the quantize figures)."""
    from quantdask.stream.saved_layers import SavedLayers
    from quantdask.stream.streaming import layer_quantizer

    backend, job = run.backend, run.job
    if not backend.sizing.quantizes:
        return None, None
    refusal = backend.stream_refusal(getattr(source.config, "model_type", ""))
    if refusal:
        raise UnsupportedHere(refusal)
    fit = backend.has(StreamedFit)
    if backend.has(ModuleAlone) is None and fit is not None:
        folder = run.holding.enter_context(
            tempfile.TemporaryDirectory(prefix=f"quantdask-{backend.name}-", dir=scratch_root()))
        calibration = calibration_of(run)
        saved = fit.fit(source, job.options, run.device, calibration, folder)
        return SavedLayers(saved, run.device), calibration
    return layer_quantizer(backend, job.options), None


def _joined(a: Coverage, b: Coverage) -> Coverage:
    def added(x: dict[str, int], y: dict[str, int]) -> dict[str, int]:
        return {key: x.get(key, 0) + y.get(key, 0) for key in {*x, *y}}

    return Coverage(a.quantized_params + b.quantized_params,
                    added(a.full_precision, b.full_precision),
                    a.quantized_bytes + b.quantized_bytes,
                    added(a.unquantized_by_dtype, b.unquantized_by_dtype))


def tasks_skipped(run: JobContext, made: Made) -> tuple[Made, TaskScores | None]:
    """A streamed job's task phase: skipped, with the reason, when the sweep has tasks."""
    if run.job.tasks is None:
        return made, None
    log.warning("tasks skipped: %s; this job streamed its layers", RESIDENT_ONLY)
    return made, TaskScores(0.0, 0, 0, 0, tasks_error=f"not scored: {RESIDENT_ONLY}")


STREAMED_PHASES: tuple[Phase, ...] = (load_streamed, stream, check_coverage, layer_weights,
                                      score, tasks_skipped)
"""What a streamed job does, in order (``phases.PHASES`` for a resident one)."""
