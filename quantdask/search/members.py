"""What a search unit is made of, its members, by name: linear modules
(``model.layers.0.mlp.down_proj``), or the fused experts of a mixture-of-experts layer, where a
backend's runtime stores them the way transformers holds them, every expert of one projection
in one 3-D tensor (GGUF's ``blk.0.ffn_down_exps``): the parameter is the member
(``model.layers.0.mlp.experts.down_proj``), so all of a layer's experts take one format, as
that runtime requires. The router beside them (the linear whose outputs are the experts) is
then no member: llama.cpp never quantizes it (``ffn_gate_inp``), so it stays with the rest.

A fused experts parameter (experts, rows, row length) is quantized as one linear of
experts x rows rows (:func:`quantizable`): the formats searched quantize row by row, so each
expert's rows hold what the runtime's per-expert matrices hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantdask.backends.per_module import expert_projections, fused_expert_params

if TYPE_CHECKING:
    import torch


def fused_experts(model: torch.nn.Module, within: str) -> tuple[list[str], set[str]]:
    """The fused experts parameters (``backends.per_module.fused_expert_params``) of the
    decoder layers under ``within`` (``model.layers``), by full name, and the names of their
    routers: a linear beside the experts module (same parent) with one output per expert
    (Mixtral's router in transformers 5 is no linear: none then). Experts stored
    (experts, in, out) (``is_transposed``: GPT-OSS, Llama-4) are refused: their rows are not
    the runtime's."""
    import torch

    from quantdask.errors import UnsupportedHere

    params, routers = [], set()
    modules = dict(model.named_modules())
    for name, owner in fused_expert_params(model).items():
        if not name.startswith(f"{within}."):
            continue
        if getattr(owner, "is_transposed", False):
            raise UnsupportedHere(f"{name} stores its experts (experts, in, out), whose rows "
                                  "are not the per-expert matrices a runtime quantizes: a "
                                  "search of this family's experts is not built")
        params.append(name)
        experts = int(member_weight(model, name).shape[0])
        parent = name.rsplit(".", 2)[0]  # the experts module's parent (its MLP)
        routers |= {other for other, linear in modules.items()
                    if other.rpartition(".")[0] == parent and isinstance(linear, torch.nn.Linear)
                    and linear.out_features == experts}
    return params, routers


def _module(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """Member ``name`` as a module, or None where it is a parameter (fused experts)."""
    try:
        return model.get_submodule(name)
    except AttributeError:  # not a module: a parameter
        return None


def member_weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    """Member ``name``'s weight: a module's ``weight``, or the fused experts parameter."""
    module = _module(model, name)
    if module is None:
        return model.get_parameter(name)
    return module.weight  # type: ignore[return-value]


def member_bytes(model: torch.nn.Module, name: str, state_bytes) -> int:
    """What member ``name`` stores in full precision: its module's state
    (``state_bytes(module)``), or its parameter's bytes."""
    module = _module(model, name)
    if module is None:
        weight = model.get_parameter(name)
        return weight.numel() * weight.element_size()
    return state_bytes(module)


def quantizable(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """(what a backend quantizes for member ``name``, the weight its dequantized form
    replaces): a linear module and its weight, or fused experts as one bias-free linear of
    all their rows (sharing the parameter's memory) and the 3-D parameter."""
    import torch

    module = _module(model, name)
    if module is None:
        weight = model.get_parameter(name)
        rows = torch.nn.Linear(int(weight.shape[-1]), weight.numel() // int(weight.shape[-1]),
                               bias=False, device="meta")
        rows.weight = torch.nn.Parameter(weight.detach().reshape(-1, weight.shape[-1]),
                                         requires_grad=False)
        # the per-expert matrices it holds (gate and up are two each), for a format whose
        # bytes count each matrix (GPTQ's group index)
        found = expert_projections(name)
        rows.matrices = int(weight.shape[0]) * (len(found[1]) if found else 1)  # type: ignore[assignment]
        return rows, weight
    return module, module.weight  # type: ignore[return-value]
