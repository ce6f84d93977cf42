"""Quality metrics on a worker: eval windows, the reference's compact form, perplexity, KL
divergence and top-1 agreement, kept per position so that each has its error bar (see
:mod:`quantdask.measure.statistics`; resource measurement is in :mod:`quantdask.measure.usage`).

KL against a top-k reference is exact over the top k and estimated over the rest of the
vocabulary (the tail) from tokens sampled from the reference's tail in proportion to their
probability. With p the reference and q the model, r = q / p, p_T and q_T their tail masses:

    KL_tail = sum_tail p log(p / q) = (p_T - q_T) + p_T * E_{v ~ p | tail}[r - 1 - log r]

The first term is known exactly. The tokens are drawn in proportion to p, so the samples' mean
of r - 1 - log r is an unbiased estimate of the expectation (the "k3" estimator of KL); the
term is never negative, and about (log r)^2 / 2 where the two models are close (r near 1),
which keeps its relative spread small there. Its sampling noise is part of the per-position
values, so it is in the KL's standard error too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from quantdask.measure.statistics import (
    QUALITY_COLUMNS,
    quality_figures,
    token_hash,
    window_rows,
)
from quantdask.records import Quality, WindowRow

if TYPE_CHECKING:
    import torch


def text_ids(tokenizer, text: str, bos_token_id: int | None) -> list[int]:
    """``text``'s token ids as windows are cut from them: where a BOS starts every window
    (``bos_token_id``), the text alone, without the special tokens the tokenizer would add
    once (no second BOS in window 0, no EOS); else as the tokenizer encodes it."""
    if bos_token_id is None:
        return tokenizer(text)["input_ids"]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def with_bos(body: torch.Tensor, bos_token_id: int | None) -> torch.Tensor:
    """Rows of text tokens (rows x n), each behind ``bos_token_id`` (rows x n + 1); as they
    are without one."""
    import torch

    if bos_token_id is None:
        return body
    return torch.cat([body.new_full((body.size(0), 1), bos_token_id), body], dim=1)


def eval_windows(token_ids: list[int], seq_len: int, samples: int,
                 bos_token_id: int | None = None) -> torch.Tensor:
    """The first ``samples`` non-overlapping windows of ``seq_len`` tokens, as a 2-D tensor;
    with ``bos_token_id``, each that token and the next ``seq_len`` - 1 of the text."""
    import torch

    body = seq_len - (bos_token_id is not None)
    needed = body * samples
    if len(token_ids) < needed:
        raise ValueError(f"eval text has {len(token_ids)} tokens; eval.samples x eval.seq_len "
                         f"needs {needed}. Lower them or give a longer text")
    windows = torch.tensor(token_ids[:needed], dtype=torch.long).view(samples, body)
    return with_bos(windows, bos_token_id)


TAIL_SEED = 20261202
"""Seeds each window's tail-sampling offsets (with the window's index): the same samples
whichever worker computes the window, and on every rerun."""


def compact_is_larger(vocab: int, k: int, tail_samples: int) -> bool:
    """Whether the compact form of a position (k ids and log-probs, m tail samples, the rest)
    takes more bytes than the whole distribution: then the reference keeps the whole (exact)."""
    return 4 * vocab <= 8 * k + 8 * tail_samples + 4


def tail_offsets(rows: range, positions: int) -> torch.Tensor:
    """Uniform offsets in [0, 1) for systematic sampling, one per position of each window in
    ``rows`` (float64, rows x positions), drawn from a generator seeded by the window."""
    import torch

    return torch.stack([torch.rand(positions, dtype=torch.float64,
                                   generator=torch.Generator().manual_seed(TAIL_SEED + row))
                        for row in rows])


def reference_slice(log_probs: torch.Tensor, k: int | None, tail_samples: int = 0,
                    offsets: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The reference's compact form of one slice of log-probs (batch x positions x vocab): the
    ``k`` most likely tokens' ids (int32) and log-probs (float32), most likely first, the log
    of the probability mass outside them (``rest``; -inf when there is none) and, with
    ``tail_samples`` m > 0, m tokens of that tail sampled in proportion to their probability
    (``tail_ids``, ``tail_log_probs``; systematic sampling at ``offsets``, batch x positions).
    ``k`` None, or a vocabulary so small that the compact form would be larger, keeps every
    log-prob (exact KL)."""
    import torch

    if k is None or k >= log_probs.size(-1) or compact_is_larger(log_probs.size(-1), k,
                                                                  tail_samples):
        return {"log_probs": log_probs.float().cpu()}
    top, ids = log_probs.topk(k, dim=-1, sorted=True)
    part = {"log_probs": top.float().cpu(), "ids": ids.to(torch.int32).cpu(),
            "rest": _log_rest(top).float().cpu()}
    if tail_samples:
        if offsets is None:
            raise ValueError("sampling the tail needs each position's offsets")
        tail_ids = sample_tail(log_probs, ids, tail_samples, offsets)
        part["tail_ids"] = tail_ids.to(torch.int32).cpu()
        part["tail_log_probs"] = log_probs.gather(-1, tail_ids).float().cpu()
    return part


