"""What is known of a search before anything runs, from the sweep file, the model's shapes and
its tokenizer: what its scoring costs by method, the method ``sensitivity: auto`` picks, and
the mistakes refused there (a budget below the least the shapes allow, windows the calibration
text cannot fill).

Costs are counted in multiply-adds of weights by tokens (a window's forward is about its tokens
times the model's weights): the part of the work that differs between the methods. Each cell's
quantization is the same for both and is left out, as is attention's quadratic term.

- ``kl``: each cell runs the calibration windows through the model from its unit's layer on
  (``search.probes``): windows x seq_len x (the weights from that layer to the output).
- ``fisher``: one forward and backward pass per batch (about 3 forwards of every window), then
  each cell's dY = (Q(W) - W) x on the kept positions: fisher_tokens x the unit's weights.
- both: each format on every unit at once, one whole forward each (the fit's and the
  prediction check's); the verifying jobs, one eval forward each.

``auto`` picks ``fisher`` where ``kl``'s cells would be more than :data:`AUTO_KL_SHARE` of the
search's work (its cells, its whole-format measures and its verifying jobs), and ``kl``
otherwise, or where a unit is no module (fused experts: a backward pass has no output of
theirs to capture).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quantdask.errors import SpecError

if TYPE_CHECKING:
    from quantdask.backends.base import ModelFacts
    from quantdask.search.cells import SearchUnits
    from quantdask.sweepfile.search import SearchSpec
    from quantdask.sweepfile.sweep import Sweep

AUTO_KL_SHARE = 0.5
"""``auto`` picks fisher where kl's cells would be more than this share of the search's work."""


@dataclass(frozen=True)
class MethodChoice:
    """The method a search scores its cells by, why, and each side's cost (multiply-adds;
    see the module): ``kl`` and ``fisher`` the cells' by each method, ``shared`` the
    whole-format measures' and the verifying jobs' (the same for both)."""

    method: str
    why: str
    kl: float
    fisher: float
    shared: float


def _layer(name: str) -> int | None:
    found = re.search(r"\.(\d+)(\.|$)", name)
    return int(found.group(1)) if found else None


def cell_costs(sweep: Sweep, search: SearchSpec, units: SearchUnits
               ) -> tuple[float, float, float]:
    """(kl's cells, fisher's passes and cells, the work both share), in multiply-adds."""
    from quantdask.search.identity import model_of, probe_settings

    settings = probe_settings(sweep, search)
    tokens = settings.samples * settings.seq_len
    formats = [o for o in search.format_options().values() if o is not None]
    weights = {u: sum(units.shapes.get(m, (0, 0))[0] for m in members)
               for u, members in units.units.items()}
    body = sum(weights.values())
    layers = max(units.layers, 1)
    kl = 0.0
    for members in units.units.values():
        index = _layer(members[0])
        after = 1.0 if index is None else (layers - index) / layers
        kl += len(formats) * tokens * (units.param_count - body + body * after)
    fisher = 3 * tokens * units.param_count + len(formats) * min(
        search.fisher_tokens, tokens) * body
    evaluation = sweep.eval_for(model_of(sweep, search))
    jobs = 2 * len(formats) + search.candidates * len(search.budgets() or (1,))
    shared = (len(formats) * tokens + jobs * evaluation.samples * evaluation.seq_len
              ) * units.param_count
    return kl, fisher, shared


def choose_method(sweep: Sweep, search: SearchSpec, units: SearchUnits) -> MethodChoice:
    """The method ``search`` scores ``units``' cells by (see the module); an explicit
    ``fisher`` on units that are no modules is a :class:`SpecError`."""
    kl, fisher, shared = cell_costs(sweep, search, units)
    parameters = [m for members in units.units.values() for m in members
                  if _is_parameter(m)]
    where = f"searches[{list(sweep.searches).index(search)}].sensitivity"
    if parameters and search.sensitivity == "fisher":
        raise SpecError(where, f"fisher captures each unit's output, and {parameters[0]} is a "
                               "fused experts parameter with none: use kl (or auto)")
    share = kl / (kl + shared) if kl + shared else 0.0
    costs = (f"kl's cells {kl:.3g} multiply-adds, {share:.0%} of the search's work; fisher's "
             f"passes and cells {fisher:.3g} ({fisher / kl if kl else 0:.2g}x kl's)")
    if search.sensitivity != "auto":
        return MethodChoice(search.sensitivity, f"as the search says ({costs})", kl, fisher,
                            shared)
    if parameters:
        return MethodChoice("kl", f"auto: the model's fused experts are parameters, whose "
                                  f"outputs a backward pass cannot capture ({costs})",
                            kl, fisher, shared)
    if share > AUTO_KL_SHARE:
        return MethodChoice("fisher", f"auto: {costs}, over {AUTO_KL_SHARE:.0%}", kl, fisher,
                            shared)
    return MethodChoice("kl", f"auto: {costs}, within {AUTO_KL_SHARE:.0%}", kl, fisher,
                        shared)


def _is_parameter(member: str) -> bool:
    """Whether a member is a fused experts parameter (``model.layers.0.mlp.experts.down_proj``,
    no module of its own; ``search.members``)."""
    from quantdask.backends.per_module import expert_projections

    return expert_projections(member) is not None


def units_from_facts(search: SearchSpec, facts: ModelFacts) -> SearchUnits:
    """The search's units as the driver reads them from the model's shapes (``ModelFacts``:
    the model built on the meta device), for pricing before anything runs: the linears of
    the decoder layers (per layer at ``block``), the token embedding where the backend makes
    it a unit, each with its weights."""
    from quantdask.search.cells import SearchUnits
    from quantdask.search.identity import embeddings_are_units

    units: dict[str, tuple[str, ...]] = {}
    shapes: dict[str, tuple[int, int]] = {}
    for name, kind, count in facts.weight_modules:
        layer = _layer(name)
        is_embedding = kind.__name__ == "Embedding"
        if is_embedding and embeddings_are_units(search) and layer is None:
            units[name], shapes[name] = (name,), (count, 0)
        elif layer is not None and kind.__name__ in ("Linear", "Conv1D"):
            unit = name if search.granularity == "linear" else _layer_name(name)
            units[unit] = (*units.get(unit, ()), name)
            shapes[name] = (count, 0)
    return SearchUnits(units, facts.param_count, shapes, facts.layers)


def _layer_name(name: str) -> str:
    found = re.search(r"^(.*?\.\d+)(\.|$)", name)
    return found.group(1) if found else name


def price_lines(sweep: Sweep, search: SearchSpec, facts: ModelFacts) -> list[str]:
    """What the plan says of ``search``'s cost before it runs: its cells, each method's
    multiply-adds and seconds at this machine's rate (one thread), and the method it uses."""
    from quantdask.plan.shape_prices import multiply_adds_per_s

    if not facts.param_count:
        return [f"search {search.name}: its model's shapes are unknown here; priced when its "
                "units are read on a worker"]
    units = units_from_facts(search, facts)
    cells = len(units.units) * len(search.formats)
    choice = choose_method(sweep, search, units)
    rate = multiply_adds_per_s()
    quantizing = quantize_seconds(search, units)
    return [f"search {search.name}: {len(units.units)} units x {len(search.formats)} formats "
            f"= {cells} cells; by kl about {choice.kl / rate + quantizing:,.0f} s, by fisher "
            f"about {choice.fisher / rate + quantizing:,.0f} s, each with {quantizing:,.0f} s "
            f"of quantizing (timed here on a {TIMED_ROWS} x {TIMED_ROWS} linear per format), "
            f"and {choice.shared / rate + quantizing:,.0f} s more both share (whole formats, "
            f"verifying jobs' forwards); one thread at {rate:.2g} multiply-adds/s",
            f"search {search.name}: sensitivity {choice.method}: {choice.why}"]


