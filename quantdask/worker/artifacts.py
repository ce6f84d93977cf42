"""Saved models: each done job's quantized model kept where the sweep says, checked by reloading.

``artifacts: {keep: done | pareto, to: DIR or URL}`` makes each done job save its quantized model
in the library's own format (``save_pretrained``; AutoRound's model is its export, reloaded)
plus the tokenizer, to ``<to>/<job_id>``. ``to`` is a directory (relative to the sweep file) or
an fsspec URL (``s3://bucket/prefix``, with the filesystem's package installed): workers write
there, so on several machines it must be shared storage. The result records where it went, its
bytes on disk and a sha256 (see :func:`directory_digest`). With ``verify: true`` the worker
reloads the saved directory with ``from_pretrained``, as a user would, and measures KL on the
first :data:`VERIFY_WINDOWS` eval windows against the reference, for the reloaded model and the
one in memory (measured before the save, which may change it: see ``Backend.prepare_save``):
``reload_kl_delta`` is the difference. ``keep: pareto`` then deletes, once the sweep ends, the
artifacts of jobs off each model's size/KL Pareto frontier.

A failed save never loses the job's result: the error goes to ``artifact_error``, and the job
fails (and is retried) only with ``required: true``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from quantdask.worker.records import Artifact

if TYPE_CHECKING:

    from quantdask.spec.settings import ArtifactSettings

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


def keep_artifact(model, tokenizer, backend, job, reference, device: str) -> Artifact:
    """Save ``model`` as ``job``'s artifact (and reload-check it when asked); the result's
    artifact columns. A failure is the ``artifact_error`` column, raised again only when the
    sweep requires artifacts."""
    settings = job.artifacts
    try:
        if not backend.saves:
            # Not NotImplementedError: with required: true this fails the job (run_job would
            # skip it as unsupported and drop its measurements).
            raise RuntimeError(f"{backend.name} models have no save format quantdask can "
                               "reload yet")
        # The model as the job scored it: a save may change the model in memory (bitsandbytes'
        # CPU repacking, undone lossily), and the reloaded copy would then agree with the damage.
        before = (verify_kl(model, reference, job.eval.batch_size, device)
                  if settings.verify else None)
        with tempfile.TemporaryDirectory(prefix="quantdask-artifact-") as scratch:
            local = os.path.join(scratch, job.id)
            if backend.prepare_save is not None:
                backend.prepare_save(model)
            model.save_pretrained(local)
            tokenizer.save_pretrained(local)
            digest, size = directory_digest(local)
            saved = _publish(local, settings, job.id)
            # The saved directory itself where it is local; a URL's from the same bytes.
            delta = None if before is None else reload_kl_delta(
                before, saved or local, reference, job.eval.batch_size, device)
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


def _publish(local: str, settings: ArtifactSettings, job_id: str) -> str | None:
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


def verify_kl(model, reference, batch_size: int, device: str) -> float:
    """KL of ``model`` against the reference on its first :data:`VERIFY_WINDOWS` windows."""
    from quantdask.worker.metrics import quality

    windows = reference.windows[:VERIFY_WINDOWS]
    distribution = {k: t[:VERIFY_WINDOWS] for k, t in reference.distribution.items()}
    return quality(model, windows, distribution, batch_size, device).kl_divergence


def reload_kl_delta(before: float, directory: str, reference, batch_size: int,
                    device: str) -> float:
    """KL of the model reloaded from ``directory`` (see :func:`verify_kl`) minus ``before``,
    the in-memory model's, measured before it was saved."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(directory, device_map=device)
    reloaded.eval()
    after = verify_kl(reloaded, reference, batch_size, device)
    del reloaded
    return after - before
