"""A config's ``modules`` (per-module formats: hqq, torchao, gptq, gguf) naming a module its
model does not have, refused before anything runs: the names are checked against the model
built on the meta device (``plan.model_facts``), so a typo costs no job, probe or cluster.

>>> check_module_names(qd.expand_grid(qd.load_sweep("sweep.yaml")))  # doctest: +SKIP
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from quantdask.errors import SpecError
from quantdask.plan.model_facts import model_facts

if TYPE_CHECKING:
    from quantdask.sweepfile.sweep import Job


def check_module_names(jobs: list[Job]) -> None:
    """Raise :class:`SpecError` (field ``modules.NAME``) for the first config of ``jobs`` whose
    ``modules`` names a module (or fused experts parameter) its model does not have, with the
    nearest names it has. A model whose modules are unknown here (a hub id, remote code that
    does not build) is left to the workers, which refuse the job."""
    known: dict[str, set[str]] = {}
    for job in jobs:
        modules = job.options.get("modules") or {}
        if not modules:
            continue
        key = job.model.label
        if key not in known:
            facts = model_facts(job)
            known[key] = ({name for name, _, _ in facts.weight_modules}
                          | set(facts.fused_weights))
        if not known[key]:
            continue
        unknown = [name for name in modules if name not in known[key]]
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(known[key]), n=3)
            raise SpecError(
                f"modules.{unknown[0]}",
                f"{job.config_label} ({job.backend}): {job.model.label} has no module named "
                f"{unknown[0]!r}" + (f" (nor {len(unknown) - 1} more)" if len(unknown) > 1
                                     else "")
                + "; name each as model.named_modules() gives it"
                + (f", e.g. {', '.join(near)}" if near else "")
                + " (a head tied to the embedding is the embedding's module)")
