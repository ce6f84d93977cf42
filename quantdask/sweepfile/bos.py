"""Which token starts each eval window: ``eval.bos`` resolved with a model's own tokenizer.

Models trained always with a beginning-of-sequence token (Llama, Gemma, Mistral...) are off
their training distribution on a window that starts mid-text without one; llama.cpp's
perplexity puts one at the start of every chunk when the model's vocabulary asks for it. The
rule:

- ``auto`` (the default): a BOS at position 0 of every window exactly when the tokenizer adds
  one to a plain encode (its own setting, not a list of families);
- ``always``: a BOS on every window (refused for a tokenizer that has none, as Qwen2's);
- ``never``: the text cut as the tokenizer encodes it (one BOS at most, in window 0): what
  quantdask measured before the rule existed.

The resolved token id is part of the eval's identity only where a BOS is inserted, so the jobs
of a model without one keep their ids and recorded results.
"""

from __future__ import annotations

import functools
import glob
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quantdask.errors import SpecError

if TYPE_CHECKING:
    from quantdask.sweepfile.model import ModelSpec

BOS_RULES = ("auto", "always", "never")
_PROBE_TEXT = "The first words of a text."


@dataclass(frozen=True)
class TokenizerBos:
    """What a tokenizer says of its BOS token: its id (None: it has none) and whether a plain
    encode (``tokenizer(text)``) starts with it."""

    bos_token_id: int | None
    adds_bos: bool


def tokenizer_bos(tokenizer) -> TokenizerBos:
    """``tokenizer``'s BOS token, and whether it adds it to a plain encode."""
    bos = tokenizer.bos_token_id
    special = tokenizer(_PROBE_TEXT)["input_ids"]
    plain = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    adds = bos is not None and len(special) > len(plain) and special[0] == bos
    return TokenizerBos(bos, adds)


def window_bos(rule: str, model: ModelSpec) -> int | None:
    """The token id ``rule`` puts at the start of every eval window of ``model``, or None (the
    text as tokenized). ``always`` on a tokenizer without a BOS token is refused here, before
    anything runs."""
    if rule == "never":
        return None
    found = _model_tokenizer_bos(model.location, model.revision, model.trust_remote_code,
                                 _stamp(model.location))
    if rule == "auto":
        return found.bos_token_id if found.adds_bos else None
    if found.bos_token_id is None:
        raise SpecError("eval.bos", f"always: model {model.label!r}'s tokenizer has no BOS "
                                    "token (bos_token_id is None, as Qwen2's); use auto (a BOS "
                                    "only where the tokenizer adds one) or never")
    return found.bos_token_id


def _stamp(location: str) -> tuple:
    """The tokenizer files of a local model (name, size, mtime): a tokenizer rewritten in
    place is read again."""
    if not os.path.isdir(location):
        return ()
    files = sorted(glob.glob(os.path.join(location, "*token*")))
    return tuple((f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files)


@functools.lru_cache(maxsize=64)
def _model_tokenizer_bos(location: str, revision: str | None, trust_remote_code: bool,
                         stamp: tuple) -> TokenizerBos:
    """The model's tokenizer's BOS, read once per model (the tokenizer alone; a hub model's
    tokenizer files are fetched as its workers would fetch them)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(location, revision=revision,
                                                  trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - any loading failure is this field's
        raise SpecError("eval.bos", f"the tokenizer of {location} cannot be read to decide "
                                    f"whether each window starts with a BOS ({error}); set "
                                    "eval.bos to always or never, or fix the model") from None
    return tokenizer_bos(tokenizer)
