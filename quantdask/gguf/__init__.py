"""GGUF: llama.cpp's own converter, quantizer and runtime, as a backend (``gguf``)
whose jobs run in llama.cpp (issue 55, in progress)."""

import quantdask.gguf.backend  # noqa: F401  (registers the gguf backend)
