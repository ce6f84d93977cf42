"""Known notices of third-party libraries that are noise, not news, kept off the terminal.

bitsandbytes logs one per 8-bit matmul of a float32 model, and one saying its optional
hub-downloaded CPU kernel is absent (we want it so: ``util.import_offline``), as does
``kernels``, which would have fetched it; torchao (imported by transformers when
installed) says its CUDA-only extensions are absent; torch warns of an Enum registration
change in torchao. None is actionable by a user, and none is ours.

Importing this module quiets them in the importing process, before the libraries are imported:
quantdask's CLI does it first thing, and the worker processes' fork server imports it before
its warm imports. ``quantdask -v`` sets ``SHOW_ENV`` so that they (and the workers it starts)
show them again. Our own warnings stay visible.
"""

from __future__ import annotations

import logging
import os

SHOW_ENV = "QUANTDASK_SHOW_LIBRARY_NOTICES"
"""Set to 1 (``quantdask -v``) to see the libraries' notices again."""

NOTICES = {
    "bitsandbytes.autograd._functions": "inputs will be cast",
    "bitsandbytes.backends.cpu.ops": "from kernels-community",
    "kernels._internals.hf_hub": "Skipping publisher trust check",
    "torchao": "Failed to load",
    "torchao.kernel.intmm": "Detected no triton",
    "torch.utils._pytree": "is an Enum subclass",
}
"""Logger name -> the text of its notices that are noise."""


def _not_a_notice(record: logging.LogRecord) -> bool:
    return NOTICES.get(record.name, "\0") not in record.getMessage()


def quiet_notices() -> None:
    """Drop the known notices (``NOTICES``) in this process, whatever logs them later."""
    for name in NOTICES:
        logger = logging.getLogger(name)
        if _not_a_notice not in logger.filters:
            logger.addFilter(_not_a_notice)


if os.environ.get(SHOW_ENV) != "1":
    quiet_notices()
