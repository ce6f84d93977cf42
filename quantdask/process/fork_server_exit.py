"""The CPU slots' fork server exits without tearing its interpreter down.

``quantdask.cluster.local`` has the server import this last, after torch, transformers and
bitsandbytes. When the process that started the cluster exits, the server is told to exit too,
and Python's teardown of those libraries took about 2 s of CPU, while the server still held
that process's stdout and stderr open (so ``subprocess.run(["quantdask", "run", ...])`` waited
for it). The server only forks workers, which end on their own (multiprocessing ends each with
``os._exit``): skipping the teardown loses nothing.

Imported anywhere but in the fork server's ``main``, this module does nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
from types import FrameType


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to say there
            pass
    os._exit(0)


def _imported_by_the_fork_server() -> bool:
    """Whether multiprocessing's fork server is importing this (its preload list)."""
    server = os.path.join("multiprocessing", "forkserver.py")
    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_code.co_filename.endswith(server):
            return True
        frame = frame.f_back
    return False


if _imported_by_the_fork_server():
    atexit.register(_exit_now)
