"""The model families (``model_type``) the gptq and awq backends trust gptqmodel on, and why
each refused one is refused.

gptqmodel has a definition for far more families than it quantizes soundly, and fails on some
in ways it does not report (a reload left random, a scale folded into the wrong norm) or by
ending the whole process (``os._exit`` when a pool thread raises). So a family is trusted only
with a test of quantdask's as evidence, on a tiny local model of that family (``tests/``):

- GPTQ: quantized, saved, reloaded with plain ``from_pretrained`` in a fresh process, which
  measures the job's recorded KL (``tests/test_gptq.py``,
  ``test_saved_models_load_with_plain_transformers_in_a_fresh_process_and_measure_the_same``);
  Mixtral, whose experts gptqmodel saves one linear each (transformers builds them fused, and
  plain ``from_pretrained`` leaves them random), reloaded with ``GPTQModel.load`` to the
  job's KL (``tests/test_gptq_search.py``, its MoE search);
- AWQ: the same, and gptqmodel's scaling step alone (its scaling groups, its folding, random
  scales) leaves the logits as they were to float tolerance
  (``tests/test_gptq_families.py``): a scale folded into the wrong op is silently wrong;
- streamed GPTQ: the checkpoint-backed fit saves the resident fit's model to the bit
  (``tests/test_streaming.py``).
"""

from __future__ import annotations

# GPTQ. (On gemma3_text gptqmodel fits every layer on the first layer's rotary embedding and
# mask, which it replays: the full-attention layers on the sliding layer's. The model it saves
# is sound, and better than rounding to nearest on the tiny model: KL 0.00052 against 0.00077.)
GPTQ_FAMILIES = ("llama", "mistral", "gemma", "gemma3_text", "qwen2", "qwen3", "gpt_neox",
                 "mixtral")
# AWQ: the families whose tiny models have AWQ-sized layers (tests/tiny_families.py).
AWQ_FAMILIES = ("llama", "mistral", "gemma", "qwen2", "qwen3")
# The same saved model, to the bit, as the resident fit. On GPT-NeoX gptqmodel's offloading
# loses the head.
GPTQ_STREAMED_FAMILIES = ("llama", "mistral", "gemma", "gemma3_text", "qwen2", "qwen3")

_PHI3_SPLIT = ("gptqmodel splits Phi-3's fused mlp.gate_up_proj into gate_proj and up_proj "
               "(defuser) to quantize them and saves them split; transformers' Phi-3 has one "
               "gate_up_proj, which a plain reload leaves without its weights")

# Families gptqmodel has a definition for that fail here, and the root cause (read in
# gptqmodel 7.6's and transformers 5.25's code, shown by tests/test_gptq_families.py).
FAILS = {
    ("gptq", "phi3"): _PHI3_SPLIT,
    ("awq", "phi3"): (
        "gptqmodel's Phi-3 layer map names no norm before qkv_proj, so its AWQ finds no "
        "scaling group, quantizes no layer and then fails packing them (KeyError 'q_zeros' in "
        "a pool thread, which ends the process); and " + _PHI3_SPLIT),
    ("awq", "gemma3_text"): (
        "gptqmodel's AWQ calls Gemma-3's rotary embedding without the layer type it takes "
        "(a TypeError in a pool thread, which ends the process), and its scales would change "
        "the model: it folds them into Gemma3RMSNorm as if it multiplied by w (it multiplies "
        "by 1 + w), and the MLP's into post_attention_layernorm (Gemma-3's MLP reads "
        "pre_feedforward_layernorm)"),
}
# Refused too, seen in earlier runs (their root cause not traced): GPT-2's GPTQ reload raises,
# Falcon's leaves its layers random, AWQ on GPT-NeoX reloads to NaN.


def family_refusal(method: str, model_type: str) -> str | None:
    """Why ``method`` ("gptq" or "awq") through gptqmodel is not run on ``model_type``, naming
    the family, or None."""
    known = FAILS.get((method, model_type))
    if known:
        return f"{method} through gptqmodel fails on {model_type!r}: {known}"
    families = GPTQ_FAMILIES if method == "gptq" else AWQ_FAMILIES
    if model_type not in families:
        return (f"{method} through gptqmodel is checked on the families "
                f"{', '.join(families)}, not {model_type or 'this model'!r}")
    return None
