"""Fisher sensitivity of a search's cells: one forward and one backward pass of the
full-precision model per batch of calibration windows scores every (unit, format) cell at
once, where a KL probe runs part of the model again for each cell.

The loss is the log-likelihood of tokens *sampled from the model's own distribution* at every
predicted position, not KL to that distribution (whose gradient at the model itself is zero)
nor the text's next tokens (the empirical Fisher, which weighs positions by how wrong the model
is on this text). With sampled tokens, E[g g^T] is the true Fisher of the model's predictive
distribution, the Hessian of KL(reference || quantized) at the reference: a unit whose output
moves by dY adds, to second order,

    KL ~ 1/2 * sum over positions and output features of g^2 * dY^2   (nats, summed)

where g is the gradient at the unit's output (a diagonal stand-in for the Hessian, as NVIDIA
ModelOpt's AutoQuantize takes) and dY = (Q(W) - W) x on the unit's captured input x. Divided
by the positions, it is a KL per token, as the probes measure; the search then fits it to the
measured whole-model KLs (``search.fisher_fit``), since the diagonal and second-order terms are
approximations.

Q(W) is the weight the probes swap in (``probes.swapped_weight``: the backend's own quantizer,
libggml's for GGUF), with the same stored bytes.

The captured tensors are large (for each unit, positions x (in + out) floats), so each batch
keeps a random subset of its predicted positions, the same for every unit (uniform without
replacement); the sum over them is scaled by positions / kept, an unbiased estimate of the
batch's sum. Units that read the same input tensor (q, k and v) keep it once.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from dask.sizeof import sizeof

from quantdask.errors import UnsupportedHere

if TYPE_CHECKING:
    import torch

SCORE_ROWS = 256
"""Captured positions scored per matmul (bounds the temporary dY: rows x out floats)."""


@dataclass(frozen=True)
class Captured:
    """One batch's capture (see the module): for each hooked module, the key of its input in
    ``inputs`` ((kept, in) float32; an embedding's: (kept,) token ids) and its squared output
    gradients ``grads2`` ((kept, out) float32); ``positions`` predicted in the batch,
    ``kept`` of them captured; ``modules_of``: each searched member's hooked modules
    (:func:`scored_modules`)."""

    rows: tuple[int, int]
    positions: int
    kept: int
    input_of: dict[str, str]
    inputs: dict[str, torch.Tensor]
    grads2: dict[str, torch.Tensor]
    seconds: float
    modules_of: dict[str, list[str]] = field(default_factory=dict)

    def only(self, members: list[str]) -> Captured:
        """The part of this capture that scoring ``members`` reads (their modules' inputs
        and gradients): what a chunk of cells is sent, not every unit's."""
        modules = {m for member in members for m in self.modules_of[member]}
        input_of = {m: key for m, key in self.input_of.items() if m in modules}
        return replace(self, input_of=input_of,
                       inputs={key: self.inputs[key] for key in set(input_of.values())},
                       grads2={m: g for m, g in self.grads2.items() if m in modules},
                       modules_of={m: self.modules_of[m] for m in members})

    @property
    def nbytes(self) -> int:
        tensors = [*self.inputs.values(), *self.grads2.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


@sizeof.register(Captured)
def _captured_size(captured: Captured) -> int:
    return captured.nbytes


def scored_modules(model: torch.nn.Module, members: list[str]) -> dict[str, list[str]]:
    """member -> the modules whose output its weight makes: itself, and the output head where
    the member is the token embedding the head shares its weight with. A member that is no
    module (fused experts, a parameter) has no output to hook: :class:`UnsupportedHere`."""
    found = {}
    output = model.get_output_embeddings()  # type: ignore[operator]
    for name in members:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise UnsupportedHere(f"{name} is a parameter (fused experts), not a module whose "
                                  "output a backward pass can capture: use sensitivity: kl"
                                  ) from None
        modules = [name]
        if output is not None and output is not module and output.weight is module.weight:
            modules.append(next(n for n, m in model.named_modules() if m is output))
        found[name] = modules
    return found


def capture_batch(model: torch.nn.Module, windows: torch.Tensor, rows: tuple[int, int],
                  modules: list[str], keep: int, seed: int, device: str) -> Captured:
    """One forward and backward pass over ``windows[rows[0]:rows[1]]`` (see the module):
    ``modules``' inputs and squared output gradients at ``keep`` of the batch's predicted
    positions (all, where it has fewer), the tokens and positions drawn with ``seed``."""
    import torch

    began = time.perf_counter()
    batch = windows[rows[0]:rows[1]].to(device)
    size, length = int(batch.shape[0]), int(batch.shape[1])
    generator, predicted = torch.Generator().manual_seed(seed), size * (length - 1)
    flat = _kept_positions(size, length, keep, generator).to(device)
    inputs: dict[str, torch.Tensor] = {}
    input_of: dict[str, str] = {}
    grads2: dict[str, torch.Tensor] = {}
    # id of an input tensor -> (its key, a weak reference: a later tensor that takes a freed
    # one's id is no longer it; holding the inputs themselves would keep them all alive)
    seen_inputs: dict[int, tuple[str, weakref.ref]] = {}
    hooks = []

    def rows_of(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(size * length, *tensor.shape[2:]).index_select(0, flat)

    def pre_hook(name: str):
        def hook(module, args):
            held = args[0]
            key, alive = seen_inputs.get(id(held), (None, None))
            if key is None or alive is None or alive() is not held:
                key, seen_inputs[id(held)] = name, (name, weakref.ref(held))
                captured = rows_of(held.detach())
                inputs[key] = captured if captured.dtype == torch.long else captured.float().cpu()
            input_of[name] = key
        return hook

    def forward_hook(name: str):
        def hook(module, args, output):
            if not output.requires_grad:  # the first module run (the embedding): a leaf
                output = output.detach().requires_grad_(True)

            def on_grad(grad):
                grads2[name] = rows_of(grad.detach()).float().pow(2).cpu()
            output.register_hook(on_grad)
            return output
        return hook

    try:
        for name in dict.fromkeys([embedding_name(model), *modules]):
            module = model.get_submodule(name)
            if name in modules:
                hooks.append(module.register_forward_pre_hook(pre_hook(name)))
            hooks.append(module.register_forward_hook(forward_hook(name)))
        with _weights_frozen(model):
            _sampled_log_likelihood(model, batch, generator).backward()
    finally:
        for hook in hooks:
            hook.remove()
    for name in modules:  # a module the pass never reached: no gradient
        grads2.setdefault(name, torch.zeros(len(flat), _out_width(model, name)))
    return Captured(rows, predicted, len(flat), input_of, inputs, grads2,
                    time.perf_counter() - began)


@contextlib.contextmanager
def _weights_frozen(model: torch.nn.Module) -> Iterator[None]:
    """No weight's gradient is wanted, only the outputs': with the weights frozen, the graph
    starts at the embedding's output, and the backward computes no weight gradient (they
    would take the model's size again, 6.2 GB at 1.5B, and stay on it)."""
    frozen = [p for p in model.parameters() if p.requires_grad]
    try:
        for parameter in frozen:
            parameter.requires_grad_(False)
        yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)


def _kept_positions(size: int, length: int, keep: int, generator) -> torch.Tensor:
    """``keep`` of a batch's predicted positions (each window's all but its last), drawn
    uniformly without replacement, as indices into its size x length positions."""
    import torch

    predicted = size * (length - 1)
    chosen = torch.randperm(predicted, generator=generator)[:min(keep, predicted)].sort().values
    return chosen // (length - 1) * length + chosen % (length - 1)


def _sampled_log_likelihood(model: torch.nn.Module, batch: torch.Tensor, generator
                            ) -> torch.Tensor:
    """The log-likelihood, summed, of one token drawn from the model's own distribution at
    each predicted position of ``batch`` (see the module), with its graph."""
    import torch

    with torch.enable_grad():
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        log_probs = torch.log_softmax(logits, dim=-1).reshape(-1, logits.shape[-1])
        with torch.no_grad():
            drawn = torch.multinomial(log_probs.exp().cpu(), 1, generator=generator)
        return log_probs.gather(-1, drawn.to(log_probs.device)).sum()


def embedding_name(model: torch.nn.Module) -> str:
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    return next(n for n, m in model.named_modules() if m is embedding)


def _out_width(model: torch.nn.Module, name: str) -> int:
    import torch
    from transformers.pytorch_utils import Conv1D

    weight = model.get_submodule(name).weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[1] if isinstance(model.get_submodule(name), Conv1D)
               else weight.shape[0])


def fisher_score(model: torch.nn.Module, captures: list[Captured], modules: list[str],
                 delta: torch.Tensor) -> float:
    """The Fisher estimate (nats per predicted token) of changing the weight ``modules``
    share by ``delta`` (in that weight's own layout) over every batch of ``captures``."""
    import torch
    from transformers.pytorch_utils import Conv1D

    total, positions = 0.0, 0
    delta = delta.detach().float()
    for captured in captures:
        positions += captured.positions
        batch = 0.0
        for name in modules:
            module = model.get_submodule(name)
            x, g2 = captured.inputs[captured.input_of[name]], captured.grads2[name]
            for start in range(0, captured.kept, SCORE_ROWS):
                part = slice(start, start + SCORE_ROWS)
                if isinstance(module, torch.nn.Embedding):
                    dy = delta.index_select(0, x[part].cpu())
                elif isinstance(module, Conv1D):
                    dy = x[part] @ delta
                else:
                    dy = x[part] @ delta.t()
                batch += float((g2[part] * dy.pow(2)).double().sum())
        if captured.kept:
            total += 0.5 * batch * captured.positions / captured.kept
    return total / positions if positions else 0.0


def fit_ratio(measured_kl: float | None, summed_scores: float) -> float | None:
    """The factor that maps a format's Fisher scores to nats: its measured whole-model KL
    (every unit in it at once) over the sum of its cells' scores; None without both."""
    if measured_kl is None or not summed_scores > 0:
        return None
    return measured_kl / summed_scores
