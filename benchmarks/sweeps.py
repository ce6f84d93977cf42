"""The sweeps the benchmarks run: the demo model's configs, and synthetic jobs of known length."""

from __future__ import annotations

import time
from dataclasses import dataclass

from quantdask.backends import Backend, BackendOptions, option, register_backend
from quantdask.backends.base import UNQUANTIZED
from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR

EVAL = {"text": DEMO_EVAL_TEXT, "seq_len": 128, "samples": 32, "batch_size": 8}


def twelve_configs(name: str = "bench12") -> dict:
    """12 bitsandbytes configs of the demo model: 8 four-bit (nf4/fp4 x double quant x compute
    dtype) and 4 eight-bit (outlier thresholds)."""
    return {
        "name": name,
        "models": [{"name": "demo", "path": DEMO_MODEL_DIR}],
        "backends": [
            {"backend": "bitsandbytes", "grid": {"bits": [4], "quant_type": ["nf4", "fp4"],
                                                 "double_quant": [False, True],
                                                 "compute_dtype": ["float32", "bfloat16"]}},
            {"backend": "bitsandbytes", "grid": {"bits": [8],
                                                 "int8_threshold": [0.0, 3.0, 6.0, 10.0]}},
        ],
        "eval": EVAL,
        "retries": 0,
    }


@dataclass(frozen=True)
class SleepOptions(BackendOptions):
    seconds: float | None = option(float, help="how long the job holds its worker")
    n: int | None = option(int, help="tells jobs of the same length apart")


@dataclass(frozen=True)
class NoopOptions(BackendOptions):
    n: int | None = option(int, help="tells the jobs apart")


def _sleep_then_keep(source, options: SleepOptions, device: str):
    """A benchmark-only backend: holds its worker for ``seconds``, quantizes nothing."""
    time.sleep(options.seconds)
    return source.build(device)


def _no_op(source, options: NoopOptions, device: str):
    return source.build(device)


def register_synthetic_backends() -> None:
    """``sleep`` (jobs of known length) and ``noop`` (jobs that do nothing of their own)."""
    register_backend(Backend("sleep", _sleep_then_keep, options=SleepOptions,
                             label=lambda o: f"sleep {o.seconds:g}s #{o.n}", sizing=UNQUANTIZED))
    register_backend(Backend("noop", _no_op, options=NoopOptions,
                             label=lambda o: f"noop #{o.n}", sizing=UNQUANTIZED))


TINY_EVAL = {"text": DEMO_EVAL_TEXT, "seq_len": 8, "samples": 1, "batch_size": 1}
"""The least evaluation a job can do: synthetic jobs measure orchestration, not the model."""


def synthetic(name: str, backend: str, configs: list[dict], priority_by=None) -> dict:
    """A sweep of synthetic jobs on the demo model, each config its own block so that it can
    carry its own priority (``priority_by(config)``)."""
    return {
        "name": name,
        "models": [{"name": "demo", "path": DEMO_MODEL_DIR}],
        "backends": [{"backend": backend, "configs": [c],
                      **({"priority": priority_by(c)} if priority_by else {})} for c in configs],
        "eval": TINY_EVAL,
        "retries": 0,
        "timeout_s": 3600,
    }
