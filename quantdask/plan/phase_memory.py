"""The device memory of each phase of a job, by its config and its model's files alone.

A job's peak is the largest of its phases' (``job.phases.PHASES``; the names here are
theirs, as in the phases frame), and each holds the model's weights plus what it computes:

- ``quantize``: the weights at the backend's bits (as loaded, for a backend that loads the
  whole model before quantizing it): ``Sizing.weight_bits``;
- ``score``: the eval's float32 logits, a slice of positions at a time
  (``measure.logits``), with their log-softmax and a temporary;
- ``score_tasks``: lm-eval's batches, ``tasks.batch_size`` x ``tasks.max_length`` (else the
  model's window, else lm-eval's 2,048) x vocab float32 logits, 3 copies alive. lm-eval pads a
  batch to its longest request, which is rarely that long: this phase's figure is an upper
  bound;
- ``time_generation``: the KV cache of the largest speed batch, 2 (keys and values) x layers x
  key/value heads x head width x batch x (prompt + new tokens) x the model's dtype bytes, and
  the logits of one step: ``generate`` asks for the last position's logits only
  (``logits_to_keep=1``, also at the prefill), batch x vocab, which it copies to float32 and
  the logits processors copy again.

On a CPU slot (``host``) the device is the host, and what counts is what the job adds to the
worker process's RSS (its nanny's measure; the slot's own resting memory is taken off what it
offers, ``process.slot_memory``): the checkpoint's pages the job maps and reads (and a
converted copy when the job loads it in another dtype), the quantized weights beside them, the
phase's figure above, the backend's working memory (``Sizing.host_work``, in decoder
layers and in copies of the whole model), what importing its library adds (its first job
on the slot pays it) and the model's tokenizer (kept between jobs; a large vocabulary's is
tens of MiB). A streamed
job there holds the weights outside the layers, the hidden states, the eval's logits, and the
backend's streamed working memory in layers.

The demo baseline under a speed batch of 8 x (96 + 32) tokens:

>>> phase_bytes(job.backend, job.options, job, facts)  # doctest: +SKIP
{'quantize': 3482128, 'score': 4465168, 'time_generation': 5610000}
"""

from __future__ import annotations

from quantdask.backends import BackendOptions, get_backend
from quantdask.backends.base import ModelFacts
from quantdask.backends.capabilities import StreamedFit
from quantdask.measure.logits import SLICE_BUDGET_BYTES
from quantdask.sweepfile.settings import EvalSettings
from quantdask.sweepfile.speed import SpeedSettings
from quantdask.sweepfile.sweep import Job
from quantdask.sweepfile.tasks import TaskSettings
from quantdask.util import format_bytes

QUANTIZE, SCORE, TASKS, SPEED = "quantize", "score", "score_tasks", "time_generation"
"""The phases whose memory a job's estimate counts (``job.phases.PHASES``' names)."""
UPPER_BOUNDS = frozenset({TASKS})
"""Phases whose figure is an upper bound: a job is not refused for them alone."""
LOGIT_COPIES = 3
"""Float32 logits, their log-softmax (or a processed copy), and one temporary, alive at once."""
LM_EVAL_LENGTH = 2048
"""lm-eval's longest input when neither ``tasks.max_length`` nor the model's config sets one."""
TOKENIZER_BYTES_PER_TOKEN = 512
"""A fast tokenizer's resident memory per vocabulary entry, on a CPU slot that loaded it (the
model's source keeps it between jobs): 333 bytes measured on a 151,936-token BPE
(tests.gguf_models.large_vocab_model: 48 MiB), rounded up for merges and added tokens.
A slot's resting memory (``FIRST_JOB_BYTES``) covers a small vocabulary's only."""


def weight_bytes(backend: str, options: BackendOptions, facts: ModelFacts) -> float:
    """The weights at their bits at the job's peak: the decoder layers at the backend's
    ``weight_bits``, the tables outside them (the embedding, an untied head) as loaded; all as
    loaded for a backend that does not quantize. With a large vocabulary the tables are much
    of the model: a 1.5B Qwen2's embedding is 15% of its weights, and more than a third of
    its nf4 job's."""
    sizing = get_backend(backend).sizing
    loaded = loaded_bytes(facts)
    if sizing.weight_bits is None:
        return loaded
    # The decoder layers' weights at its bits, the tables outside them as loaded: from the
    # shapes in config.json alone, the same figure on every path (placement, the plan).
    share = 1 - outside_bytes(facts) / loaded if loaded else 1.0
    bits = sizing.weight_bits(options, facts.loaded_bits)
    return loaded * (share * bits / facts.loaded_bits + 1 - share)


