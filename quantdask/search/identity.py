"""What a search's cells depend on: the model it searches, the calibration windows its probes
run on, and the key their rows are recorded under (a rerun reuses the rows under the same
key); and what its backend makes units. Shared by the driver's probing, pricing and
refinement."""

from __future__ import annotations

import hashlib
import json

from quantdask.backends import get_backend
from quantdask.backends.capabilities import Searchable
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.search import SearchSpec
from quantdask.sweepfile.settings import EvalSettings
from quantdask.sweepfile.sweep import Sweep


def probe_settings(sweep: Sweep, search: SearchSpec, windows: int | None = None
                   ) -> EvalSettings:
    """The probes' windows: ``search.windows`` (or ``windows``) windows of the calibration
    text, as long as the eval's (or the calibration's, if shorter), measured as the eval
    measures KL."""
    calibration, evaluation = sweep.calibration, sweep.eval_for(model_of(sweep, search))
    assert calibration is not None  # check_searches refuses a search without it
    return EvalSettings(text=calibration.text, dataset=calibration.dataset,
                        seq_len=min(calibration.seq_len, evaluation.seq_len),
                        samples=windows or search.windows, batch_size=evaluation.batch_size,
                        kl_top_k=evaluation.kl_top_k, kl_tail_samples=evaluation.kl_tail_samples,
                        bos=evaluation.bos, root=calibration.root
                        ).with_bos(evaluation.bos_token_id)


def model_of(sweep: Sweep, search: SearchSpec) -> ModelSpec:
    """The model ``search`` searches."""
    return next(m for m in sweep.models if m.label == search.model)


def search_key(sweep: Sweep, search: SearchSpec, method: str = "kl") -> str:
    """What a cell's figures depend on: the model, the backend and each format's options, the
    units' granularity, the probes' windows and the sensitivity method (with fisher, the
    positions it keeps). Cells recorded under another key are stale."""
    model = model_of(sweep, search)
    formats = {label: (o.as_dict() if o is not None else None)
               for label, o in search.format_options().items()}
    identity = {"model": model.identity(), "backend": search.backend, "formats": formats,
                "granularity": search.granularity,
                "windows": probe_settings(sweep, search).identity(),
                # what the backend makes units (cells of other units are another search's)
                "units": [embeddings_are_units(search), experts_are_units(search)]}
    if method != "kl":  # (a kl search keeps the key it had before methods existed)
        identity["method"] = [method, search.fisher_tokens]
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def embeddings_are_units(search: SearchSpec) -> bool:
    """Whether the search's backend makes the token embedding and output units too."""
    searchable = get_backend(search.backend).has(Searchable)
    return bool(searchable and searchable.embeddings)


def experts_are_units(search: SearchSpec) -> bool:
    """Whether the search's backend makes fused experts units (``search.members``)."""
    searchable = get_backend(search.backend).has(Searchable)
    return bool(searchable and searchable.experts)
