"""``quantdask gguf-setup``: llama.cpp's converter, from the pinned llama-cpp-python sdist."""

from __future__ import annotations


def cmd_gguf_setup(args) -> int:
    from quantdask.gguf.source import converter_dir, install_converter, missing_converter

    already = missing_converter() is None
    folder = install_converter(args.sdist)
    print(f"llama.cpp's converter {'already ' if already else ''}at {folder} "
          f"(override with $QUANTDASK_LLAMA_CPP); {converter_dir() / 'COMMIT'}")
    return 0
