"""The gguf backend's side of a mixed-precision search: a module alone in the tensor type its
file will hold (``ModuleAlone``: the bytes of llama.cpp's own quantizer, ``gguf.tensors``), its
weight back in float (``Dequantizes``), and what the file stores outside the searched units in
the runtime's own count (``Searchable.rest_bytes``).

A searched config is a plain GGUF config (``type``: the file's llama.cpp type) with its linears'
tensor types given (``tensor_type`` for every linear of the decoder layers, ``modules`` for each
by name): each is a per-tensor override of llama.cpp's quantizer. The token embedding and the
output take ``embedding_type`` and ``output_type``, by default what llama.cpp's own mix gives
them for ``type`` (:func:`rest_types`), so that the probes count the bytes the file will hold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from quantdask.errors import UnsupportedHere
from quantdask.gguf.linear import gguf_linear
from quantdask.gguf.source import gguf_module, read_gguf
from quantdask.gguf.tensors import quantize_rows, quantized_here, tensor_bytes, written_type
from quantdask.gguf.types import DEFAULT_TYPE

if TYPE_CHECKING:
    import torch

    from quantdask.gguf.options import GgufOptions
    from quantdask.gguf.quantize import TensorTypes


def rest_types(options: GgufOptions, tied: bool) -> tuple[str, str]:
    """(token embedding type, output type) of a searched config: its own, else what llama.cpp
    gives them for its ``type`` (``llama_tensor_get_type_impl``: the output Q8_0 for a Q8_0
    file, Q6_K otherwise; the embedding the file's default type, or the output's when the
    embedding is tied to it)."""
    default = DEFAULT_TYPE[str(options.type)]
    output = options.output_type or ("Q8_0" if default == "Q8_0" else "Q6_K")
    embedding = options.embedding_type or (output if tied else default)
    return embedding, output


def least_bits(options: GgufOptions) -> float | None:
    """The bits per weight ``options.tensor_type`` stores at least (its block's, before any
    fallback to a larger type on rows it does not divide)."""
    from quantdask.gguf.tensors import block

    if options.tensor_type is None:
        return None
    weights, size = block(str(options.tensor_type))
    return 8 * size / weights


def quantize_module(module: torch.nn.Module, options: GgufOptions) -> torch.nn.Module:
    """``module``'s weight in ``options.tensor_type`` as llama.cpp writes it (its fallback on
    rows the type's block does not divide), ``module`` left as it was."""
    from transformers.pytorch_utils import Conv1D

    if options.tensor_type is None:
        raise UnsupportedHere("a GGUF module alone needs a tensor_type (Q4_K, Q6_K, ...)")
    weight = cast("torch.Tensor", module.weight)
    weight = weight.t() if isinstance(module, Conv1D) else weight  # (out, in)
    tensor_type = written_type(options.tensor_type, int(weight.shape[1]))
    return gguf_linear(quantize_rows(weight, tensor_type), tensor_type,
                       getattr(module, "bias", None))


def rest_bytes(model: torch.nn.Module, units: dict[str, tuple[str, ...]],
               options: GgufOptions) -> int:
    """What a searched file of ``model`` stores outside ``units``, as llama.cpp counts it:
    the token embedding and the output in :func:`rest_types` (as written), every other
    tensor F32 as converted (norms, biases outside the units)."""
    inside = {f"{m}{kind}" for modules in units.values() for m in modules
              for kind in (".weight", ".bias", "")}  # ("": a fused experts parameter)
    found: Any = model  # a transformers model
    embedding, output = found.get_input_embeddings(), found.get_output_embeddings()
    tied = output is None or output.weight is embedding.weight
    embedding_type, output_type = rest_types(options, tied)
    special = {id(embedding.weight): embedding_type}
    if not tied:
        special[id(output.weight)] = output_type
    total, seen = 0, set()
    for name, tensor in model.named_parameters(remove_duplicate=True):
        if name in inside or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        kind = special.get(id(tensor))
        if kind is None:
            total += 4 * tensor.numel()
        else:
            rows, row_length = (int(n) for n in tensor.shape)
            total += tensor_bytes(kind, rows, row_length)
    return total


def written_rest_types(options: GgufOptions, tied: bool, row_length: int) -> tuple[str, str]:
    """:func:`rest_types` as llama.cpp will write them on rows of ``row_length`` (an explicit
    embedding or output type skips llama.cpp's own fallback, so it is applied here)."""
    embedding, output = rest_types(options, tied)
    return written_type(embedding, row_length), written_type(output, row_length)