TAIL_CHUNK_BYTES = 16 * 2**20
"""Float64 probabilities held at once while sampling a slice's tails."""


def sample_tail(log_probs: torch.Tensor, top_ids: torch.Tensor, m: int,
                offsets: torch.Tensor) -> torch.Tensor:
    """``m`` token ids per position drawn from the distribution outside ``top_ids``, each
    token in proportion to its probability: systematic sampling, the targets (offset + j) / m
    of the tail's cumulative mass (j = 0..m-1), so each token is drawn m * p / p_tail times in
    expectation. A few positions at a time, in float64."""
    import torch

    vocab = log_probs.size(-1)
    flat = log_probs.reshape(-1, vocab)
    top = top_ids.reshape(-1, top_ids.size(-1))
    starts = offsets.reshape(-1, 1).to(flat.device) + torch.arange(
        m, dtype=torch.float64, device=flat.device)
    chosen = torch.empty((flat.size(0), m), dtype=torch.long, device=flat.device)
    step = max(1, TAIL_CHUNK_BYTES // (8 * vocab))
    for begin in range(0, flat.size(0), step):
        end = begin + step
        # One float64 copy of the chunk, turned in place into the tail's cumulative mass.
        cumulative = flat[begin:end].to(torch.float64, copy=True)
        cumulative.exp_().scatter_(1, top[begin:end], 0.0).cumsum_(dim=1)
        targets = starts[begin:end] / m * cumulative[:, -1:]
        chosen[begin:end] = torch.searchsorted(cumulative, targets, right=True).clamp_(
            max=vocab - 1)
    return chosen.view(*log_probs.shape[:-1], m)


def _log_rest(top_log_probs: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(top))), in float64; -inf where the top entries hold all the mass."""
    import torch

    covered = torch.logsumexp(top_log_probs.double(), dim=-1).clamp(max=0.0)
    return torch.log(-torch.expm1(covered))


def exact_sum(values: torch.Tensor) -> float:
    """The exactly rounded sum of ``values`` (any shape), in float64: the same bits whatever
    the order of the terms or torch's thread count."""
    return math.fsum(values.double().flatten().tolist())


SCORES = QUALITY_COLUMNS
"""What :meth:`QualityMeter.scores` returns."""


class QualityMeter:
    """Perplexity, KL divergence and top-1 agreement against a reference, and the change in the
    correct token's probability, per position, filled slice by slice (see
    :mod:`quantdask.measure.logits`); :meth:`scores` turns them into the record's figures with
    their error bars (:mod:`quantdask.measure.statistics`).

    KL is KL(reference || model) per predicted token (nats): exact with a full reference; with
    a top-k one, exact over the top k plus the tail estimated from the reference's tail samples
    (unbiased: see the module), or, without tail samples, the tail taken as one bucket (merging
    outcomes never increases a KL divergence, so that is a lower bound). Top-1 agreement is
    whether both pick the same most likely next token.

    Each position's value is reduced over the vocabulary by one thread, and means are exactly
    rounded sums of the per-position values: the scores are the same bits whatever torch's
    thread count, the order slices arrive in, or how a reference's windows were split over
    workers and merged. ``reference`` None measures the reference model itself (KL 0).
    """

    def __init__(self, windows: torch.Tensor, reference: dict[str, torch.Tensor] | None):
        import torch

        self.windows = windows
        self.reference = reference
        shape = (windows.size(0), windows.size(1) - 1)
        self.nll = torch.full(shape, math.nan, dtype=torch.float64)
        self.kl = torch.zeros(shape, dtype=torch.float64)
        self.delta_p = torch.zeros(shape, dtype=torch.float64)
        self.agree = torch.zeros(shape, dtype=torch.bool)
        self.seen = torch.zeros(shape, dtype=torch.bool)

    def add(self, rows: slice, positions: slice, log_q: torch.Tensor) -> None:
        """Fold in the model's log-probs ``log_q`` for ``rows`` x ``positions``."""
        targets = self.windows[rows, positions.start + 1:positions.stop + 1].to(log_q.device)
        target_log_q = log_q.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double()
        self.nll[rows, positions] = -target_log_q.cpu()
        self.seen[rows, positions] = True
        if self.reference is None:  # the reference itself: KL 0, top-1 1, no change
            self.agree[rows, positions] = True
            return
        ref = {name: t[rows, positions].to(log_q.device) for name, t in self.reference.items()}
        kl, agree = _kl_and_agreement(ref, log_q)
        self.kl[rows, positions] = kl.cpu()
        self.agree[rows, positions] = agree.cpu()
        if "target_log_probs" in ref:
            self.delta_p[rows, positions] = (target_log_q.exp()
                                             - ref["target_log_probs"].double().exp()).cpu()

    @classmethod
    def joined(cls, windows: torch.Tensor, meters: list[QualityMeter],
               reference: dict[str, torch.Tensor] | None = None) -> QualityMeter:
        """One meter over ``windows`` (against ``reference``, the parts' joined) from meters
        over consecutive parts of them, in order."""
        import torch

        whole = cls(windows, reference)
        for name in ("nll", "kl", "delta_p", "agree", "seen"):
            setattr(whole, name, torch.cat([getattr(m, name) for m in meters]))
        return whole

    def window_rows(self) -> list[WindowRow]:
        """The windows frame's rows (see ``statistics.window_rows``)."""
        return window_rows(self.nll.numpy(), self.kl.numpy(), self.agree.numpy(),
                           self.delta_p.numpy(),
                           [token_hash(window.numpy()) for window in self.windows.cpu()])

    def scores(self) -> Quality:
        """The record's quality figures (see ``statistics.quality_figures``)."""
        if not bool(self.seen.all()):
            raise ValueError(f"{int((~self.seen).sum())} positions were never measured")
        reference_nll = None
        if self.reference is not None and "target_log_probs" in self.reference:
            reference_nll = -self.reference["target_log_probs"].double().numpy()
        delta_p = self.delta_p.numpy() if reference_nll is not None else None
        if self.reference is None:
            reference_nll, delta_p = self.nll.numpy(), self.delta_p.numpy()
        scores = quality_figures(self.nll.numpy(), self.kl.numpy(), self.agree.numpy(),
                                 delta_p, reference_nll)
        broken = [n for n, value in (("perplexity", scores.perplexity),
                                     ("kl_divergence", scores.kl_divergence))
                  if not math.isfinite(value)]
        if broken:  # e.g. an fp16 overflow in the quantized model: a failure, not a measurement
            raise ArithmeticError(f"non-finite {', '.join(broken)} ({scores}); the quantized "
                                  "model produced inf/nan logits")
        return scores


