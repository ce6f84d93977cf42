"""Tiny checkpoints llama.cpp's converter takes, built offline: a Llama-2-style tokenizer (BPE
with byte fallback, the SentencePiece layout, which the converter reads without a pre-tokenizer
hash) or a Gemma-style one (a SentencePiece model, ``tokenizer.model``, beside the tokenizer
transformers reads from it; a BOS before every text), trained on the demo's language, random
weights of widths given (multiples of 256 for real K-quants)."""

from __future__ import annotations

from pathlib import Path


def llama2_style_model(out: Path, hidden: int = 256, ffn: int = 512, layers: int = 2,
                       vocab: int = 512, seed: int = 0, experts: int = 0) -> Path:
    """A tiny Llama; with ``experts``, a Mixtral of that many experts (2 per token), each of
    FFN width ``ffn`` (transformers holds them fused, one 3-D tensor per projection)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from quantdask.demo_model import generate_text

    fast = llama2_tokenizer(out, vocab)
    shape = dict(vocab_size=len(fast), hidden_size=hidden, intermediate_size=ffn,
                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = (MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=experts,
                                              num_experts_per_tok=2, sliding_window=None))
             if experts else LlamaForCausalLM(LlamaConfig(**shape)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name
                        else torch.randn_like(param) * 0.06)
    model.save_pretrained(out)
    (out / "eval.txt").write_text(generate_text(200, seed=11))
    return out


def large_vocab_model(out: Path, vocab: int = 151_936, hidden: int = 256, ffn: int = 512,
                      layers: int = 2, seed: int = 0) -> Path:
    """A Llama with Qwen2's vocabulary size and tied embeddings, saved in bfloat16 as most
    checkpoints ship (its embedding is most of its weights, as in a small Qwen2.5): the
    Llama-2-style tokenizer, its vocabulary padded with tokens no text produces."""
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantdask.demo_model import generate_text

    llama2_tokenizer(out, 512)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    table = tokenizer["model"]["vocab"]
    table.update({f"<unused{i}>": i for i in range(len(table), vocab)})
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name
                        else torch.randn_like(param) * 0.06)
    model.to(torch.bfloat16).save_pretrained(out)
    (out / "eval.txt").write_text(generate_text(200, seed=11))
    return out


def llama2_tokenizer(out: Path, vocab: int = 512):
    """The Llama-2-style tokenizer of the module's docstring, trained on the demo's language
    and saved into ``out``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from quantdask.demo_model import generate_text

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator(generate_text(400, seed=3).splitlines(), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.save_pretrained(out)
    return fast


def gemma_style_model(out: Path, hidden: int = 256, ffn: int = 512, layers: int = 2,
                      vocab: int = 512, seed: int = 0) -> Path:
    """A tiny Gemma (tied embeddings scaled by sqrt(hidden), RMSNorm of 1 + weight, GeGLU)
    with a SentencePiece BPE vocabulary in Gemma's layout (pad 0, eos 1, bos 2, unk 3,
    mask 4), which llama.cpp's converter reads from ``tokenizer.model``."""
    import io

    import sentencepiece as spm
    import torch
    from tokenizers.models import BPE
    from transformers import GemmaConfig, GemmaForCausalLM, GemmaTokenizer
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    from quantdask.demo_model import generate_text

    out.mkdir(parents=True, exist_ok=True)
    model_file = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(generate_text(400, seed=3).splitlines()), model_writer=model_file,
        vocab_size=vocab, model_type="bpe", byte_fallback=True, pad_id=0, eos_id=1, bos_id=2,
        unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        user_defined_symbols=["<mask>"], character_coverage=1.0, add_dummy_prefix=False,
        split_digits=True, minloglevel=2)
    (out / "tokenizer.model").write_bytes(model_file.getvalue())
    pieces = SentencePieceExtractor(str(out / "tokenizer.model")).extract(BPE)
    tokenizer = GemmaTokenizer(vocab=pieces["vocab"], merges=pieces["merges"],
                               add_bos_token=True)
    tokenizer.save_pretrained(out)
    config = GemmaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=ffn,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden // 4, max_position_embeddings=512, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    model = GemmaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():  # Gemma's norms scale by 1 + weight
            param.copy_(torch.zeros_like(param) if "norm" in name
                        else torch.randn_like(param) * 0.06)
    model.save_pretrained(out)
    (out / "eval.txt").write_text(generate_text(200, seed=11))
    return out


