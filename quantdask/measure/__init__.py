"""Measurements on a worker: eval windows and quality (``metrics``, ``statistics``,
``logits``), the per-model reference every job compares against (``reference``), coverage,
per-layer errors, calibration data, task accuracy, generation speed, memory peaks and timers
(``usage``), and a checkpoint's tensors read one at a time (``checkpoint_reader``).

It may import ``process``, ``sweepfile``, ``backends`` and the shared words. A capability
gives it a model's streamed forward only through ``logits.register_streamed_log_probs``."""