def loaded_bytes(facts: ModelFacts) -> float:
    """The weights as loaded (in the model spec's dtype)."""
    return facts.weight_bytes * facts.loaded_bits / facts.checkpoint_bits


def outside_bytes(facts: ModelFacts) -> float:
    """The weights outside the decoder layers: the embedding, and an untied head."""
    tables = 1 if facts.tied_head else 2
    return min(loaded_bytes(facts), tables * facts.vocab_size * facts.hidden_size
               * facts.loaded_bits / 8)


def layer_bytes(facts: ModelFacts) -> float:
    """One decoder layer's weights as loaded, on average (0: the model's shape is unknown)."""
    if not facts.layers or not facts.hidden_size:
        return 0.0
    return (loaded_bytes(facts) - outside_bytes(facts)) / facts.layers


def host_weights(backend: str, options: BackendOptions, facts: ModelFacts) -> tuple[float, float]:
    """On a CPU slot: (the weights the job reads, the quantized weights beside them). It maps
    the checkpoint and reads every weight (a converted copy too, when it loads another
    dtype); a backend that quantizes nothing runs the read weights themselves, and one that
    holds the loaded model whole (its ``weight_bits`` the loaded bits: HQQ) builds its
    quantized layers from the read ones, which its working memory counts."""
    read = facts.weight_bytes + (loaded_bytes(facts) if facts.loaded_bits
                                 != facts.checkpoint_bits else 0)
    quantized = weight_bytes(backend, options, facts)
    beside = get_backend(backend).sizing.quantizes and quantized < loaded_bytes(facts)
    return read, quantized if beside else 0.0


def tokenizer_bytes(facts: ModelFacts) -> int:
    """The model's tokenizer in a CPU slot's memory (``TOKENIZER_BYTES_PER_TOKEN``)."""
    return facts.vocab_size * TOKENIZER_BYTES_PER_TOKEN


def eval_bytes(eval: EvalSettings, facts: ModelFacts) -> int:
    """The eval's logits, which exist a slice of positions at a time."""
    batch_logits = eval.batch_size * eval.seq_len * facts.vocab_size * 4
    row = eval.batch_size * facts.vocab_size * 4
    return min(batch_logits, max(SLICE_BUDGET_BYTES, row)) * LOGIT_COPIES


def score_logits(job: Job, facts: ModelFacts, host: bool, streamed: bool = False) -> int:
    """The eval's logits a job's score holds (``eval_bytes``). On a CPU slot, as measured
    there (benchmarks/slot_memory.py): the baseline's figure is its model's reference, and a
    streamed pass scores each slice as it comes; both hold a slice's logits and their
    log-softmax at once (2 copies; a float32 reference's baseline is measured as any job is).
    A small slice's second copy lives too briefly for the RSS sampler to see it every time;
    at 151,936 tokens (256 MiB a slice) it is always seen (RESULTS.md section 18.1)."""
    own = job.is_baseline and not job.eval.reference_float32
    if not host or not (own or streamed):
        return eval_bytes(job.eval, facts)
    return eval_bytes(job.eval, facts) * 2 // LOGIT_COPIES


def task_length(tasks: TaskSettings, facts: ModelFacts) -> int:
    """The longest input lm-eval gives the model."""
    return tasks.max_length or facts.max_positions or LM_EVAL_LENGTH


def task_bytes(tasks: TaskSettings, facts: ModelFacts) -> int:
    """lm-eval's logits for a batch padded to the longest input (an upper bound)."""
    return tasks.batch_size * task_length(tasks, facts) * facts.vocab_size * 4 * LOGIT_COPIES


def kv_cache_bytes(speed: SpeedSettings, facts: ModelFacts) -> int:
    """The KV cache of the largest speed batch at its last token (0: shape unknown)."""
    tokens = max(speed.batch_sizes) * (speed.prompt_length + speed.new_tokens)
    per_token = 2 * facts.layers * facts.kv_heads * facts.head_dim * facts.loaded_bits // 8
    return per_token * tokens


def generation_bytes(speed: SpeedSettings, facts: ModelFacts) -> int:
    """The KV cache and one step's logits of the largest speed batch."""
    return (kv_cache_bytes(speed, facts)
            + max(speed.batch_sizes) * facts.vocab_size * 4 * LOGIT_COPIES)