def _kl_and_agreement(ref: dict[str, torch.Tensor], log_q: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: KL(reference || model) and whether their top-1 tokens agree."""
    import torch

    log_p = ref["log_probs"]
    if "ids" not in ref:  # exact: every token of the vocabulary
        # Tokens the reference gives probability 0 add nothing (0 * log 0 = 0), not NaN.
        kl = torch.where(log_p > -math.inf, log_p.exp() * (log_p - log_q), 0.0).double().sum(-1)
        return kl, log_p.argmax(-1) == log_q.argmax(-1)
    ids = ref["ids"].long()
    log_p, log_q_top = log_p.double(), log_q.gather(-1, ids).double()
    kl = torch.where(log_p > -math.inf, log_p.exp() * (log_p - log_q_top), 0.0).sum(-1)
    rest_p = ref["rest"].double()
    rest_q = _log_rest(log_q_top).clamp(min=math.log(torch.finfo(torch.float64).tiny))
    if "tail_ids" in ref:
        log_r = (log_q.gather(-1, ref["tail_ids"].long()).double()
                 - ref["tail_log_probs"].double())
        # r - 1 - log r, accurate for small log r; its mean over the samples estimates
        # E[r - 1 - log r] over the reference's tail (see the module).
        excess = (torch.expm1(log_r) - log_r).mean(-1)
        tail = rest_p.exp() - rest_q.exp() + rest_p.exp() * excess
    else:  # the tail as one bucket: a lower bound
        tail = rest_p.exp() * (rest_p - rest_q)
    kl += torch.where(rest_p > -math.inf, tail, 0.0)
    return kl, ids[..., 0] == log_q.argmax(-1)


def measure_quality(model: torch.nn.Module, windows: torch.Tensor,
                    reference: dict[str, torch.Tensor] | None, batch_size: int,
                    device: str, on_batch=None) -> QualityMeter:
    """``model`` measured on ``windows`` against ``reference`` (see :class:`QualityMeter`),
    the logits computed a slice of positions at a time (``on_batch``: see
    ``logits.sliced_log_probs``)."""
    from quantdask.measure.logits import sliced_log_probs

    meter = QualityMeter(windows, reference)
    for piece in sliced_log_probs(model, windows, batch_size, device, on_batch=on_batch):
        meter.add(piece.rows, piece.positions, piece.log_probs)
    return meter


def quality(model: torch.nn.Module, windows: torch.Tensor,
            reference: dict[str, torch.Tensor] | None, batch_size: int,
            device: str) -> Quality:
    """The quality figures of ``model`` on ``windows`` (see ``measure_quality``)."""
    return measure_quality(model, windows, reference, batch_size, device).scores()
