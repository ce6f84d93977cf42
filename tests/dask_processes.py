"""A Dask cluster of separate processes started by the ``dask`` command, as on real nodes.

Each worker is its own ``dask worker`` command in its own process group (nanny and worker
process), standing in for a node: killing the group is a node going away. Everything binds to
127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

DASK = str(Path(sys.executable).parent / "dask")
START_TIMEOUT_S = 90


class DaskProcesses:
    """``dask scheduler`` + ``dask worker`` commands; ``tls`` = (ca, cert, key) PEM paths."""

    def __init__(self, directory: Path, tls: tuple[str, str, str] | None = None):
        self.directory = directory
        self.tls = tls
        self.scheduler_file = directory / "scheduler.json"
        self.processes: dict[str, subprocess.Popen] = {}
        # Dask would rerun a task of a dead worker on its own up to 3 times; quantdask's
        # recipe turns that off so that its own retry policy counts the loss.
        self.env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0",
                    "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        ca, cert, key = self.tls
        return ["--tls-ca-file", ca, "--tls-cert", cert, "--tls-key", key]

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.directory / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.processes[name] = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()

    def start_scheduler(self) -> str:
        """Start ``dask scheduler`` on 127.0.0.1 (a free port); return its address."""
        self._start("scheduler", [
            DASK, "scheduler", "--host", "127.0.0.1", "--port", "0",
            "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(self.scheduler_file),
            *(["--protocol", "tls"] if self.tls else []), *self._tls_args()])
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.scheduler_file.exists():
            if self.processes["scheduler"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("dask scheduler did not start: "
                                   + (self.directory / "scheduler.log").read_text())
            time.sleep(0.2)
        time.sleep(0.2)  # the file is written whole, but give the writer its moment
        return json.loads(self.scheduler_file.read_text())["address"]

    def start_worker(self, name: str, resources: str = "GPU=1", nthreads: int = 1) -> None:
        """Start one ``dask worker`` (nanny + worker) named ``name``, as the README's recipe."""
        self._start(name, [
            DASK, "worker", "--scheduler-file", str(self.scheduler_file), "--name", name,
            "--host", "127.0.0.1", "--nthreads", str(nthreads), "--nworkers", "1",
            "--resources", resources, "--preload", "quantdask.preload",
            # Without it the worker's HTTP server (health, metrics) listens on 0.0.0.0.
            "--dashboard-address", "127.0.0.1:0", *self._tls_args()])

    def kill(self, name: str) -> None:
        """SIGKILL the whole process group of ``name``: the node is gone, nanny and all."""
        os.killpg(self.processes[name].pid, signal.SIGKILL)
        self.processes[name].wait(timeout=30)

    def listening_addresses(self) -> set[str]:
        """The IP addresses every process started here (and its children) listens on."""
        addresses = set()
        for popen in self.processes.values():
            try:
                root = psutil.Process(popen.pid)
                family = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for process in family:
                try:
                    connections = process.net_connections(kind="inet")
                except psutil.NoSuchProcess:
                    continue
                addresses |= {c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN}
        return addresses

    def close(self) -> None:
        for popen in self.processes.values():
            if popen.poll() is None:
                try:
                    os.killpg(popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for popen in self.processes.values():
            try:
                popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(timeout=10)
