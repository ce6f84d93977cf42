"""The built-in demo: a tiny Llama model trained here on text generated here (no downloads).

``python -m quantdask.demo_model`` rebuilds ``data/demo-model`` and the eval text (``--out DIR``
and ``--eval-text FILE`` write them elsewhere). The build is deterministic on one machine; the
committed copy is what the demo and tests use, and the wheel ships it (``quantdask/data``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from quantdask import resources

# Where the demo ships (``data/`` of a checkout, ``quantdask/data`` of an installed wheel), as
# strings: see quantdask.resources.
DATA_DIR = os.fspath(resources.data_dir())
DEMO_MODEL_DIR = os.fspath(resources.demo_model_dir())
DEMO_EVAL_TEXT = os.fspath(resources.demo_eval_text())
DEMO_SWEEP = os.fspath(resources.demo_sweep())
DEMO_CALIBRATION_NAME = "calibration.txt"  # beside the eval text: the demo search's probes
DEMO_TASKS_DIR = os.fspath(resources.demo_tasks_dir())

_SYLLABLES = ["ka", "lo", "mi", "ren", "to", "vas", "pe", "nu", "dar", "si", "gol", "be",
              "fa", "zu", "tin", "ro"]
_COLOURS = ["red", "grey", "brown", "white", "black", "gold", "green", "blue"]
_PLACES = ["forest", "river", "hill", "field", "lake", "cave", "marsh", "meadow"]
_FOODS = ["berries", "fish", "seeds", "roots", "mice", "grass", "insects", "nuts"]
_VERBS = ["sees", "follows", "greets", "watches", "chases", "helps", "avoids", "meets"]
_NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
N_CREATURES = 160


def _facts() -> dict[str, dict[str, str]]:
    """Named creatures, each with a fixed colour, home, food and friend: facts to memorise.

    Memorised facts are what quantization damages first, which makes the quality gap between
    configurations visible on a model this small.
    """
    rng = random.Random(1234)
    names: list[str] = []
    while len(names) < N_CREATURES:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((2, 3))))
        if name not in names:
            names.append(name)
    facts = {n: {"colour": rng.choice(_COLOURS), "home": rng.choice(_PLACES),
                 "food": rng.choice(_FOODS)} for n in names}
    for n in names:
        facts[n]["friend"] = rng.choice([m for m in names if m != n])
    return facts


def generate_text(n_sentences: int, seed: int) -> str:
    """English-like text stating the creatures' facts in several phrasings.

    The facts are the same for every seed, so eval text from another seed tests what was learnt.
    """
    facts = _facts()
    names = sorted(facts)
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        a, b = rng.sample(names, 2)
        fa, fb = facts[a], facts[b]
        kind = rng.randrange(7)
        if kind == 0:
            lines.append(f"the {fa['colour']} {a} lives by the {fa['home']} .")
        elif kind == 1:
            lines.append(f"{a} eats {fa['food']} and {b} eats {fb['food']} .")
        elif kind == 2:
            lines.append(f"the {fa['colour']} {a} {rng.choice(_VERBS)} the {fb['colour']} {b} "
                         f"near the {fb['home']} .")
        elif kind == 3:
            start = rng.randrange(len(_NUMBERS) - 3)
            count = " ".join(_NUMBERS[start:start + rng.randrange(3, len(_NUMBERS) - start + 1)])
            lines.append(f"{a} counts {count} .")
        elif kind == 4:
            lines.append(f"where does {a} live ? {a} lives by the {fa['home']} .")
        elif kind == 5:
            lines.append(f"who is the friend of {a} ? it is {fa['friend']} , the "
                         f"{facts[fa['friend']]['colour']} one .")
        else:
            lines.append(f"what does {a} eat ? {a} eats {fa['food']} , like {fa['friend']} "
                         f"eats {facts[fa['friend']]['food']} .")
    return "\n".join(lines) + "\n"


def build_tokenizer(text: str, vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on ``text``, as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")


def build_demo_model(out_dir: str = DEMO_MODEL_DIR, eval_path: str = DEMO_EVAL_TEXT,
                     steps: int = 600, seed: int = 0, log=print) -> str:
    """Train the demo model and write it (safetensors + tokenizer) to ``out_dir``."""
    train_small_llama(out_dir, steps=steps, seed=seed, log=log)
    os.makedirs(os.path.dirname(eval_path), exist_ok=True)
    with open(eval_path, "w", encoding="utf-8") as f:
        f.write(generate_text(1_500, seed=seed + 1))
    # The demo search's calibration text, beside the eval text: a third seed, so its probes
    # predict on other windows than the jobs measure.
    with open(os.path.join(os.path.dirname(eval_path), DEMO_CALIBRATION_NAME), "w",
              encoding="utf-8") as f:
        f.write(generate_text(300, seed=seed + 2))
    build_demo_task(os.path.join(DEMO_TASKS_DIR, "demo_facts"))
    return out_dir


_DEMO_TASK_YAML = """\
# A multiple-choice task for lm-evaluation-harness on the demo model's facts, written by
# quantdask.demo_model.build_demo_task: a creature's food, home or friend, out of eight choices.
task: demo_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: demo_facts.jsonl  # relative to this folder: quantdask resolves it before lm-eval
test_split: test
output_type: multiple_choice
doc_to_text: "{{query}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def load_demo_sweep():
    """The demo sweep (``DEMO_SWEEP``), less what this install cannot run, each with a line
    saying what adds it (the demo runs everywhere the package does): its task accuracy and
    the gates on it need lm-evaluation-harness (the ``tasks`` extra), its search hqq (the
    ``hqq`` extra); ``make demo`` installs both."""
    import importlib.util

    import yaml

    from quantdask.backends.base import missing_library
    from quantdask.backends.hqq import HQQ
    from quantdask.sweepfile.sweep_file import sweep_from_dict
    from quantdask.sweepfile.tasks import INSTALL_TASKS

    with open(DEMO_SWEEP, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    if importlib.util.find_spec("lm_eval") is None:
        del data["tasks"], data["gates"]
        print(f"quantdask: the demo's task accuracy and gates need lm-evaluation-harness: "
              f"{INSTALL_TASKS}", flush=True)
    if missing_library(*HQQ) is not None:
        # Dropped before anything runs: its calibration block serves only the search.
        del data["searches"], data["calibration"]
        print(f"quantdask: the demo's search (the mix of HQQ formats to ship under a size) "
              f"needs hqq: pip install {HQQ[2]}; the demo runs without it", flush=True)
    return sweep_from_dict(data, root=os.path.dirname(os.path.abspath(DEMO_SWEEP)))


def build_demo_task(out_dir: str) -> str:
    """Write the lm-eval task ``demo_facts`` (``demo_facts.yaml`` and ``demo_facts.jsonl``) to
    ``out_dir``: for each creature, in name order, what it eats, where it lives and who its
    friend is, asked as the training text asks them, out of eight choices (``_FOODS``,
    ``_PLACES``, or the friend among seven other names drawn with a fixed seed). Food and home
    the demo model knows almost always; friends, one fact among 160 names, are what
    quantization loses first."""
    facts = _facts()
    names = sorted(facts)
    rng = random.Random(7)
    docs = []
    for name in names:
        fact = facts[name]
        docs.append({"query": f"what does {name} eat ? {name} eats", "choices": _FOODS,
                     "gold": _FOODS.index(fact["food"])})
        docs.append({"query": f"where does {name} live ? {name} lives by the",
                     "choices": _PLACES, "gold": _PLACES.index(fact["home"])})
        friends = rng.sample([n for n in names if n not in (name, fact["friend"])], 7)
        friends.insert(rng.randrange(8), fact["friend"])
        docs.append({"query": f"who is the friend of {name} ? it is", "choices": friends,
                     "gold": friends.index(fact["friend"])})
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "demo_facts.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(doc) + "\n" for doc in docs)
    with open(os.path.join(out_dir, "demo_facts.yaml"), "w", encoding="utf-8") as f:
        f.write(_DEMO_TASK_YAML)
    return out_dir


def train_causal_lm(model, ids, steps: int, seq_len: int, batch: int = 32, seed: int = 0,
                    log=print) -> None:
    """Train ``model`` for ``steps`` steps on random windows of ``seq_len`` tokens of ``ids``
    (AdamW, one-cycle learning rate peaking at 3e-3), deterministically for a seed."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=generator)
        x = torch.stack([ids[s:s + seq_len] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step:4d}  loss {loss.item():.3f}  {time.perf_counter() - started:.0f}s")


def train_small_llama(out_dir: str, steps: int = 600, seed: int = 0, vocab_size: int | None = None,
                      hidden_size: int = 128, layers: int = 4, log=print) -> str:
    """Train a small Llama on the generated text and save it with its tokenizer to ``out_dir``.

    ``vocab_size`` widens the output layer past the tokenizer's 320 tokens (the extra ids never
    occur, so training pushes their probability down, as for a real model's rare tokens); the
    demo model keeps the tokenizer's size."""
    import torch

    torch.manual_seed(seed)
    train_text = generate_text(40_000, seed=seed)
    tokenizer = build_tokenizer(train_text)
    return train_and_save_llama(tokenizer, train_text, out_dir, steps=steps, seq_len=64,
                                seed=seed, log=log, vocab_size=vocab_size or len(tokenizer),
                                hidden_size=hidden_size, intermediate_size=3 * hidden_size,
                                num_hidden_layers=layers)


def train_and_save_llama(tokenizer, train_text: str, out_dir, *, steps: int, seq_len: int,
                         seed: int, log=print, **shape) -> str:
    """A Llama of ``shape`` (``LlamaConfig`` fields; 4 heads, 2 key/value heads, untied
    embeddings unless given) trained on ``train_text`` (``train_causal_lm``) and saved with its
    tokenizer to ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{
        "vocab_size": len(tokenizer), "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, **shape})
    model = LlamaForCausalLM(config)
    train_causal_lm(model, torch.tensor(tokenizer(train_text)["input_ids"]), steps,
                    seq_len=seq_len, seed=seed, log=log)
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return os.fspath(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEMO_MODEL_DIR)
    parser.add_argument("--eval-text", default=DEMO_EVAL_TEXT)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args(argv)
    print(build_demo_model(args.out, args.eval_text, steps=args.steps))


if __name__ == "__main__":
    main()