def phase_bytes(backend: str, options: BackendOptions, job: Job, facts: ModelFacts,
                host: bool = False) -> dict[str, int]:
    """Each counted phase's device memory for ``backend`` with ``options`` under ``job``'s
    settings (its eval, tasks and speed blocks), in the phases' order; on a CPU slot
    (``host``) what the job adds to the worker's RSS (see the module); empty when the
    checkpoint is unknown."""
    if not facts.weight_bytes:
        return {}
    weights = weight_bytes(backend, options, facts)
    working = {QUANTIZE: 0.0, SCORE: 0.0}
    if host:
        read, quantized = host_weights(backend, options, facts)
        work, layer = get_backend(backend).sizing.host(options), layer_bytes(facts)
        # (its first job on the slot imports the library and loads the tokenizer)
        weights = (read + quantized + work.imports + tokenizer_bytes(facts)
                   + work.bytes_per_token * facts.vocab_size)
        working = {QUANTIZE: work.quantize * layer + work.model_copies * loaded_bytes(facts),
                   SCORE: work.forward * layer}
    phases = {QUANTIZE: int(weights + working[QUANTIZE]),
              SCORE: int(weights + working[SCORE] + score_logits(job, facts, host))}
    if job.tasks is not None:
        phases[TASKS] = int(weights + working[SCORE] + task_bytes(job.tasks, facts))
    if job.speed is not None:
        phases[SPEED] = int(weights + working[SCORE] + generation_bytes(job.speed, facts))
    return phases


def streamed_bytes(job: Job, facts: ModelFacts, host: bool = False) -> int:
    """A streamed job's device memory (``stream.streaming``): the weights outside the decoder
    layers (the embedding and an untied head, at most), one layer as loaded and its quantized
    copy (on a CPU slot, ``host``: the backend's streamed working memory, in layers), the
    float32 hidden states of every eval window, and the score's logits (``score_logits``),
    or a calibrated fit's
    block by block (``streamed_fit_bytes``) if more; 0 when the checkpoint or the model's
    shape is unknown."""
    layer = layer_bytes(facts)
    if not facts.weight_bytes or not layer:
        return 0
    outside = outside_bytes(facts)
    hidden = job.eval.samples * job.eval.seq_len * facts.hidden_size * 4
    layers = get_backend(job.backend).sizing.host(job.options).streamed if host else 2.0
    passing = (outside + layers * layer + hidden + score_logits(job, facts, host, streamed=True)
               + (tokenizer_bytes(facts) if host else 0))
    return int(max(passing, streamed_fit_bytes(job, facts, outside, layer)))


def streamed_fit_bytes(job: Job, facts: ModelFacts, outside: float, layer: float) -> float:
    """A calibrated backend's fit block by block from the checkpoint (``quantize_streamed``):
    one layer, the float32 inputs and outputs of every calibration window at that layer, the
    float32 Hessians of its linear layers (in x in each: about twice the layer's float32
    weights, a bound from Llama's shapes), and the quantized model it assembles to save (at
    its bits, half a bit more for the scales and zero points, and the weights outside the
    layers); 0 for any other job. (RESULTS.md section 15: measured on a 2.09 GB model.)"""
    if job.calibration is None or get_backend(job.backend).has(StreamedFit) is None:
        return 0.0
    states = 2 * job.calibration.samples * job.calibration.seq_len * facts.hidden_size * 4
    bits = getattr(job.options, "bits", None) or facts.loaded_bits
    saved = layer * facts.layers * (bits + 0.5) / facts.loaded_bits + outside
    return saved + layer + states + 2 * layer * 32 / facts.loaded_bits


def peak_note(phase: str, job: Job, facts: ModelFacts) -> str:
    """What sets a job's peak in ``phase``, in words (for a refusal)."""
    if phase == SPEED and job.speed is not None:
        speed = job.speed
        return (f"{SPEED}: batch {max(speed.batch_sizes):,} x "
                f"{speed.prompt_length + speed.new_tokens:,} tokens, KV cache "
                f"{format_bytes(kv_cache_bytes(speed, facts))}")
    if phase == TASKS and job.tasks is not None:
        return (f"{TASKS}: batch {job.tasks.batch_size} x {task_length(job.tasks, facts):,} "
                f"tokens x {facts.vocab_size:,} logits, an upper bound")
    if phase == SCORE:
        return f"{SCORE}: batch {job.eval.batch_size} x {job.eval.seq_len} tokens"
    return phase