def export_file(model, options: GgufOptions, folder: str | os.PathLike) -> Path:
    """The ``.gguf`` a searched config describes, written by llama.cpp's quantizer into
    ``folder`` from the model converted (or found in this machine's conversion cache), its
    tensors' types checked against the config's (``Searchable.export``)."""
    from quantdask.gguf.conversion import converted
    from quantdask.gguf.quantize import check_written, quantize_gguf, tensor_types

    if options.imatrix:
        raise UnsupportedHere("a mix quantized with an importance matrix is written by its "
                              "verifying job (artifacts: {keep: true}), not exported apart: "
                              "the matrix comes from the sweep's calibration windows")
    base = converted(model, "f32")
    given = given_types(base, options)
    Path(folder).mkdir(parents=True, exist_ok=True)
    out = Path(folder) / f"{model.label}-{options.type}-mixed.gguf"
    quantize_gguf(base, out, str(options.type), threads=os.cpu_count() or 1, given=given)
    check_written(tensor_types(out), given)
    return out


def score_in_runtime(model, options: GgufOptions, windows: torch.Tensor,
                     reference: dict[str, torch.Tensor]):
    """A searched config's mix scored in llama.cpp (``Searchable.score_mix``, a refinement's
    offspring): the file llama.cpp's quantizer writes from the model converted (this
    machine's conversion cache), its tensors' types checked, run on ``windows`` against
    ``reference`` on this slot's threads (the config's device); a QualityMeter."""
    import tempfile

    import torch

    from quantdask.gguf.assembled import write_mix
    from quantdask.gguf.conversion import converted
    from quantdask.gguf.quantize import check_written, tensor_types
    from quantdask.gguf.runtime import RuntimeDevice, llama_cpp_meter

    if options.imatrix:
        raise UnsupportedHere("a refinement scores mixes without an importance matrix (its "
                              "formats are probed without one): leave imatrix out")
    base = converted(model, "f32")
    given = given_types(base, options)
    threads = max(1, torch.get_num_threads())
    with tempfile.TemporaryDirectory(prefix="quantdask-offspring-") as folder:
        out = Path(folder) / "mix.gguf"
        write_mix(base, out, str(options.type), threads, given)
        check_written(tensor_types(out), given)
        return llama_cpp_meter(out, windows, reference,
                               RuntimeDevice(threads, options.device == "cuda"))


def given_types(path: str | os.PathLike, options) -> TensorTypes:
    """The tensor types a searched config (``options.tensor_type``, ``options.modules``, the
    embedding's and output's) gives the tensors of the full-precision GGUF at ``path``, as
    llama.cpp will write them: every 2-D tensor of the decoder blocks for ``tensor_type``,
    each module by its GGUF name (``model.layers.0.mlp.down_proj`` ->
    ``blk.0.ffn_down.weight``; null keeps it F32). A module the file has no tensor for is
    :class:`UnsupportedHere`."""
    from quantdask.gguf.quantize import TensorTypes

    gguf = gguf_module()
    reader = read_gguf(path)
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    blocks = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), blocks)
    wanted: dict[str, str] = {}
    if options.tensor_type:
        wanted = {name: options.tensor_type for name, shape in shapes.items()
                  if name.startswith("blk.") and len(shape) in (2, 3) and quantized_here(name)}
    unknown = []
    for module, own in (options.modules or {}).items():
        found = _tensors_of(module, names, shapes)
        if not found:
            unknown.append(module)
        for name in found:
            wanted[name] = "F32" if own is None else own.get(
                "tensor_type") or options.tensor_type or "F32"
    if unknown:
        raise UnsupportedHere(f"the GGUF of this model has no tensor for modules "
                              f"{unknown[:3]}{' ...' if len(unknown) > 3 else ''} "
                              "(llama.cpp's converter renames them otherwise)")
    row = shapes["token_embd.weight"][0]  # GGUF shapes are (row length, rows)
    embedding, output = written_rest_types(options, "output.weight" not in shapes, row)
    # given by name (a search's units): llama.cpp takes them as its own two parameters
    embedding = written_type(wanted.pop("token_embd.weight", embedding), row)
    output = written_type(wanted.pop("output.weight", output), row)
    return TensorTypes({name: written_type(kind, shapes[name][0])
                        for name, kind in wanted.items()}, wanted, embedding, output)


def _tensors_of(module: str, names, shapes: dict[str, list[int]]) -> list[str]:
    """The GGUF tensors holding member ``module`` (``search.members``): one, or, for fused
    experts' gate and up projections, the two tensors llama.cpp's converter splits them into
    (``ffn_gate_exps``, ``ffn_up_exps``) where the file has no fused ``ffn_gate_up_exps``;
    [] where the file has none."""
    import re

    from quantdask.backends.per_module import expert_projections

    name = names.get_name(module)
    if name is not None and f"{name}.weight" in shapes:
        return [f"{name}.weight"]
    experts, layer = expert_projections(module), re.search(r"\.(\d+)\.", module)
    if experts is None or layer is None:
        return []
    split = [f"blk.{layer.group(1)}.ffn_{part.removesuffix('_proj')}_exps.weight"
             for part in experts[1]]
    return split if all(part in shapes for part in split) else []
