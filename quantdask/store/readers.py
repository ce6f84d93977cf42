"""One reader per frame of a run directory (``qd.read_results``, ``qd.read_windows``...): each
:func:`~quantdask.store.run_store.read_frame` of its frame, documented for the notebook."""

from __future__ import annotations

import os

import polars as pl

from quantdask.store.run_store import read_frame


def read_results(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Every recorded job of ``run_dir`` as one Polars frame (the results schema).

    >>> read_results("runs/demo").select("config_label", "perplexity")  # doctest: +SKIP
    """
    return read_frame(run_dir, "results")


def read_layers(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Per-layer error of every done job of ``run_dir``: one row per (job, quantized layer)."""
    return read_frame(run_dir, "layers")


def read_windows(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Per-window quality of every done job of ``run_dir``: one row per (job, eval window)."""
    return read_frame(run_dir, "windows")


def read_tasks(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Task scores of every done job: one row per (job, task, metric, filter), with the
    baseline's value and the recovery (empty for a sweep without tasks)."""
    return read_frame(run_dir, "tasks")


def read_speed(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Generation speed of every done job: one row per (job, batch size), with the baseline's
    decode tokens/s and the speed-ups (null where it has no row; empty without a speed block)."""
    return read_frame(run_dir, "speed")


def read_attempts(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Every try of every job of ``run_dir``: one row per attempt."""
    return read_frame(run_dir, "attempts")


def read_worker_tasks(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Every other task than a job's attempt run on a worker (references, a search's probes)."""
    return read_frame(run_dir, "worker_tasks")


def read_sessions(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Every driver session of ``run_dir``: when it ran, on how many workers and slots."""
    return read_frame(run_dir, "sessions")


def read_device_samples(run_dir: str | os.PathLike) -> pl.DataFrame:
    """Utilization and memory of every worker's device over time (one row per sample)."""
    return read_frame(run_dir, "samples")


def read_environment(run_dir: str | os.PathLike) -> pl.DataFrame:
    """The environment frame: each session's driver and workers, one row per component."""
    return read_frame(run_dir, "environment")
