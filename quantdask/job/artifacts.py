"""Saved models: each done job's quantized model kept where the sweep says, checked by reloading.

``artifacts: {keep: done | pareto, to: DIR or URL}`` makes each done job save its quantized model
in the library's own format (``save_pretrained``; AutoRound's model is its export, reloaded)
plus the tokenizer, to ``<to>/<job_id>``. ``to`` is a directory (relative to the sweep file) or
an fsspec URL (``s3://bucket/prefix``, with the filesystem's package installed): workers write
there, so on several machines it must be shared storage. The result records where it went, its
bytes on disk and a sha256 (see :func:`directory_digest`). With ``verify: true`` the worker
reloads the saved directory with ``from_pretrained``, as a user would, and measures KL on the
first :data:`VERIFY_WINDOWS` eval windows against the reference, for the reloaded model and the
one in memory: ``reload_kl_delta`` is the difference. The in-memory model's is the score phase's
(its windows frame rows, measured before the save, which may change the model: see
``Savable.prepare``), so that model is not evaluated twice; the reloaded one is scored in
the eval's own batches of those windows (LLM.int8 picks its outlier columns per forward pass, so
what shares a batch moves its output). ``keep: pareto`` then deletes, once the sweep ends, the
artifacts of jobs off each model's size/KL Pareto frontier.

A failed save never loses the job's result: the error goes to ``artifact_error``, and the job
fails (and is retried) only with ``required: true``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

from quantdask.backends.capabilities import Savable
from quantdask.records import Artifact, PhaseRecord, Scored, WindowRow

if TYPE_CHECKING:

    from quantdask.sweepfile.settings import ArtifactSettings

log = logging.getLogger("quantdask.job")

VERIFY_WINDOWS = 4
"""Eval windows the reload check measures KL on, for the reloaded and the in-memory model."""


def directory_digest(directory: str) -> tuple[str, int]:
    """(sha256, bytes) of a saved model directory: the sha256 of its manifest, one line
    ``<relative path> <sha256 of the file>`` per file in sorted order, and the files' total
    size. Recomputable with ``sha256sum`` over the same listing."""
    lines, total = [], 0
    for base, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(base, name)
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
            lines.append(f"{os.path.relpath(path, directory)} {digest.hexdigest()}\n")
            total += os.path.getsize(path)
    manifest = "".join(sorted(lines)).encode()
    return hashlib.sha256(manifest).hexdigest(), total


def keep_artifact(model, tokenizer, backend, job, reference, device: str,
                  records: Sequence[PhaseRecord] = ()) -> Artifact:
    """Save ``model`` as ``job``'s artifact (and reload-check it when asked); the result's
    artifact columns. ``records``: what the attempt's phases produced so far, whose ``Scored``
    gives the in-memory model's KL per window (without one, it is measured here). A failure is
    the ``artifact_error`` column, raised again only when the sweep requires artifacts."""
    settings = job.artifacts
    try:
        savable = backend.has(Savable)
        if savable is None:
            # Not NotImplementedError: with required: true this fails the job (run_job would
            # skip it as unsupported and drop its measurements).
            raise RuntimeError(backend.refusal(Savable))
        # The model as the job scored it: a save may change the model in memory (bitsandbytes'
        # CPU repacking, undone lossily), and the reloaded copy would then agree with the damage.
        before = None
        if settings.verify:  # the score phase's figure; measured here only without one
            before = scored_kl(records)
            if before is None:
                before = verify_kl(model, reference, job.eval.batch_size, device)
        with tempfile.TemporaryDirectory(prefix="quantdask-artifact-") as scratch:
            local = os.path.join(scratch, job.id)
            if savable.prepare is not None:
                savable.prepare(model)
            model.save_pretrained(local)
            tokenizer.save_pretrained(local)
            digest, size = directory_digest(local)
            saved = publish(local, settings, job.id)
            # The saved directory itself where it is local; a URL's from the same bytes.
            delta = None if before is None else reload_kl_delta(
                before, saved or local, reference, job.eval.batch_size, device, savable.load)
            kept = Artifact(artifact_uri=settings.location(job.id), artifact_bytes=size,
                            artifact_sha256=digest, artifact_kept=True, reload_kl_delta=delta)
        log.info("artifact saved to %s: %d bytes, sha256 %s%s", kept.artifact_uri, size,
                 digest, "" if delta is None else f", reload KL delta {delta:.3g}")
        return kept
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
        log.error("artifact not kept: %s", message)
        if settings.required:
            raise
        return Artifact(artifact_error=message)


def publish(local: str, settings: ArtifactSettings, job_id: str) -> str | None:
    """Put the saved directory at its location; the local path when it is one (written
    beside it and renamed into place, so a reader never sees half an artifact)."""
    target = settings.location(job_id)
    if settings.is_url:
        import fsspec

        fs, path = fsspec.core.url_to_fs(target)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        fs.put(local, path, recursive=True)
        return None
    os.makedirs(os.path.dirname(target), exist_ok=True)
    partial = f"{target}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(local, partial)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target


def windows_kl(rows: Sequence[WindowRow]) -> float:
    """KL per predicted token over the first :data:`VERIFY_WINDOWS` of the windows frame's
    ``rows``: each row's ``kl`` is its window's mean, so weighted by its ``tokens`` (clipped
    at 0, as ``kl_divergence`` is)."""
    first = sorted(rows, key=lambda row: row.window)[:VERIFY_WINDOWS]
    tokens = sum(row.tokens for row in first)
    kl = math.fsum(row.kl * row.tokens for row in first) / tokens
    if not math.isfinite(kl):  # an fp16 overflow, say: a failed check, not a measurement
        raise ArithmeticError(f"non-finite KL ({kl}) on the first {len(first)} windows")
    return max(kl, 0.0)


def scored_kl(records: Sequence[PhaseRecord]) -> float | None:
    """The in-memory model's KL on the first :data:`VERIFY_WINDOWS` windows, from the score
    phase's rows among ``records`` (None without them)."""
    scored = next((r for r in records if isinstance(r, Scored) and r.windows), None)
    return None if scored is None else windows_kl(scored.windows)


def verify_kl(model, reference, batch_size: int, device: str) -> float:
    """KL of ``model`` against the reference on its first :data:`VERIFY_WINDOWS` windows,
    measured in the eval's batches (the windows of those batches go through the model; the
    first :data:`VERIFY_WINDOWS` are compared), as the score phase measured them."""
    from quantdask.measure.metrics import measure_quality

    covering = min(reference.windows.size(0), -(-VERIFY_WINDOWS // batch_size) * batch_size)
    windows = reference.windows[:covering]
    distribution = {k: t[:covering] for k, t in reference.distribution.items()}
    meter = measure_quality(model, windows, distribution, batch_size, device)
    return windows_kl(meter.window_rows())


def reload_kl_delta(before: float, directory: str, reference, batch_size: int,
                    device: str, load=None) -> float:
    """KL of the model reloaded from ``directory`` (see :func:`verify_kl`) minus ``before``,
    the in-memory model's, measured (by the score phase) before it was saved; reloaded with
    ``load(directory, device)`` (``Savable.load``) or plain ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    reloaded = (load(directory, device) if load is not None
                else AutoModelForCausalLM.from_pretrained(directory, device_map=device))
    reloaded.eval()
    after = verify_kl(reloaded, reference, batch_size, device)
    del reloaded
    return after - before
