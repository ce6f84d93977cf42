"""Three test models spanning flat, peaked and realistic next-token distributions, and an exact
float64 KL harness that is independent of quantdask.

quantdask measures KL(unquantized || quantized) per predicted token against a compressed
reference (the top-k log-probs plus one bucket for the rest, a lower bound of the exact KL).
How tight that bound is depends on how peaked the model's predictions are, so approximations
are validated here on three regimes, against plain transformers + torch in float64:

- **flat** (``flat_model(tmp_dir)``): a randomly initialised Llama (vocabulary 4,096) with the
  demo model's tokenizer, built at test time (no training, under a second). Near-uniform
  predictions: perplexity about 4,200, the top 64 tokens hold 2.3% of the mass.
- **peaked** (``PEAKED_MODEL``): the demo model ``data/demo-model`` (trained on generated facts;
  perplexity 1.71 on 16 windows of 128 tokens of its eval text, the top 64 of its 320 tokens
  hold 99.8% of the mass).
- **realistic** (``REALISTIC_MODEL``, eval text ``REALISTIC_EVAL_TEXT``): a small Llama trained
  by ``build_realistic_model`` on English-like text with a natural (Zipfian) word-frequency
  spread, so that it is uncertain the way real language models are. Measured on the committed
  copy, 64 windows of 128 tokens of its held-out eval text: perplexity 35.2 (35.8 on the first
  16 windows), top-64 mass 0.84 on average (0.74 where a content word comes next, 0.97 where a
  function word does; 0.88 at sentence starts, where the perplexity is 52). 1.9 MB on disk
  (vocabulary 2,759 words, hidden 64: bitsandbytes' 4-bit CPU kernels need input widths that
  are multiples of 64). Built in 11 minutes on 2 shared, busy cores (7.4 CPU-minutes).

How the realistic text is made (``realistic_text``): a fixed lexicon of pseudo-words (1,400
nouns, 500 verbs, 450 adjectives, 120 adverbs, 250 names, about 40 function words), each open
class drawn with Zipf weights (exponent 1.05), so a few words are common and most are rare.
Sentences come from a small grammar with real randomness: an optional opener (adverb, "then",
"but", "meanwhile" ...), a subject (a name or a noun phrase: determiner, maybe an adjective,
noun), a verb, maybe an object, maybe a prepositional phrase, maybe "and" + a second verb
phrase, a full stop. Words depend on each other the way real text's do, loosely: each noun
prefers a few adjectives and verbs, each verb a few objects and prepositions (about half the
time; the rest is drawn from the whole class), so context helps without making the text
predictable. Sentence starts (names, adverbs, determiners) and content words have long tails,
function words are nearly certain. The model (hidden 64, 2 layers, a word-level tokenizer) is
trained for a limited number of steps, enough to learn the frequency spread and the common
pairings but not the rare words.

The harness:

- ``eval_windows_like_quantdask(model_dir, text_path, seq_len, samples)``: the text's tokens
  (``tokenizer(text)["input_ids"]``), the first ``samples * seq_len`` of them as
  non-overlapping windows, as quantdask cuts them.
- ``exact_quality(model_dir, quantized_model, windows)``: per-position float64 KL(p || q),
  NLL under p and q, top-1 agreement, probability of the correct token, top-k mass of p and the
  top-k-plus-one-bucket lower bound of the KL, and their means.

Exact KL and its top-64-plus-one-bucket lower bound, 16 windows of 128 tokens, bitsandbytes on
the CPU (nf4 with float32 compute; int8 ``load_in_8bit``):

=========  ======  ==========  ==========  ===========
model      config  exact KL    bound       bound / KL
=========  ======  ==========  ==========  ===========
flat       nf4     8.09e-05    1.91e-06    0.024
flat       int8    6.17e-07    1.42e-08    0.023
peaked     nf4     7.56e-03    7.53e-03    0.996
peaked     int8    2.11e-04    2.11e-04    0.999
realistic  nf4     5.97e-04    4.97e-04    0.832
realistic  int8    2.84e-05    2.42e-05    0.852
=========  ======  ==========  ==========  ===========

>>> sorted(REGIMES)
['flat', 'peaked', 'realistic']
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEMO_MODEL = REPO / "data" / "demo-model"
DEMO_EVAL_TEXT = str(REPO / "data" / "demo" / "eval.txt")
PEAKED_MODEL = str(DEMO_MODEL)
REALISTIC_MODEL = str(HERE / "data" / "realistic-model")
REALISTIC_EVAL_TEXT = str(HERE / "data" / "realistic-eval.txt")
REGIMES = ("flat", "peaked", "realistic")

FLAT_VOCAB = 4096
FLAT_SEED = 0


# --- flat: a random-init Llama ------------------------------------------------------------------

def flat_model(tmp_dir: str | os.PathLike) -> str:
    """A randomly initialised Llama (vocabulary 4,096, hidden 64, 2 layers) saved with the demo
    model's tokenizer to ``tmp_dir/flat-model``; returns that path. Deterministic, under a second.

    >>> import tempfile; flat_model(tempfile.mkdtemp()).endswith("flat-model")
    True
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(tmp_dir) / "flat-model"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = LlamaConfig(
        vocab_size=max(FLAT_VOCAB, len(tokenizer)), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(FLAT_SEED)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    return str(out)


# --- realistic: Zipfian English-like text and a small Llama trained on it -------------------------

_ONSETS = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "st", "gr", "pl", "sh", "th", "tr", "kl"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
_CODAS = ["", "", "", "n", "r", "l", "s", "t", "m", "k"]
_DETERMINERS = {"the": 40, "a": 16, "this": 5, "that": 4, "every": 2, "some": 4, "my": 3,
                "his": 3, "her": 3, "their": 2, "one": 2, "no": 1}
_PREPOSITIONS = ["in", "on", "with", "near", "under", "behind", "over", "into", "from", "for"]
_OPENERS = {"then": 6, "but": 4, "meanwhile": 2, "later": 3, "still": 2, "so": 3, "yesterday": 2,
            "today": 2, "suddenly": 1, "perhaps": 1}
_FUNCTION = ["and", ".", ","]
_SIZES = {"noun": 1400, "verb": 500, "adj": 450, "adv": 120, "name": 250}
_ZIPF_S = 1.05
LEXICON_SEED = 2024


def _lexicon() -> dict[str, list[str]]:
    """Pseudo-words per open class, in Zipf rank order (most frequent first); fixed."""
    rng = random.Random(LEXICON_SEED)
    taken = set(_DETERMINERS) | set(_PREPOSITIONS) | set(_OPENERS) | set(_FUNCTION)
    classes: dict[str, list[str]] = {}
    for kind, size in _SIZES.items():
        words: list[str] = []
        while len(words) < size:
            word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS)
                           for _ in range(rng.choice((1, 2, 2, 3)))) + rng.choice(_CODAS)
            if kind == "name":
                word = word.capitalize()
            if word not in taken:
                taken.add(word)
                words.append(word)
        classes[kind] = words
    return classes


