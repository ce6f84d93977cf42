"""lm-eval tasks answered by a GGUF in llama.cpp's own runtime (llama-cpp-python), not by
llama-server: the same requests lm-eval gives ``HFLM``, encoded by the same rules with the
checkpoint's own tokenizer, fed to llama.cpp as token ids, every position's logits read back.

- ``loglikelihood`` (and ``loglikelihood_rolling``, over lm-eval's rolling windows): each
  request's context and continuation in one decode; a request that shares a prefix with the
  one before (a question's choices share their context) decodes only the tokens after it, on
  the KV cache llama.cpp already holds. The bindings decode one sequence at a time.
- ``generate_until``: greedy, token by token, until a stop sequence of the task's, the end of
  text or ``max_gen_toks``.

The tokens are the ones ``HFLM`` would make (its ``tok_encode`` and prefix rules, borrowed), so
a GGUF job's task items pair question for question with a torch job's."""

from __future__ import annotations

import os
from typing import Any

from quantdask.gguf.runtime import RuntimeDevice

DEFAULT_MAX_LENGTH = 2048
"""lm-eval's own window when neither the tasks block nor the model's config sets one."""
DEFAULT_MAX_GEN_TOKS = 256
"""lm-eval's ``HFLM`` default for a task that sets no ``max_gen_toks``."""


SCORED_OUTPUT_TYPES = frozenset({"loglikelihood", "loglikelihood_rolling", "multiple_choice",
                                 "generate_until"})
"""lm-eval's output types this LM answers (a multiple-choice task asks loglikelihoods)."""


def task_refusal(config: dict[str, Any]) -> str | None:
    """Why this LM cannot score the lm-eval task of ``config`` as ``HFLM`` would (None: it
    can): an output type it does not answer, images or audio given to the model, or answers
    sampled rather than greedy (its ``generate_until`` is greedy: a sampled task's scores
    would silently mean something else than the torch jobs' beside it)."""
    kind = config.get("output_type", "generate_until")
    if kind not in SCORED_OUTPUT_TYPES:
        return f"its output_type {kind!r} is not one llama.cpp's runtime here answers"
    given = [key for key in ("doc_to_image", "doc_to_audio") if config.get(key)]
    if given:
        return f"it gives the model {given[0].removeprefix('doc_to_')}s ({given[0]}), and " \
               "llama.cpp's runtime here reads text only"
    settings = config.get("generation_kwargs") or {}
    if kind == "generate_until" and (settings.get("do_sample")
                                     or float(settings.get("temperature") or 0) > 0):
        return (f"it samples its answers (generation_kwargs do_sample: "
                f"{settings.get('do_sample')}, temperature: {settings.get('temperature')}), and "
                "llama.cpp's runtime here decodes greedily")
    return None


def llama_cpp_lm(path: str | os.PathLike, tokenizer: Any, config: Any, device: RuntimeDevice,
                 max_length: int | None = None):
    """An lm-eval ``LM`` over the GGUF at ``path`` on ``device``, encoding with ``tokenizer``
    (the checkpoint's, as ``HFLM`` does) in a window of ``max_length`` tokens (else the
    model's ``config``'s, as lm-eval resolves it). ``close()`` it when done."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import resolve_max_length

    from quantdask.measure.tasks import EncodesEachStringOnce, NotesCutPrompts

    class Encoded(LlamaCppMethods, TemplateLM):
        # HFLM's encoding, unchanged: its BOS rule and its prefix for an empty context
        tok_encode = HFLM.tok_encode
        prefix_token_id = HFLM.prefix_token_id

    class LlamaCppLM(NotesCutPrompts, EncodesEachStringOnce, Encoded):
        """lm-eval's LM over llama.cpp (the module's docstring)."""

    lm = LlamaCppLM()
    lm.tokenizer = tokenizer
    lm.add_bos_token = None  # HFLM's default: the tokenizer's own
    lm.custom_prefix_token_id = None
    lm.max_length = max_length or resolve_max_length(config, tokenizer,
                                                     default=DEFAULT_MAX_LENGTH)
    lm.max_gen_toks = DEFAULT_MAX_GEN_TOKS
    lm.llm = device.open(path, n_ctx=lm.max_length, n_batch=lm.max_length,
                         n_ubatch=min(lm.max_length, 512), logits_all=True)
    return lm


class LlamaCppMethods:
    """What the LM of :func:`llama_cpp_lm` does with its ``llm`` (a ``llama_cpp.Llama``)."""

    tokenizer: Any
    llm: Any
    max_length: int
    max_gen_toks: int
    cache_hook: Any
    prefix_token_id: Any  # HFLM's, on the LM
    tok_encode: Any

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def close(self) -> None:
        self.llm.close()

    def _logits_of(self, tokens: list[int], last: int):
        """The logits (float32, ``last`` positions x vocab) of the last ``last`` positions
        of ``tokens``, decoding only what follows the prefix they share with the tokens
        decoded before."""
        import numpy as np

        llm = self.llm
        shared = 0
        for held, new in zip(llm.input_ids[:llm.n_tokens], tokens, strict=False):
            if held != new:
                break
            shared += 1
        llm.n_tokens = min(shared, len(tokens) - 1)  # at least one token decodes
        llm.eval(tokens[llm.n_tokens:])
        return np.asarray(llm.scores[len(tokens) - last:len(tokens)], dtype=np.float32)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        import numpy as np

        results = []
        for key, context, continuation in requests:
            # HFLM's window: the last max_length + 1 tokens, the last one only predicted
            whole = (context + continuation)[-(self.max_length + 1):]
            logits = self._logits_of(whole[:-1], len(continuation))
            shifted = logits - logits.max(axis=-1, keepdims=True)
            logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
            picked = logprobs[np.arange(len(continuation)), continuation]
            greedy = bool((logits.argmax(axis=-1) == np.asarray(continuation)).all())
            results.append((float(picked.sum()), greedy))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, results[-1])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        from lm_eval import utils

        totals = []
        for (string,) in [request.args for request in requests]:
            windows = [(None, *utils.make_disjoint_window(window))
                       for window in utils.get_rolling_token_windows(
                           token_list=self.tok_encode(string),
                           prefix_token=self.prefix_token_id,
                           max_seq_len=self.max_length, context_len=1)]
            totals.append(sum(ll for ll, _ in self._loglikelihood_tokens(windows)))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        from lm_eval.models.utils import normalize_gen_kwargs

        answers = []
        for context, gen_kwargs in [request.args for request in requests]:
            settings = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            until = settings.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            until.append(self.tok_decode([self.eot_token_id], skip_special_tokens=False))
            new_tokens = int(settings["max_gen_toks"])
            prompt = self.tok_encode(context)[-(self.max_length - new_tokens):]
            answers.append(self._greedy(prompt, new_tokens, until))
        return answers

    def _greedy(self, prompt: list[int], new_tokens: int, until: list[str]) -> str:
        tokens, made = list(prompt), []
        for _ in range(new_tokens):
            token = int(self._logits_of(tokens, 1)[0].argmax())
            if token == self.eot_token_id:
                break
            made.append(token)
            tokens.append(token)
            text = self.tok_decode(made)
            cut = [text.index(stop) for stop in until if stop and stop in text]
            if cut:
                return text[:min(cut)]
        return self.tok_decode(made)
