"""Dask event topics shared by the sweeps one client runs at once.

A Dask client holds one handler per topic: a second sweep subscribing would take the first's
job starts and device samples, and the first to finish would unsubscribe both. Each sweep
subscribes here instead; one Dask handler per (client, topic) hands every event to all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from distributed import Client

_lock = threading.Lock()
_handlers: dict[tuple[int, str], list[Callable]] = {}


def subscribe(client: Client, topic: str, handler: Callable) -> None:
    """Call ``handler(event)`` for each event of ``topic`` (beside other sweeps' handlers)."""
    with _lock:  # the Dask calls too: a subscribe never races the last unsubscribe
        handlers = _handlers.setdefault((id(client), topic), [])
        handlers.append(handler)
        if len(handlers) == 1:
            client.subscribe_topic(topic, lambda event: _fan_out(client, topic, event))


def unsubscribe(client: Client, topic: str, handler: Callable) -> None:
    """Stop calling ``handler``; the last one of a topic unsubscribes from Dask."""
    with _lock:
        handlers = _handlers.get((id(client), topic), [])
        if handler in handlers:
            handlers.remove(handler)
        if not handlers and _handlers.pop((id(client), topic), None) is not None:
            client.unsubscribe_topic(topic)


def subscribers(client: Client, topic: str) -> int:
    """How many sweeps of ``client`` listen to ``topic`` now."""
    with _lock:
        return len(_handlers.get((id(client), topic), []))


def _fan_out(client: Client, topic: str, event) -> None:
    with _lock:
        handlers = list(_handlers.get((id(client), topic), []))
    for handler in handlers:
        handler(event)