class _Zipf:
    """Draws from a list with weight 1 / rank ** s."""

    def __init__(self, items: list[str], s: float = _ZIPF_S):
        self.items = items
        weights = [1.0 / (rank + 1) ** s for rank in range(len(items))]
        total = 0.0
        self.cumulative = []
        for w in weights:
            total += w
            self.cumulative.append(total)

    def __call__(self, rng: random.Random) -> str:
        return rng.choices(self.items, cum_weights=self.cumulative)[0]


def _affinities(lex: dict[str, list[str]]) -> dict:
    """Which adjectives and verbs each noun (and name) prefers, which objects and prepositions
    each verb prefers: a few each, drawn by frequency, fixed."""
    rng = random.Random(LEXICON_SEED + 1)
    adj, verb, noun = _Zipf(lex["adj"]), _Zipf(lex["verb"]), _Zipf(lex["noun"])
    return {
        "adj": {n: [adj(rng) for _ in range(4)] for n in lex["noun"]},
        "verb": {n: [verb(rng) for _ in range(6)] for n in lex["noun"] + lex["name"]},
        "object": {v: [noun(rng) for _ in range(8)] for v in lex["verb"]},
        "prep": {v: rng.sample(_PREPOSITIONS, 2) for v in lex["verb"]},
    }


