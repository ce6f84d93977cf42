"""Idle cores lent to busy CPU slots (quantdask.process.cpu_share), in this process: marks of other
jobs are files like the ones their workers would write."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from quantdask.process import cpu_share

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """Cores shared in this process (a share of 1 thread), on a machine of 4 cores, with a
    busy directory of its own."""
    monkeypatch.setattr(cpu_share, "BUSY_DIR", tmp_path / "busy")
    monkeypatch.setattr(cpu_share, "machine_cores", lambda: 4)
    threads = torch.get_num_threads()
    cpu_share.share_cores(1)
    yield tmp_path / "busy"
    monkeypatch.setattr(cpu_share, "_own_threads", None)
    torch.set_num_threads(threads)


def test_a_job_alone_borrows_every_core_and_gives_them_back_as_others_start(shared):
    with cpu_share.busy():
        assert torch.get_num_threads() == 4 and cpu_share.busy_jobs() == 1
        other = shared / f"{os.getpid()}-1"  # another job of this machine starts
        other.touch()
        cpu_share.rebalance()
        assert torch.get_num_threads() == 2
        (shared / f"{os.getpid()}-2").touch()
        (shared / f"{os.getpid()}-3").touch()
        (shared / f"{os.getpid()}-4").touch()
        cpu_share.rebalance()
        assert torch.get_num_threads() == 1  # 5 busy on 4 cores: its own share, never less
        for mark in shared.iterdir():
            if mark.name != f"{os.getpid()}-{threading.get_ident()}":
                mark.unlink()
        cpu_share.rebalance()
        assert torch.get_num_threads() == 4
    assert torch.get_num_threads() == 1 and list(shared.iterdir()) == []


def test_the_mark_of_a_process_that_died_mid_job_is_ignored_and_removed(shared):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (shared / f"{dead}-1").touch()
    with cpu_share.busy():
        assert torch.get_num_threads() == 4 and cpu_share.busy_jobs() == 1
    assert list(shared.iterdir()) == []


def test_nothing_is_shared_where_quantdask_did_not_ask(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_share, "_own_threads", None)
    monkeypatch.setattr(cpu_share, "BUSY_DIR", tmp_path / "busy")
    threads = torch.get_num_threads()
    with cpu_share.busy():
        cpu_share.rebalance()
        assert torch.get_num_threads() == threads
    assert not (tmp_path / "busy").exists()
