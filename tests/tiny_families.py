"""Tiny random decoder models of several transformers families, built here (nothing downloaded).

``build_tiny(family, directory)`` builds one family's model from its config class alone,
deterministically, saves it as safetensors with the demo model's tokenizer (its 320 tokens fit
every family's vocabulary), and returns the directory. Each family stands for a way a model can
differ from Llama in what a quantizer sees:

- ``gpt2``: GPT-2's ``Conv1D`` projections, weights stored (in, out);
- ``falcon``: ``FalconLinear``, a subclass of ``nn.Linear`` (bitsandbytes replaces exact
  ``nn.Linear`` only; torchao replaces it, then its forward hits an op torchao lacks);
- ``mixtral``: mixture of experts, the experts fused 3-D parameters, which bitsandbytes, HQQ
  and torchao leave in full precision (GPTQ fits them one linear per expert; a GGUF or GPTQ
  search makes each a unit);
- ``phi3``: fused ``qkv_proj`` and ``gate_up_proj``;
- ``gemma``: tied input and output embeddings (a scaled embedding class);
- ``qwen2_151k``: Qwen2's real 151,936-token vocabulary on a tiny body;
- ``gpt_neox``: fused ``query_key_value``;
- ``llama``: the reference shape;
- ``mistral``, ``qwen3`` (query and key norms), ``gemma3_text`` (four norms per layer, each
  multiplying by 1 + w; sliding and full attention layers): the families of
  ``MORE_FAMILIES``, built for GPTQ's and AWQ's family checks (``tests/test_gptq.py``,
  ``tests/test_gptq_families.py``, ``tests/test_streaming.py``) and left out of ``FAMILIES``,
  which every backend runs (``tests/test_families.py``).

``awq_sized=True`` gives the Llama-like families four key/value heads (one per query head):
every attention projection then has 64 outputs, a width AWQ takes, and ``v_proj`` and
``o_proj`` the same shape, so gptqmodel's AWQ also folds a scale between them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from quantdask.demo_model import DEMO_MODEL_DIR

SMALL_VOCAB = 1024
_LLAMA_LIKE = dict(vocab_size=SMALL_VOCAB, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES = ("llama", "gpt2", "falcon", "mixtral", "phi3", "gemma", "qwen2_151k", "gpt_neox")
MORE_FAMILIES = ("mistral", "qwen3", "gemma3_text")


def tiny_config(family: str, awq_sized: bool = False):
    """The tiny ``transformers`` config of ``family``."""
    import transformers as t

    if awq_sized:
        config = tiny_config(family)
        config.num_key_value_heads = config.num_attention_heads
        return config
    if family == "llama":
        return t.LlamaConfig(**_LLAMA_LIKE)
    if family == "gpt2":
        return t.GPT2Config(vocab_size=SMALL_VOCAB, n_embd=64, n_layer=2, n_head=4,
                            n_positions=128, bos_token_id=1, eos_token_id=2)
    if family == "falcon":
        return t.FalconConfig(vocab_size=SMALL_VOCAB, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, bos_token_id=1, eos_token_id=2)
    if family == "mixtral":
        return t.MixtralConfig(**_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=None)
    if family == "phi3":
        return t.Phi3Config(**_LLAMA_LIKE)
    if family == "gemma":
        return t.GemmaConfig(**_LLAMA_LIKE, head_dim=16)
    if family == "qwen2_151k":
        return t.Qwen2Config(**{**_LLAMA_LIKE, "vocab_size": 151_936})
    if family == "gpt_neox":
        return t.GPTNeoXConfig(vocab_size=SMALL_VOCAB, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4,
                               max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    if family == "mistral":
        return t.MistralConfig(**_LLAMA_LIKE, head_dim=16)
    if family == "qwen3":
        return t.Qwen3Config(**_LLAMA_LIKE, head_dim=16)
    if family == "gemma3_text":
        # A window shorter than the tests' sequences: the sliding layer differs from the full.
        return t.Gemma3TextConfig(**_LLAMA_LIKE, head_dim=16, query_pre_attn_scalar=16,
                                  sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention"])
    raise KeyError(f"unknown family {family!r}; known: {', '.join(FAMILIES + MORE_FAMILIES)}")


def build_tiny(family: str, directory: Path, awq_sized: bool = False) -> Path:
    """Build, save and return ``directory`` holding ``family``'s tiny float32 model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, awq_sized),
                                             dtype=torch.float32).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    copy_demo_tokenizer(directory)
    return directory


def build_tiny_llama(directory: Path, hidden_size: int, intermediate_size: int) -> str:
    """A one-layer Llama of the given widths (4 heads, 2 key/value heads) saved in
    ``directory`` with the demo's tokenizer: for layer shapes a kernel or a group size cannot
    take."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=1024, hidden_size=hidden_size,
                         intermediate_size=intermediate_size, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    copy_demo_tokenizer(directory)
    return str(directory)


def copy_demo_tokenizer(directory: Path) -> None:
    """The demo model's tokenizer (vocabulary 1,024) into ``directory``."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEMO_MODEL_DIR) / name, directory / name)


def demo_model_with_bos(directory: Path, adds_bos: bool = True, has_bos: bool = True) -> str:
    """The demo model with its tokenizer as real checkpoints ship theirs: ``adds_bos``, a
    Llama-3/Gemma-style tokenizer.json whose post-processor puts the BOS (``<s>``) before every
    plain encode (``TemplateProcessing``, tokenizer_class PreTrainedTokenizerFast); without it,
    the demo's (a BOS token it never adds). ``has_bos=False``: no BOS token at all (as
    Qwen2's)."""
    import json

    from tokenizers import Tokenizer, processors

    shutil.copytree(DEMO_MODEL_DIR, directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    if adds_bos:
        bos = tokenizer.token_to_id("<s>")
        tokenizer.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                          special_tokens=[("<s>", bos)])])
        tokenizer.save(str(directory / "tokenizer.json"))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if not has_bos:
        config.pop("bos_token", None)
    config_path.write_text(json.dumps(config, indent=2))
    return str(directory)