def realistic_text(n_sentences: int, seed: int) -> str:
    """English-like sentences over a Zipfian lexicon, one a line (see the module docstring).

    >>> realistic_text(2, seed=0).count("\\n")
    2
    """
    lex = _lexicon()
    aff = _affinities(lex)
    rng = random.Random(seed)
    noun, verb, adj = _Zipf(lex["noun"]), _Zipf(lex["verb"]), _Zipf(lex["adj"])
    adv, name = _Zipf(lex["adv"]), _Zipf(lex["name"])
    dets, det_weights = list(_DETERMINERS), list(_DETERMINERS.values())
    openers, opener_weights = list(_OPENERS), list(_OPENERS.values())

    def pick(preferred: list[str], anywhere: _Zipf) -> str:
        return rng.choice(preferred) if rng.random() < 0.5 else anywhere(rng)

    def noun_phrase(head: str) -> list[str]:
        words = [rng.choices(dets, det_weights)[0]]
        if rng.random() < 0.4:
            words.append(pick(aff["adj"][head], adj))
        return words + [head]

    def verb_phrase(subject: str) -> list[str]:
        v = pick(aff["verb"][subject], verb)
        words = [v]
        if rng.random() < 0.7:
            words += noun_phrase(pick(aff["object"][v], noun))
        if rng.random() < 0.35:
            prep = rng.choice(aff["prep"][v]) if rng.random() < 0.6 else rng.choice(_PREPOSITIONS)
            words += [prep] + noun_phrase(noun(rng))
        if rng.random() < 0.15:
            words.append(adv(rng))
        return words

    lines = []
    for _ in range(n_sentences):
        words: list[str] = []
        r = rng.random()
        if r < 0.15:
            words += [adv(rng), ","]
        elif r < 0.35:
            words.append(rng.choices(openers, opener_weights)[0])
        if rng.random() < 0.3:
            subject = name(rng)
            words.append(subject)
        else:
            subject = noun(rng)
            words += noun_phrase(subject)
        words += verb_phrase(subject)
        if rng.random() < 0.15:
            words += ["and"] + verb_phrase(subject)
        words.append(".")
        lines.append(" ".join(words))
    return "\n".join(lines) + "\n"


def build_word_tokenizer():
    """A word-level tokenizer over the whole lexicon (no unknown words in any generated text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    lex = _lexicon()
    words = (["<unk>", "<s>", "</s>", "<pad>"] + list(_DETERMINERS) + _PREPOSITIONS
             + list(_OPENERS) + _FUNCTION + [w for kind in _SIZES for w in lex[kind]])
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


def build_realistic_model(out_dir: str | os.PathLike = REALISTIC_MODEL,
                          eval_text_path: str | os.PathLike = REALISTIC_EVAL_TEXT,
                          steps: int = 700, seed: int = 0, log=print) -> str:
    """Train the realistic model (a Llama, hidden 64, 2 layers) on Zipfian generated text and
    write it (safetensors + tokenizer) to ``out_dir`` and its held-out eval text (another seed,
    about 9,900 tokens: 64 windows of 128 and more) to ``eval_text_path``. Deterministic on one
    machine (with the same thread count); 700 steps of 32 x 128 tokens, 7 CPU-minutes.

    ``python tests/kl_models.py`` rebuilds the committed copy.
    """
    import torch

    from quantdask.demo_model import train_and_save_llama

    torch.manual_seed(seed)
    tokenizer = build_word_tokenizer()
    train_text = realistic_text(80_000, seed=seed)
    train_and_save_llama(tokenizer, train_text, out_dir, steps=steps, seq_len=128, seed=seed,
                         log=log, hidden_size=64, intermediate_size=256, num_hidden_layers=2)
    os.makedirs(os.path.dirname(os.fspath(eval_text_path)) or ".", exist_ok=True)
    with open(eval_text_path, "w", encoding="utf-8") as f:
        f.write(realistic_text(1_200, seed=seed + 1))
    return os.fspath(out_dir)


# --- the exact harness ---------------------------------------------------------------------------

def eval_windows_like_quantdask(model_dir: str | os.PathLike, text_path: str | os.PathLike,
                                seq_len: int, samples: int):
    """The first ``samples`` non-overlapping windows of ``seq_len`` tokens of the text, as a
    LongTensor (samples x seq_len), cut the way quantdask cuts its eval windows."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(text_path, encoding="utf-8") as f:
        ids = tokenizer(f.read())["input_ids"]
    needed = seq_len * samples
    if len(ids) < needed:
        raise ValueError(f"{text_path} has {len(ids)} tokens; {samples} x {seq_len} needs {needed}")
    return torch.tensor(ids[:needed], dtype=torch.long).view(samples, seq_len)


PER_POSITION = ("kl", "kl_top_k_bound", "nll_p", "nll_q", "top1_agree", "p_correct_p",
                "p_correct_q", "top_k_mass_p")