TIMED_ROWS = 1024
"""The side of the linear :func:`quantize_seconds` times each format on."""


def quantize_seconds(search: SearchSpec, units: SearchUnits) -> float:
    """Seconds to quantize every unit once in every format and back to float (each cell's
    own quantization, the same for both methods), on one thread: each format's weights per
    second timed here on one random linear (``probes.swapped_weight``); 0 where a format
    cannot be timed here (its library missing)."""
    weights = sum(count for count, _ in units.shapes.values())
    return sum(weights / rate for options in search.format_options().values()
               if options is not None and (rate := _quantize_rate(search.backend, options)))


_RATES: dict[str, float | None] = {}


def _quantize_rate(backend_name: str, options) -> float | None:
    """Weights per second ``options`` quantizes and dequantizes here, timed once."""
    import json

    key = json.dumps([backend_name, options.as_dict()], sort_keys=True, default=str)
    if key not in _RATES:
        _RATES[key] = _timed_rate(backend_name, options)
    return _RATES[key]


def _timed_rate(backend_name: str, options) -> float | None:
    import time

    import torch

    from quantdask.backends import get_backend
    from quantdask.search.probes import swapped_weight

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(TIMED_ROWS, TIMED_ROWS, bias=False)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = One()
        began = time.perf_counter()
        swapped_weight(model, "linear", get_backend(backend_name), options)
        return TIMED_ROWS ** 2 / max(time.perf_counter() - began, 1e-9)
    except Exception:  # noqa: BLE001 - a library missing here: left out of the estimate
        return None
    finally:
        torch.set_num_threads(threads)


