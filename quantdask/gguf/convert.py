"""A Hugging Face checkpoint to a full-precision GGUF, with llama.cpp's own converter (run as
a subprocess from the pinned source: ``source``). What it cannot convert (an architecture or a
BPE pre-tokenizer llama.cpp does not know, sentencepiece missing) is :class:`UnsupportedHere`
with its reason: the job is skipped, never crashed, never given a wrong tokenizer."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from quantdask.errors import UnsupportedHere
from quantdask.gguf.source import converter_dir, missing_converter

OUTTYPES = ("f32", "f16", "bf16")


def convert(model_dir: str | os.PathLike, out: str | os.PathLike, outtype: str = "f32",
            timeout_s: float = 3600.0) -> Path:
    """``model_dir`` converted to ``out`` (written whole or not at all)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r}: one of {', '.join(OUTTYPES)}")
    why = missing_converter()
    if why:
        raise UnsupportedHere(why)
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    script = converter_dir() / "convert_hf_to_gguf.py"
    run = subprocess.run([sys.executable, str(script), str(model_dir), "--outtype", outtype,
                          "--outfile", str(partial)], capture_output=True, text=True,
                         timeout=timeout_s,  # its own gguf-py first: NO_LOCAL_GGUF unset
                         env={k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"})
    if run.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise _failure(run.stdout + run.stderr)
    partial.replace(out)
    return out


def _failure(output: str) -> Exception:
    """What a failed conversion says, as the error a job records."""
    arch = re.search(r"Model (\S+) is not supported", output)
    if arch:
        return UnsupportedHere(f"llama.cpp's converter does not support the architecture "
                               f"{arch.group(1)}")
    if "BPE pre-tokenizer was not recognized" in output:
        found = re.search(r"chkhsh:\s*([0-9a-f]{64})", output)
        return UnsupportedHere(
            "llama.cpp's converter does not recognize this model's BPE pre-tokenizer (chkhsh "
            f"{found.group(1) if found else 'unknown'}): a GGUF with a guessed tokenizer would "
            "tokenize differently from the model's own")
    missing = re.search(r"File not found: (\S*tokenizer\.model)", output)
    if missing:
        return UnsupportedHere(
            "llama.cpp's converter reads this architecture's vocabulary from a SentencePiece "
            "tokenizer.model, and the checkpoint has none (only tokenizer.json)")
    if "No module named 'sentencepiece'" in output:
        return UnsupportedHere("llama.cpp's converter needs sentencepiece: pip install "
                               "'quantdask[gguf]'")
    tail = "\n".join(output.strip().splitlines()[-5:])
    return RuntimeError(f"llama.cpp's converter failed:\n{tail}")
