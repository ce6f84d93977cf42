"""What a backend can do beyond quantizing a whole model: each capability an object a backend
has or lacks (``Backend.capabilities``), and each the one place its refusal is written.

- :class:`Calibrated`: it fits its quantization to calibration data (AutoRound, GPTQ, AWQ).
- :class:`Dequantizes`: it gives each quantized layer's weight back in float (per-layer errors).
- :class:`ModuleAlone`: it quantizes one module alone (a streamed job's layers).
- :class:`Searchable`: each module may take a format of its own (the search).
- :class:`StreamedFit`: it fits block by block from the checkpoint (a streamed model).
- :class:`Savable`: its model saves with ``save_pretrained`` and reloads with transformers.

- :class:`OwnRuntime`: it quantizes and measures in a runtime of its own (llama.cpp's, for
  GGUF), not a torch model: its jobs run its own phases.

A backend without one may say why with :class:`Lacks` (``Lacks(Searchable, "...")``); the
capability's refusal gives that reason, or its usual one.

>>> from quantdask.backends import get_backend
>>> get_backend("hqq").refusal(Savable)
'hqq models have no save format quantdask can reload yet'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class Capability:
    """One thing a backend may be able to do. ``refuses`` is the sentence that refuses it to a
    backend that lacks it (``refusal(backend, why)`` fills it in); ``usual_why`` the reason
    when the backend gives none."""

    usual_why: ClassVar[str] = ""
    refuses: ClassVar[str] = "{backend} cannot: {why}"

    @classmethod
    def refusal(cls, backend: str, why: str) -> str:
        """The sentence refusing it to ``backend``, for the reason ``why``."""
        return cls.refuses.format(backend=backend, why=why)


@dataclass(frozen=True)
class Lacks:
    """A capability a backend lacks, and why (the refusal's reason)."""

    capability: type[Capability]
    why: str


@dataclass(frozen=True)
class Calibrated(Capability):
    """The backend fits its quantization to data: a sweep with it needs a ``calibration``
    block (a :class:`~quantdask.errors.SpecError` otherwise), the calibration settings join
    its jobs' ids, and ``quantize`` is called with ``calibration=``, a
    :class:`~quantdask.measure.calibration.Calibration`: ``calibration.windows`` (samples x
    seq_len token ids, cut once per model with its reference), and ``with
    calibration.measure():`` to wrap the data-driven step in (``calibrate_s`` and its peaks)."""

    # Which of its configs calibrate (None: every one), e.g. a GGUF config with imatrix: true.
    when: Callable[[Any], bool] | None = None
    usual_why = ("add a calibration block (calibration: {text: PATH, samples: N, seq_len: N}, "
                 "or dataset: {...} instead of text)")
    refuses: ClassVar[str] = "{backend} fits its quantization to calibration data: {why}"

    @classmethod
    def needs_block(cls, backend: str) -> str:
        """Why a sweep with ``backend`` and no calibration block is refused."""
        return cls.refusal(backend, cls.usual_why)


@dataclass(frozen=True)
class Dequantizes(Capability):
    """``dequantize(module) -> Tensor | None``: a layer's quantized weight dequantized to
    float, (out_features, in_features); None for a module the backend left alone. Called on
    the worker in the layer-weights phase, before the model's first forward pass (kernels may
    repack weights then), for each module whose ``<name>.weight`` the unquantized model has,
    when the sweep's ``layer_stats`` is on; and by a search's probes. A layer that replaced one
    the checkpoint stores transposed (GPT-2's ``Conv1D``) keeps that class as ``source_cls``.
    An exception costs only that layer (logged, counted in ``layers_unmeasured``), never the
    job. Without it a backend's jobs have no per-layer rows."""

    dequantize: Callable[[torch.nn.Module], torch.Tensor | None]
    usual_why: ClassVar[str] = "it gives no layer's weight back in float"

    refuses: ClassVar[str] = "{backend} has no per-layer weights: {why}"


@dataclass(frozen=True)
class ModuleAlone(Capability):
    """``quantize(module, options) -> module``: one linear layer quantized alone, as the
    backend's ``quantize`` would quantize it with ``options``, on the layer's device, leaving
    ``module`` as it was. Called on the worker by a streamed job, which quantizes each layer of
    the stream as it comes, and by a search's probes (with :class:`Searchable`)."""

    quantize: Callable[..., torch.nn.Module]
    # How a module it quantized is kept on disk and read back (``backends.quantized_store``:
    # each (member, format) quantized once per machine), or None: quantized again each time.
    kept: KeptForm | None = None
    usual_why: ClassVar[str] = "it cannot quantize one module alone"

    refuses: ClassVar[str] = "{backend} cannot quantize one module alone: {why}"


@dataclass(frozen=True)
class KeptForm:
    """A quantized module (what :class:`ModuleAlone` makes) as tensors and text, and back:
    ``tensors(module) -> (tensors by name, text by name)``, ``module(tensors, text) ->
    module``, the same stored bytes and the same dequantized weight. ``version`` names the
    quantizer (another version's are quantized again)."""

    tensors: Callable[[Any], tuple[dict[str, Any], dict[str, str]]]
    module: Callable[[dict[str, Any], dict[str, str]], Any]
    version: str


@dataclass(frozen=True)
class Searchable(Capability):
    """``module_keys``: the options a module's own format sets in the ``modules`` option
    (``backends.per_module``), which a mixed-precision search's candidates give each module.
    A searchable backend also has :class:`ModuleAlone` (each (unit, format) cell quantized
    alone) and :class:`Dequantizes` (the weight the probe swaps in); ``Backend`` checks.

    ``rest_bytes(model, units, options)`` (optional) is what the backend's file of ``model``
    stores outside ``units`` with a format's ``options`` (its embeddings and head in the
    runtime's own count); without it, the full-precision model's bytes there.
    ``export(model, options, folder) -> Path`` (optional) writes the file a runtime loads for
    a config of per-module formats (``quantdask export allocation``); without it, a search's
    allocation is not exported, and the refusal and the report say why (``unexported_why``).
    ``embeddings``: the token embedding and the output are units of their own (a module each,
    or one where they share weights), which a uniform format covers too (its jobs then name
    every unit's format). ``experts``: a mixture-of-experts layer's fused experts are units,
    one per projection with every expert in it, and their router is none
    (``search.members``), as a runtime that stores or runs them that way needs (GGUF's
    ``ffn_*_exps``; vLLM's fused MoE kernel for GPTQ).

    ``score_mix``, ``scores_in`` and ``refine_why``: how a search's refinement scores a whole
    mix (see the fields).

    ``proxy`` (optional): what the probes quantize each module with instead of
    :class:`ModuleAlone`, for a backend whose module alone is not what the method makes of it
    (GPTQ fits each layer on the outputs of those before it); ``proxy_is`` says what it is,
    and the search's predictions are labelled with it. A module it returns may give
    ``checkpoint_bytes``, what the backend's file stores for it."""

    module_keys: tuple[str, ...]
    rest_bytes: Callable[..., int] | None = None
    export: Callable[..., Any] | None = None
    embeddings: bool = False  # the token embedding and output are units too (GGUF's types)
    # Fused experts are members, one tensor per projection (GGUF's ffn_*_exps), and their
    # routers none (search.members).
    experts: bool = False
    unexported_why: str = "its verifying jobs measure the mix in memory only"
    proxy: ModuleAlone | None = None
    proxy_is: str = ""
    # A whole mix scored in the backend's own runtime, for a search's refinement:
    # score_mix(model, options, windows, reference) -> QualityMeter (GGUF: the file written by
    # llama.cpp's quantizer, run in llama.cpp; ``scores_in`` names it); without it the
    # refinement scores in torch, every unit's probe weight swapped in. ``refine_why``: why a
    # backend's mixes cannot be refined at all (a refinement is then refused).
    # The fewest bits per weight a format's options can store a unit in (a lower bound: no
    # scales, no fallback), for refusing a budget below the least before anything runs;
    # None: the options' ``bits``. rest_bits: what the weights outside the units store per
    # weight at least (None: the model's loaded dtype).
    least_bits: Callable[[Any], float | None] | None = None
    rest_bits: int | None = None
    score_mix: Callable[..., Any] | None = None
    scores_in: str = "torch"
    refine_why: str | None = None
    ships_as: str = ""  # what the mix ships as without export (GPTQ: the job's checkpoint)
    # The linears (last name parts) its runtime fuses within a layer, and so must take one
    # format: a search ties them unless its ``tie`` says otherwise.
    ties: tuple[tuple[str, ...], ...] = ()
    usual_why: ClassVar[str] = "it cannot quantize one module alone"

    refuses: ClassVar[str] = "{backend} cannot be searched: {why}"


@dataclass(frozen=True)
class StreamedFit(Capability):
    """``fit(source, options, device, calibration, directory) -> SavedQuantized``: a calibrated
    backend's fit made block by block from the checkpoint (never the whole model in memory),
    its quantized model saved in a folder under ``directory``, and how to load it. Called on
    the worker by a streamed job (``stream.streamed_job``), which then reads the saved layers
    one at a time (``stream.saved_layers``). ``families``: those (``model_type``) the fit is
    checked on (empty: every family)."""

    fit: Callable[..., Any]
    families: tuple[str, ...] = ()
    usual_why: ClassVar[str] = "it quantizes whole models only"
    calibrated_why: ClassVar[str] = (
        "it calibrates each layer on the activations of the layers quantized before it, which "
        "the stream does not carry block by block yet")

    refuses: ClassVar[str] = ("{backend} cannot quantize a streamed model, one layer at a time: "
                              "{why}")

    def family_refusal(self, backend: str, model_type: str) -> str | None:
        """Why this fit is not trusted on ``model_type`` (an unknown family passes here, and
        the worker checks), or None."""
        if model_type and self.families and model_type not in self.families:
            return (f"{backend}'s block-by-block fit from the checkpoint is checked on the "
                    f"families {', '.join(self.families)}, not {model_type!r}")
        return None


@dataclass(frozen=True)
class Savable(Capability):
    """The quantized model saves with ``save_pretrained`` and reloads with transformers'
    ``AutoModelForCausalLM.from_pretrained``; ``prepare(model)`` first puts it, in place, in
    the state ``save_pretrained`` must see (bitsandbytes: 4-bit weights repacked for the CPU,
    unpacked). Read on the worker in the artifacts phase, which runs only when the sweep keeps
    artifacts: without it the job's ``artifact_error`` says so (a failed save or reload is
    recorded the same way); the job keeps its result unless ``artifacts.required``.
    ``load(directory, device) -> model`` (optional) reloads a saved model as its users load
    it, where plain ``from_pretrained`` cannot (a GPTQ mix: ``GPTQModel.load``)."""

    prepare: Callable[[torch.nn.Module], None] | None = None
    load: Callable[[str, str], Any] | None = None
    usual_why: ClassVar[str] = "no save format quantdask can reload yet"

    refuses: ClassVar[str] = "{backend} models have {why}"


@dataclass(frozen=True)
class Preparation:
    """One task that jobs of a runtime of their own depend on: ``function(*args)`` runs once
    per ``name`` in a sweep (its result small: a file's path, never the file)."""

    name: str
    function: Callable[..., Any]
    args: tuple[Any, ...]


@dataclass(frozen=True)
class OwnRuntime(Capability):
    """The backend's jobs quantize and measure in a runtime of its own (``runtime``, e.g.
    llama.cpp), not in a torch model: an attempt of one runs ``phases`` (each a
    ``job.phases.Phase``: the attempt's context and stage so far, to the next stage and its
    record) instead of the resident job's. Its package registers the backend with them (the
    core never imports it), and its score phase fills the same quality meter every job's
    does, against the same torch reference.

    ``prepare`` (optional) names what a job needs made once before it runs, for every job
    that needs the same (a model converted to the runtime's format): ``prepare(job)`` is a
    :class:`Preparation` or None. The driver submits one task per name for the sweep, and
    the job's phases find its result as ``JobContext.prepared``.

    ``task_refusal`` (optional): given an lm-eval task's config, why the runtime cannot score
    it (None: it can); a sweep that asks it of one of its configs is refused before anything
    runs (``plan.runtime_tasks``)."""

    runtime: str
    phases: tuple[Any, ...]
    prepare: Callable[[Any], Preparation | None] | None = None
    # task_refusal(config) -> why the runtime cannot score that lm-eval task (None: it can)
    task_refusal: Callable[[dict[str, Any]], str | None] | None = None
    usual_why: ClassVar[str] = "it measures its models in torch"

    refuses: ClassVar[str] = "{backend} has no runtime of its own: {why}"
