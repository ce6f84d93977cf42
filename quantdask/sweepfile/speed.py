"""Generation speed settings (a sweep's ``speed:`` block): how each job times greedy generation
on its quantized model, per batch size. See :mod:`quantdask.measure.speed`."""

from __future__ import annotations

from dataclasses import dataclass

from quantdask.errors import SpecError
from quantdask.sweepfile.fields import positive_int, require


@dataclass(frozen=True)
class SpeedSettings:
    """Greedy generation of exactly ``new_tokens`` tokens (no early stop at end-of-text, so
    every config generates as many) after a prompt of ``prompt_length`` tokens of the eval
    text, at each of ``batch_sizes``: ``warmup`` runs not counted, then ``repeats`` timed
    ones. A sweep with a speed block gives each job its whole device (packed jobs would time
    each other). All of it is part of the job ids."""

    prompt_length: int = 128
    new_tokens: int = 64
    batch_sizes: list[int] | tuple[int, ...] = (1,)
    warmup: int = 1
    repeats: int = 3

    def __post_init__(self):
        positive_int("prompt_length", self.prompt_length, "a positive number of tokens")
        positive_int("new_tokens", self.new_tokens, "a positive number of tokens to generate")
        require("batch_sizes", self.batch_sizes, (list, tuple),
                "a non-empty list of batch sizes such as [1, 8]")
        if not self.batch_sizes:
            raise SpecError("batch_sizes", "is empty; give at least one batch size, such as "
                                           "[1, 8]")
        for i, size in enumerate(self.batch_sizes):
            positive_int(f"batch_sizes[{i}]", size, "a positive batch size")
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise SpecError("batch_sizes", f"names a batch size twice: {list(self.batch_sizes)}")
        object.__setattr__(self, "batch_sizes", tuple(self.batch_sizes))
        require("warmup", self.warmup, int, "a number of untimed runs >= 0")
        if self.warmup < 0:
            raise SpecError("warmup", f"must be >= 0, got {self.warmup}")
        positive_int("repeats", self.repeats, "a positive number of timed runs")

    def identity(self) -> dict:
        return {"prompt_length": self.prompt_length, "new_tokens": self.new_tokens,
                "batch_sizes": list(self.batch_sizes), "warmup": self.warmup,
                "repeats": self.repeats}