def exact_quality(model_dir: str | os.PathLike, quantized_model, windows, *, top_k: int = 64,
                  batch_size: int = 8) -> dict:
    """Exact float64 quality of ``quantized_model`` (q) against the unquantized model loaded
    from ``model_dir`` (p), over the full vocabulary, on every position of ``windows`` but the
    last (the one whose next token is known).

    Returns per-position numpy float64 arrays (samples x (seq_len - 1)): ``kl`` (KL(p || q)),
    ``kl_top_k_bound`` (the same over p's ``top_k`` tokens plus one bucket for the rest, a lower
    bound of ``kl``), ``nll_p``/``nll_q`` (-log of the next token's probability),
    ``top1_agree`` (1.0 where the argmaxes are equal), ``p_correct_p``/``p_correct_q`` (the next
    token's probability) and ``top_k_mass_p`` (the mass of p's ``top_k`` tokens); and means:
    ``perplexity`` (of q), ``perplexity_unquantized`` (of p), ``kl_divergence``,
    ``kl_top_k_lower_bound``, ``top1_agreement``, ``top_k_mass`` (p's), with ``top_k``.

    >>> import torch; from transformers import AutoModelForCausalLM
    >>> fp = AutoModelForCausalLM.from_pretrained(PEAKED_MODEL)
    >>> exact_quality(PEAKED_MODEL, fp, torch.tensor([[5, 6, 7, 8]]))["kl_divergence"]
    0.0
    """
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    device = next(quantized_model.parameters()).device
    parts: dict[str, list] = {name: [] for name in PER_POSITION}
    with torch.inference_mode():
        for batch in windows.split(batch_size):
            log_p = torch.log_softmax(reference(input_ids=batch).logits[:, :-1].double(), -1)
            logits_q = quantized_model(input_ids=batch.to(device)).logits[:, :-1]
            log_q = torch.log_softmax(logits_q.double().cpu(), -1)
            for name, value in _per_position(log_p, log_q, batch[:, 1:], top_k).items():
                parts[name].append(value)
    result: dict = {name: torch.cat(parts[name]).numpy().astype(np.float64)
                    for name in PER_POSITION}
    result.update(
        perplexity=float(np.exp(result["nll_q"].mean())),
        perplexity_unquantized=float(np.exp(result["nll_p"].mean())),
        kl_divergence=float(result["kl"].mean()),
        kl_top_k_lower_bound=float(result["kl_top_k_bound"].mean()),
        top1_agreement=float(result["top1_agree"].mean()),
        top_k_mass=float(result["top_k_mass_p"].mean()),
        top_k=top_k,
    )
    return result


def _per_position(log_p, log_q, targets, top_k: int) -> dict:
    """The per-position quantities of one batch of float64 log-probs (batch x positions x V)."""
    import torch

    p = log_p.exp()
    kl = (p * (log_p - log_q)).sum(-1)
    nll_p = -log_p.gather(-1, targets[..., None])[..., 0]
    nll_q = -log_q.gather(-1, targets[..., None])[..., 0]
    k = min(top_k, log_p.size(-1))
    top_p, ids = log_p.topk(k, dim=-1)
    top_q = log_q.gather(-1, ids)
    # The rest bucket's mass, summed from the remaining tokens themselves (not 1 - top):
    # exact even where the top tokens hold nearly all of it.
    outside = torch.ones_like(log_p, dtype=torch.bool).scatter_(-1, ids, False)
    rest_p = torch.logsumexp(log_p.masked_fill(~outside, -torch.inf), -1)
    rest_q = torch.logsumexp(log_q.masked_fill(~outside, -torch.inf), -1)
    rest_term = torch.where(rest_p > -torch.inf, rest_p.exp() * (rest_p - rest_q),
                            torch.zeros_like(rest_p))
    bound = (top_p.exp() * (top_p - top_q)).sum(-1) + rest_term
    return {
        "kl": kl, "kl_top_k_bound": bound, "nll_p": nll_p, "nll_q": nll_q,
        "top1_agree": (log_p.argmax(-1) == log_q.argmax(-1)).double(),
        "p_correct_p": (-nll_p).exp(), "p_correct_q": (-nll_q).exp(),
        "top_k_mass_p": top_p.exp().sum(-1),
    }


if __name__ == "__main__":
    started = time.perf_counter()
    print(build_realistic_model())
    print(f"built in {time.perf_counter() - started:.0f}s")
