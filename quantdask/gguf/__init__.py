"""GGUF: llama.cpp's own converter, quantizer and runtime (issue 55, in progress)."""