def check_budget_from_shapes(sweep: Sweep, search: SearchSpec, facts: ModelFacts) -> None:
    """Refuse, before anything runs, a budget below the least the model could take: every
    unit at its format's fewest bits (``Searchable.least_bits``, a lower bound) and the
    weights outside the units at their fewest (``Searchable.rest_bits``, else the loaded
    dtype). A budget above that bound but below the bytes as probed is still refused, after
    the probes (``searches.check_budgets``), with the exact figure."""
    from quantdask.backends import get_backend
    from quantdask.backends.capabilities import Searchable

    if not facts.param_count:
        return
    searchable = get_backend(search.backend).has(Searchable)
    assert searchable is not None  # SearchSpec refuses an unsearchable backend
    bits = []
    for options in search.format_options().values():
        if options is None:
            bits.append(float(facts.loaded_bits))
            continue
        found = (searchable.least_bits(options) if searchable.least_bits is not None
                 else options.get("bits"))
        if found is None:
            return  # a format whose least is unknown here: checked after the probes
        bits.append(float(found))
    units = units_from_facts(search, facts)
    inside = sum(count for count, _ in units.shapes.values())
    rest_bits = searchable.rest_bits or facts.loaded_bits
    # The weights known to be outside the units (norms, the head or embeddings left out):
    # at most the parameter count's rest (a head tied to the embedding is listed twice);
    # any other weight (fused experts, no module of their own) may be a unit's.
    members = {m for found in units.units.values() for m in found}
    outside = min(sum(count for name, _, count in facts.weight_modules if name not in members),
                  facts.param_count - inside)
    least = ((facts.param_count - outside) * min(bits) + outside * rest_bits) / 8
    budgets = [8 * search.budget["bytes"] / facts.param_count] if "bytes" in search.budget \
        else []
    for budget in [*budgets, *search.budgets()]:
        if budget * facts.param_count / 8 < least:
            where = f"searches[{list(sweep.searches).index(search)}].budget"
            raise SpecError(where, f"{budget:g} bits per weight is below the least "
                                   f"{search.model} can take with these formats, at least "
                                   f"{8 * least / facts.param_count:.3f} (every unit at "
                                   f"{min(bits):g} bits, the {outside:,} weights outside the "
                                   f"units at {rest_bits}): raise it or "
                                   "offer smaller formats")


def check_windows(sweep: Sweep, search: SearchSpec) -> None:
    """Refuse, before any task, a search whose probe or refinement windows the calibration
    text cannot fill (read with the model's tokenizer on the driver; a hub model's is not
    fetched here)."""
    from quantdask.measure.metrics import text_ids
    from quantdask.search.identity import model_of, probe_settings

    model = model_of(sweep, search)
    refinement = search.refinement()
    asked = [("windows", search.windows)]
    if refinement is not None:
        asked.append(("refine.windows", refinement.windows))
    field, windows = max(asked, key=lambda pair: pair[1])
    if model.hub:
        return
    from transformers import AutoTokenizer

    settings = probe_settings(sweep, search, windows)
    tokenizer = AutoTokenizer.from_pretrained(model.location,
                                              trust_remote_code=model.trust_remote_code)
    tokens = len(text_ids(tokenizer, settings.read_text(), settings.bos_token_id))
    body = settings.seq_len - (settings.bos_token_id is not None)
    if tokens < body * windows:
        where = f"searches[{list(sweep.searches).index(search)}].{field}"
        raise SpecError(where, f"{windows} windows of {settings.seq_len} tokens need "
                               f"{body * windows:,} tokens of the calibration text, which holds "
                               f"{tokens:,}: lower it to {tokens // max(body, 1)} or give a "
                               "longer calibration text")


def captured_bytes(search: SearchSpec, found: SearchUnits) -> int:
    """What the Fisher captures hold in all, at most: ``fisher_tokens`` positions of each
    member's input and output widths in float32 (inputs shared by several units, q/k/v, are
    kept once: fewer in fact)."""
    return 4 * search.fisher_tokens * sum(widths for _, widths in found.shapes.values())