def cached_f32(folder: Path) -> Path:
    """``folder``'s F32 GGUF as a sweep's conversion task makes it, in the conversion cache:
    the sweeps of a test model then find it there instead of converting again."""
    from quantdask.gguf.conversion import converted
    from quantdask.sweepfile.model import ModelSpec

    return converted(ModelSpec(path=str(folder)), "f32")


def plain_figures(gguf: Path, checkpoint: Path, windows) -> dict[str, float]:
    """KL to the checkpoint in float32 torch, perplexity and top-1 agreement of the GGUF in
    llama.cpp over every position but the last of ``windows`` (token ids), computed plainly:
    its own torch forward and its own llama.cpp loop, none of quantdask's code (the
    independent computation quantdask's figures must equal)."""
    import math

    import llama_cpp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(windows).logits.double(), -1)[:, :-1]
    length = windows.shape[1]
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=length, n_batch=length, n_ubatch=length,
                          logits_all=True, n_threads=2, verbose=False)
    out = []
    for window in windows.tolist():
        llm.reset()
        llm.eval(window)
        out.append(torch.log_softmax(torch.tensor(np.array(llm.scores[:length - 1]),
                                                  dtype=torch.float64), -1))
    llm.close()
    ours = torch.stack(out)
    nll = -ours.gather(-1, windows[:, 1:, None]).squeeze(-1)
    return {"kl_divergence": float((ref.exp() * (ref - ours)).sum(-1).mean()),
            "perplexity": math.exp(float(nll.mean())),
            "top1_agreement": float((ours.argmax(-1) == ref.argmax(-1)).double().mean())}


def require_gguf() -> None:
    """Skip the calling test module where the gguf extra or llama.cpp's converter (``quantdask
    gguf-setup``) is missing."""
    import pytest

    pytest.importorskip("llama_cpp", reason="pip install 'quantdask[gguf]'")
    from quantdask.gguf.source import missing_converter

    if missing_converter():
        pytest.skip(missing_converter(), allow_module_level=True)


def gguf_search_sweep(folder: Path, calibration: str, name: str, model: str,
                      types: tuple[str, ...] = ("Q4_K_M",), samples: int = 8):
    """A sweep of the model at ``folder`` (named ``model``): a search ``mix`` over Q2_K, Q4_K
    and Q8_0 per unit at 5 bits per weight, the rest as Q4_K_M writes it, beside the stock
    ``types``, on ``samples`` eval windows of its ``eval.txt``."""
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    return sweep_from_dict({
        "name": name, "models": [{"name": model, "path": str(folder)}],
        "backends": [{"backend": "gguf", "grid": {"type": list(types)}}],
        "eval": {"text": str(folder / "eval.txt"), "seq_len": 128, "samples": samples,
                 "batch_size": 4, "kl_top_k": "all"},
        "calibration": {"text": calibration, "samples": 8, "seq_len": 128},
        "searches": [{"name": "mix", "model": model, "backend": "gguf",
                      "base": {"type": "Q4_K_M"},
                      "formats": {"q2": {"tensor_type": "Q2_K"}, "q4": {"tensor_type": "Q4_K"},
                                  "q8": {"tensor_type": "Q8_0"}},
                      "budget": {"bits_per_weight": 5.0}, "windows": 8, "cells_per_task": 16}],
        "seed": 0, "retries": 0})
