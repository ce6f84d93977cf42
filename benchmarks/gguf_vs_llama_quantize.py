"""quantdask's GGUF quantization against llama.cpp's own ``llama-quantize``, tensor by tensor.

    .venv/bin/python -m benchmarks.gguf_vs_llama_quantize [--tools DIR] [--sdist FILE]

Builds ``llama-quantize`` from the pinned llama-cpp-python sdist's llama.cpp (the same source as
the bindings; CMake, portable flags, about 5 minutes on 2 cores) into ``--tools`` unless it is
there, makes a tiny Llama-2-style model (widths 256/512) and one with outlier input columns,
converts each to F32 with llama.cpp's converter, and quantizes each to Q8_0, Q6_K, Q4_K_M,
Q3_K_M and Q2_K both ways (and with an importance matrix: quantdask's, handed to the tool as a
GGUF imatrix file with counts of 1, so the tool's sum / count is the same float; IQ2_XS too).
Prints, per type, whether every tensor (name, type, shape, bytes) is identical.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from quantdask.gguf.source import LLAMA_CPP_PYTHON, gguf_module

FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF",
         "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
         "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_OPENMP=OFF"]
TYPES = ("Q8_0", "Q6_K", "Q4_K_M", "Q3_K_M", "Q2_K")


def build_tools(tools: Path, sdist: str | None,
                targets: tuple[str, ...] = ("llama-quantize",)) -> Path:
    """``targets`` built from the pinned source into ``tools`` (unless there); the first's
    path."""
    binary = tools / "bin" / targets[0]
    if all((tools / "bin" / target).is_file() for target in targets):
        return binary
    scratch = Path(tempfile.mkdtemp(prefix="quantdask-llama-cpp-src-"))
    if sdist is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d",
                        str(scratch)], check=True)
        sdist = str(next(scratch.glob("llama_cpp_python-*.tar.gz")))
    with tarfile.open(sdist) as archive:
        archive.extractall(scratch, filter="data")
    source = scratch / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    subprocess.run(["cmake", "-S", str(source), "-B", str(tools), *FLAGS], check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", str(tools), "-j2", "--target", *targets],
                   check=True, capture_output=True)
    return binary


def tensors(path: Path) -> list[tuple]:
    reader = gguf_module().GGUFReader(str(path))
    return [(t.name, t.tensor_type.name, tuple(int(n) for n in t.shape),
             np.asarray(t.data).view(np.uint8).tobytes()) for t in reader.tensors]


def write_imatrix(entries: dict[str, np.ndarray], path: Path) -> None:
    """``entries`` (means of squared inputs) as llama.cpp's imatrix GGUF, counts 1."""
    gguf = gguf_module()
    writer = gguf.GGUFWriter(str(path), arch="imatrix")
    writer.add_string("general.type", "imatrix")
    writer.add_array("imatrix.datasets", ["quantdask"])
    writer.add_uint32("imatrix.chunk_count", 1)
    writer.add_uint32("imatrix.chunk_size", 1)
    for name, mean in entries.items():
        writer.add_tensor(f"{name}.in_sum2", np.asarray(mean, np.float32).reshape(1, -1))
        writer.add_tensor(f"{name}.counts", np.ones((1, 1), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def compare(tool: Path, f32: Path, out: Path, imatrix: dict | None) -> None:
    from quantdask.gguf.quantize import quantize_gguf

    extra = []
    if imatrix:
        write_imatrix(imatrix, out / "imatrix.gguf")
        extra = ["--imatrix", str(out / "imatrix.gguf")]
    for name in TYPES + (("IQ2_XS",) if imatrix else ()):
        ours = quantize_gguf(f32, out / f"ours-{name}.gguf", name, threads=2, imatrix=imatrix)
        theirs = out / f"tool-{name}.gguf"
        subprocess.run([str(tool), *extra, str(f32), str(theirs), name, "2"], check=True,
                       capture_output=True)
        a, b = tensors(ours), tensors(theirs)
        differ = [x[0] for x, y in zip(a, b) if x != y]
        verdict = "identical" if len(a) == len(b) and not differ else f"differ: {differ[:4]}"
        print(f"  {name:8s} {'imatrix' if imatrix else '       '} {len(a)} tensors {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default="build/llama.cpp-tools")
    parser.add_argument("--sdist")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from quantdask.gguf.convert import convert
    from quantdask.gguf.imatrix import importance
    from tests.gguf_models import llama2_style_model

    tool = build_tools(Path(args.tools), args.sdist)
    with tempfile.TemporaryDirectory(prefix="quantdask-gguf-bench-") as scratch:
        folder = llama2_style_model(Path(scratch) / "model")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            for layer in model.model.layers:  # outlier input columns
                layer.input_layernorm.weight[:8] *= 20
                layer.post_attention_layernorm.weight[:8] *= 20
        model.save_pretrained(folder)
        f32 = convert(folder, Path(scratch) / "f32.gguf")
        torch.manual_seed(0)
        found = importance(model, torch.randint(3, 500, (8, 128)), "llama", 4)
        print(f"llama-quantize at {tool}")
        compare(tool, f32, Path(scratch), None)
        compare(tool, f32, Path(scratch), found)


if __name__ == "__main__":
    main()
