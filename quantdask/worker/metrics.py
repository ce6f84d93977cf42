"""Quality metrics on a worker: eval windows, the reference's compact form, perplexity, KL
divergence and top-1 agreement (resource measurement is in :mod:`quantdask.worker.measure`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def eval_windows(token_ids: list[int], seq_len: int, samples: int) -> torch.Tensor:
    """The first ``samples`` non-overlapping windows of ``seq_len`` tokens, as a 2-D tensor."""
    import torch

    needed = seq_len * samples
    if len(token_ids) < needed:
        raise ValueError(f"eval text has {len(token_ids)} tokens; eval.samples x eval.seq_len "
                         f"needs {needed}. Lower them or give a longer text")
    return torch.tensor(token_ids[:needed], dtype=torch.long).view(samples, seq_len)


def reference_slice(log_probs: torch.Tensor, k: int | None) -> dict[str, torch.Tensor]:
    """The reference's compact form of one slice of log-probs (batch x positions x vocab): the
    ``k`` most likely tokens' ids (int32) and log-probs (float32), most likely first, and the
    log of the probability mass outside them (``rest``; -inf when there is none). ``k`` None
    keeps every log-prob (exact KL)."""
    import torch

    if k is None or k >= log_probs.size(-1):
        return {"log_probs": log_probs.float().cpu()}
    top, ids = log_probs.topk(k, dim=-1, sorted=True)
    return {"log_probs": top.float().cpu(), "ids": ids.to(torch.int32).cpu(),
            "rest": _log_rest(top).float().cpu()}


def _log_rest(top_log_probs: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(top))), in float64; -inf where the top entries hold all the mass."""
    import torch

    covered = torch.logsumexp(top_log_probs.double(), dim=-1).clamp(max=0.0)
    return torch.log(-torch.expm1(covered))


def exact_sum(values: torch.Tensor) -> float:
    """The exactly rounded sum of ``values`` (any shape), in float64: the same bits whatever
    the order of the terms or torch's thread count."""
    return math.fsum(values.double().flatten().tolist())


SCORES = ("perplexity", "kl_divergence", "top1_agreement", "eval_tokens")
"""What :meth:`QualityMeter.scores` returns."""


class QualityMeter:
    """Perplexity, KL divergence and top-1 agreement against a reference, accumulated slice by
    slice (see :mod:`quantdask.worker.logits`).

    KL is KL(reference || model) per predicted token, averaged over tokens (nats). With a top-k
    reference it is taken over the reference's k most likely tokens plus one bucket for the
    rest of the vocabulary: merging outcomes never increases a KL divergence (the log-sum
    inequality), so it is a lower bound of the exact figure, exact when the bucket is empty.
    Top-1 agreement is the share of positions where both pick the same most likely next token.

    Sums are exact (:func:`exact_sum`): per-position terms are reduced over the vocabulary
    only (each position by one thread), then added exactly rounded. The scores are then the
    same bits whatever torch's thread count (CPU slots lend each other idle cores mid-eval;
    torch's own sum of a large tensor splits it by thread), the order slices arrive in, or how
    a reference's windows were split over workers and merged.
    """

    def __init__(self, windows: torch.Tensor, reference: dict[str, torch.Tensor] | None):
        self.windows = windows
        self.reference = reference
        self.nll: list[float] = []  # one sum per slice
        self.kl: list[float] = []
        self.agree = self.tokens = 0

    def add(self, rows: slice, positions: slice, log_q: torch.Tensor) -> None:
        """Fold in the model's log-probs ``log_q`` for ``rows`` x ``positions``."""
        import torch

        targets = self.windows[rows, positions.start + 1:positions.stop + 1].to(log_q.device)
        self.nll.append(-exact_sum(log_q.gather(-1, targets.unsqueeze(-1))))
        self.tokens += targets.numel()
        if self.reference is None:  # the reference itself: KL 0, top-1 1
            self.agree += targets.numel()
            return
        ref = {name: t[rows, positions].to(log_q.device) for name, t in self.reference.items()}
        log_p = ref["log_probs"]
        if "ids" not in ref:  # exact: every token of the vocabulary
            # Tokens the reference gives probability 0 add nothing (0 * log 0 = 0), not NaN.
            self.kl.append(exact_sum(torch.where(log_p > -math.inf, log_p.exp() * (log_p - log_q),
                                                 0.0).double().sum(-1)))
            self.agree += (log_p.argmax(-1) == log_q.argmax(-1)).sum().item()
            return
        ids = ref["ids"].long()
        log_p, log_q_top = log_p.double(), log_q.gather(-1, ids).double()
        kl = torch.where(log_p > -math.inf, log_p.exp() * (log_p - log_q_top), 0.0).sum(-1)
        rest_p = ref["rest"].double()
        rest_q = _log_rest(log_q_top).clamp(min=math.log(torch.finfo(torch.float64).tiny))
        kl += torch.where(rest_p > -math.inf, rest_p.exp() * (rest_p - rest_q), 0.0)
        self.kl.append(exact_sum(kl))
        self.agree += (ids[..., 0] == log_q.argmax(-1)).sum().item()

    def merge(self, other: QualityMeter) -> None:
        """Fold in the sums of a meter over other windows (a shard of the same eval)."""
        self.nll.extend(other.nll)
        self.kl.extend(other.kl)
        self.agree += other.agree
        self.tokens += other.tokens

    def scores(self) -> dict[str, float]:
        scores = {"perplexity": math.exp(math.fsum(self.nll) / self.tokens),
                  "kl_divergence": max(math.fsum(self.kl) / self.tokens, 0.0),
                  "top1_agreement": self.agree / self.tokens, "eval_tokens": self.tokens}
        broken = [n for n in ("perplexity", "kl_divergence") if not math.isfinite(scores[n])]
        if broken:  # e.g. an fp16 overflow in the quantized model: a failure, not a measurement
            raise ArithmeticError(f"non-finite {', '.join(broken)} ({scores}); the quantized "
                                  "model produced inf/nan logits")
        return scores


def quality(model: torch.nn.Module, windows: torch.Tensor,
            reference: dict[str, torch.Tensor] | None, batch_size: int,
            device: str) -> dict[str, float]:
    """Perplexity on ``windows``, and KL divergence and top-1 agreement against ``reference``
    (see :class:`QualityMeter`), the logits computed a slice of positions at a time."""
    from quantdask.worker.logits import sliced_log_probs

    meter = QualityMeter(windows, reference)
    for piece in sliced_log_probs(model, windows, batch_size, device):
        meter.add(piece.rows, piece.positions, piece.log_probs)
    return meter.scores()
