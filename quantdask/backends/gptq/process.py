"""What gptqmodel changes in the process of a worker that runs it, kept from the jobs after.

Importing it sets environment variables for the whole process (cache folders, allocator
settings), a dependency calls ``logging.basicConfig``, it prints its news to stdout and writes
a log file per quantization into ``./logs`` of the working directory: the gptq and awq
backends (``quantdask.backends.gptq.backend``) run it inside these.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pathlib
import warnings
from typing import Any

from quantdask.util import restore_environment

log = logging.getLogger("quantdask.backends.gptq")


@contextlib.contextmanager
def process_state_kept():
    """Whatever gptqmodel's import, quantization and loading change process-wide, put back:
    the environment (HF_HOME and the other cache folders, PYTORCH_ALLOC_CONF,
    CUDA_DEVICE_ORDER, AWQ_BATCH_SIZE...), the root logger (a dependency calls basicConfig),
    the warning filters and torch.compile's cache limit."""
    import torch

    environment, printed = dict(os.environ), io.StringIO()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    filters = list(warnings.filters)
    dynamo = torch._dynamo.config
    cache_limit = dynamo.cache_size_limit
    # Its CPU thread pool asks for 2 workers of a pool sized from the cores (1 on 2 cores:
    # "requests 2 workers but parent 'cpu' only has 1"); its packing extension would compile
    # C++ for 30 s on first use, for no gain on these layers.
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(2, (os.cpu_count() or 1) // 2)))
    os.environ.setdefault("GPTQMODEL_DISABLE_PACK_EXT", "1")
    classes = _transformers_patched_by_defuser()
    try:
        # Its news (a banner, tables per layer, progress bars, the saved config) is printed:
        # a worker's output is a log, and the job's own log says what was done.
        with contextlib.redirect_stdout(printed), warnings.catch_warnings():
            # transformers' notes on its way of loading what gptqmodel saved, not the user's
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        if printed.getvalue():
            log.debug("gptqmodel printed:\n%s", printed.getvalue()[-5000:])
        restore_environment(environment)
        root.setLevel(level)
        for handler in set(root.handlers) - set(handlers):
            root.removeHandler(handler)
        warnings.filters[:] = filters  # type: ignore[index]  # a list, typed as a Sequence
        dynamo.cache_size_limit = cache_limit
        for module, name, value in classes:
            if value is _ABSENT:
                module.__dict__.pop(name, None)  # added by defuser: taken away
            else:
                setattr(module, name, value)


_ABSENT = object()  # an attribute a module lacked before


def _transformers_patched_by_defuser() -> list[tuple[Any, str, Any]]:
    """What gptqmodel's loader (through defuser) replaces in transformers process-wide, as it
    is now: each mixture-of-experts family's fused experts block (Mixtral's
    ``MixtralSparseMoeBlock`` becomes one linear per expert) and the checkpoint conversion
    mapping. Left patched, every later ``from_pretrained`` of that family in the worker would
    build another model than a fresh process does (per-expert linears, which bitsandbytes
    then quantizes), so results would hang on which job ran before. [] without defuser."""
    import importlib

    try:
        from defuser.model_registry import MODEL_CONFIG, PATCH
        from transformers import conversion_mapping, modeling_utils
    except ImportError:
        return []
    # its conversion mapping (set on both modules, and the original kept on the first)
    found = [(module, name, getattr(module, name, _ABSENT))
             for module in (conversion_mapping, modeling_utils)
             for name in ("get_checkpoint_conversion_mapping",
                          "orig_get_checkpoint_conversion_mapping")]
    for family in MODEL_CONFIG.values():
        for original, _ in family.get(PATCH.REPLACE_MODULE, []):
            path, name = original.rsplit(".", 1)
            try:  # (imported now, if not yet: to put back what the loader would patch)
                module = importlib.import_module(path)
            except Exception:  # noqa: BLE001 - a family this transformers lacks
                continue
            if hasattr(module, name):
                found.append((module, name, getattr(module, name)))
    return found


@contextlib.contextmanager
def logs_in(folder: str):
    """gptqmodel writes a log file per quantization into ``./logs``, the worker's working
    directory (a user's project folder): into ``folder`` instead."""
    from gptqmodel.looper import loop_processor

    where = loop_processor._PROJECT_LOG_DIR
    loop_processor._PROJECT_LOG_DIR = pathlib.Path(folder)
    try:
        yield
    finally:
        loop_processor._PROJECT_LOG_DIR = where
