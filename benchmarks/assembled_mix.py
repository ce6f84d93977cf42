"""A searched mix's GGUF written two ways from the same converted file: by llama.cpp's own
quantizer (``llama_model_quantize``, every tensor quantized again) and assembled from tensors
quantized once per (tensor, type) and kept (``gguf.assembled``: a cold store, then a warm one),
with the bytes compared tensor by tensor.

    .venv/bin/python -m benchmarks.assembled_mix MODEL_DIR [--types Q8_0,Q4_K,Q6_K,Q3_K]
        [--threads 1]

Each side writes the same mix (every block tensor in the type, the embedding and output as
Q4_K_M gives them); one thread each, as on a CPU slot here. The cold assembly quantizes every
tensor once through libggml (what a search's cells do anyway); the warm one reads them back.
The converted file's header is read once in this process beforehand (a worker keeps it).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--types", default="Q8_0,Q4_K,Q6_K,Q3_K")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="quantdask-assembled-") as name:
        scratch = Path(name)
        os.environ["XDG_CACHE_HOME"] = str(scratch / "cache")  # a store of its own
        import numpy as np
        import torch

        from quantdask.backends import get_backend
        from quantdask.gguf.assembled import write_mix
        from quantdask.gguf.conversion import converted
        from quantdask.gguf.quantize import quantize_gguf
        from quantdask.gguf.searched import given_types
        from quantdask.gguf.source import read_gguf
        from quantdask.sweepfile.model import ModelSpec

        torch.set_num_threads(args.threads)
        began = time.perf_counter()
        base = converted(ModelSpec(path=args.model), "f32")
        read_gguf(base)
        print(f"converted and its header read in {time.perf_counter() - began:.1f} s: {base}")
        gguf = get_backend("gguf")
        print("| tensor type | llama.cpp's quantizer | assembled, cold store | assembled, warm "
              "store | same bytes |")
        print("|---|---:|---:|---:|---|")
        for kind in args.types.split(","):
            options = gguf.normalize({"type": "Q4_K_M", "tensor_type": kind}, "bench")
            given = given_types(base, options)
            timed = {}
            for side in ("llama", "cold", "warm"):
                out = scratch / f"{kind}-{side}.gguf"
                began = time.perf_counter()
                if side == "llama":
                    quantize_gguf(base, out, "Q4_K_M", threads=args.threads, given=given)
                else:
                    write_mix(base, out, "Q4_K_M", args.threads, given)
                timed[side] = time.perf_counter() - began
            files = {side: {t.name: np.asarray(t.data).view(np.uint8).tobytes()
                            for t in read_gguf(scratch / f"{kind}-{side}.gguf").tensors}
                     for side in ("llama", "warm")}
            same = files["llama"] == files["warm"]
            print(f"| {kind} | {timed['llama']:.2f} s | {timed['cold']:.2f} s | "
                  f"{timed['warm']:.2f} s | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
