"""Lengths a model cannot take, refused before anything runs.

Every length a sweep asks of a model (the eval windows, the calibration windows of a calibrated
backend, the speed block's prompt plus its new tokens, lm-eval's ``max_length``) is checked
against the most positions the model takes, read from its config.json alone (nothing is loaded
or started): ``max_position_embeddings``, or its family's own field (GPT-2's ``n_positions``,
...). transformers does not enforce that limit for a rotary family: a longer input runs and
returns numbers that mean nothing, so it is refused here instead, naming the field. A family
that sets no hard limit (ALiBi, state-space models) is checked against nothing, and the plan
says so.

>>> check_lengths(load_sweep("sweep.yaml"))  # doctest: +SKIP
Traceback (most recent call last):
quantdask.errors.LengthError: eval.seq_len: 4,096 tokens, but model 'demo-llama' takes at ...
"""

from __future__ import annotations

from dataclasses import dataclass

from quantdask.backends import get_backend
from quantdask.errors import LengthError
from quantdask.plan.model_facts import position_limit, read_config
from quantdask.sweepfile.model import ModelSpec
from quantdask.sweepfile.sweep import Sweep


@dataclass(frozen=True)
class PositionLimit:
    """The most positions a model takes (None: no hard limit, or its config is not here) and
    what says so."""

    positions: int | None
    source: str


def model_position_limit(model: ModelSpec) -> PositionLimit:
    """``model``'s limit from its local config.json (a hub model's config is not fetched)."""
    if model.hub:
        return PositionLimit(None, "a hub model: its config.json is not read on the driver")
    return PositionLimit(*position_limit(read_config(model.location)))


def asked_lengths(sweep: Sweep) -> list[tuple[str, str, int]]:
    """(field, what is asked in words, tokens) for every length ``sweep`` asks of its models."""
    asked = [("eval.seq_len", "", sweep.eval.seq_len)]
    calibrated = any(get_backend(block.backend).calibrated for block in sweep.backends)
    if sweep.calibration is not None and calibrated:
        asked.append(("calibration.seq_len", "", sweep.calibration.seq_len))
    speed = sweep.speed
    if speed is not None:
        field = ("speed.prompt_length" if speed.prompt_length > speed.new_tokens
                 else "speed.new_tokens")
        asked.append((field, f"prompt_length + new_tokens = {speed.prompt_length:,} + "
                             f"{speed.new_tokens:,} = ", speed.prompt_length + speed.new_tokens))
    if sweep.tasks is not None and sweep.tasks.max_length is not None:
        asked.append(("tasks.max_length", "", sweep.tasks.max_length))
    return asked


def check_lengths(sweep: Sweep) -> dict[str, PositionLimit]:
    """Each model's :class:`PositionLimit` by label; raises :class:`LengthError` naming every
    length ``sweep`` asks that some model cannot take. Reads config.json files only: called
    by ``quantdask run`` before a cluster starts, by ``start_session`` (every ``submit_sweep``
    and ``run_sweep``) before placement, and by ``plan_sweep``."""
    limits = {model.label: model_position_limit(model) for model in sweep.models}
    too_long = [(field, words, tokens, label, limit.positions, limit.source)
                for field, words, tokens in asked_lengths(sweep)
                for label, limit in limits.items()
                if limit.positions is not None and tokens > limit.positions]
    if too_long:
        raise LengthError(too_long)
    return limits
