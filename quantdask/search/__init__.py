"""The mixed-precision search, whole: it probes how sensitive each unit of a model is to each
format, allocates one format per unit under byte budgets, and hands the sweep the jobs that
verify its picks.

- ``searches``: the driver's side, registered as a stage that runs before the sweep's jobs
  (``run.stages``): score, allocate, refine, make the verifying jobs.
- ``pricing``: what is known before anything runs (each method's cost from the shapes, the
  method ``auto`` picks, the budgets and windows refused there).
- ``probing``: the cells scored on the cluster by ``kl`` or ``fisher``, written as they arrive.
- ``probe_runs``: the search's tasks on the cluster, retried and placed as jobs are.
- ``allocation``: the allocator (pure: cells in, an allocation out).
- ``refine``: whole mixes mutated and scored over the cluster, EvoPress's way.
- the worker's side: ``probe_task`` and ``probes`` (a chunk of cells measured against the
  model's reference), ``fisher`` and ``fisher_task`` (one backward pass per calibration batch,
  and cells scored on its capture), ``refine_task`` (a whole mix scored).

Its sweep-file block is ``sweepfile.search`` (every block of the file lives with the file's
model); its frames are the store's ``sensitivity`` and ``allocation``; its report section is
``report.search``. It may import the core (``run``, ``plan``, ``job``, ``measure``,
``process``, ``store``, ``cluster``, ``sweepfile``, ``backends``), never ``stream``, ``report``
or ``cli``; the core reaches it only through the stage it registers here.
"""

from __future__ import annotations

from quantdask.run.stages import PreJobStage, register_stage
from quantdask.search.searches import check_searches, run_searches

register_stage(PreJobStage("search", wanted=lambda sweep: bool(sweep.searches),
                           run=run_searches, check=check_searches))
