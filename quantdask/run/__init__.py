"""The sweep driver's run: a sweep session (``sweep.run_sweep``, ``submit_sweep``), the loop
that submits attempts and collects outcomes (``loop``), the stages a capability runs before the
jobs (``stages``), what is recorded as it goes (``recorder``, ``attempts``, ``live_logs``),
progress, the notebook handle and widget, scaling runs and artifact pruning.

It may import ``plan`` and every layer below it; ``search`` and ``report`` import it, and it
reaches a capability only through ``stages``.

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
