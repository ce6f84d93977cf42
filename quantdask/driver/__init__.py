"""The sweep driver: the loop that submits jobs and collects outcomes (``sweep.run_sweep``), its
pure policy with an injected clock, retries, device health, placement by device memory,
planning, per-model references, progress, scaling runs and artifact pruning.

The driver logs on the ``quantdask.driver`` channel. Its name before 0.2 was
``quantdask.scheduler``; for one release a handler attached to that name still gets the
driver's lines, those the ``quantdask.driver`` logger lets through (set the level there).
"""

from __future__ import annotations

import logging

LOG_CHANNEL = "quantdask.driver"
OLD_LOG_CHANNEL = "quantdask.scheduler"  # an alias of LOG_CHANNEL until the next release


class _ToOldChannel(logging.Handler):
    """Hands the driver's records to the handlers attached to the channel's old name (not to
    its parents: those get them already, by propagation from the new one)."""

    def emit(self, record: logging.LogRecord) -> None:
        old = logging.getLogger(OLD_LOG_CHANNEL)
        if not old.isEnabledFor(record.levelno):
            return
        for handler in old.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def _alias_old_channel() -> None:
    channel = logging.getLogger(LOG_CHANNEL)
    if not any(isinstance(h, _ToOldChannel) for h in channel.handlers):
        channel.addHandler(_ToOldChannel())


_alias_old_channel()
