"""What a process runs on: quantdask's version and commit, Python, each library a backend or a
measurement may use, CUDA, the GPU driver, the GPU and CPU models and the OS.

A run records it for the driver and for every worker each time a session starts or resumes (a
run directory can be resumed after an upgrade; workers may differ), as the environment frame;
``quantdask compare`` lists what differs between two runs before anything else.

>>> env = capture_environment()
>>> env["python"].count(".") >= 2 and "os" in env
True
"""

from __future__ import annotations

import functools
import platform
import subprocess
from importlib import metadata
from pathlib import Path

NOT_INSTALLED = "not installed"
"""A library's value where it is absent (so an install or removal shows as a difference)."""

LIBRARIES = (
    "torch", "transformers", "accelerate", "bitsandbytes", "torchao", "hqq", "auto-round",
    "gptqmodel", "optimum", "lm-eval", "llama-cpp-python", "gguf", "numpy", "dask",
    "distributed", "dask-cuda", "polars",
)
"""The distributions whose versions change quantdask's numbers: the backends' quantization
libraries and runtimes, the model and measurement stack, and the cluster's."""


def capture_environment() -> dict[str, str]:
    """This process's environment, one value per component (``component -> value``)."""
    env = {"quantdask": _version("quantdask"), "quantdask_commit": _commit(),
           "python": platform.python_version(), "os": platform.platform(),
           "cpu": _cpu_model()}
    env.update({library: _version(library) for library in LIBRARIES})
    env["llama.cpp"] = _llama_cpp_build()
    env.update(_cuda())
    return env


@functools.cache
def _llama_cpp_build() -> str:
    """The llama.cpp build GGUF jobs run in: ggml's version and commit and the CPU features
    it was compiled with, read from llama-cpp-python's own libraries (not imported: nothing
    of it runs in a process that never measures a GGUF)."""
    import ctypes
    import importlib.util

    found = importlib.util.find_spec("llama_cpp")
    if found is None or not found.submodule_search_locations:
        return NOT_INSTALLED
    lib = Path(next(iter(found.submodule_search_locations))) / "lib"
    try:
        ggml = ctypes.CDLL(str(lib / "libggml-base.so"))
        llama = ctypes.CDLL(str(lib / "libllama.so"))
    except OSError as error:
        return f"unknown ({error})"
    for function in (ggml.ggml_version, ggml.ggml_commit, llama.llama_print_system_info):
        function.restype = ctypes.c_char_p
    features = " ".join(part.split("=")[0].strip().split(" : ")[-1] for part in
                        llama.llama_print_system_info().decode().split("|")
                        if part.strip().endswith("= 1"))
    return (f"ggml {ggml.ggml_version().decode()} ({ggml.ggml_commit().decode()}); "
            f"{features}")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:  # (quantdask itself: a checkout not installed)
        return NOT_INSTALLED


@functools.cache
def _commit() -> str:
    """The git commit quantdask's source comes from (``+dirty`` with uncommitted changes), or
    why there is none (an installed wheel has no checkout beside it)."""
    source = Path(__file__).resolve().parents[2]
    if not (source / ".git").exists():
        return "unknown (not a git checkout)"
    try:
        head = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain",
                                "--untracked-files=no", "--", "quantdask"],
                               check=True, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (git failed)"
    return head + ("+dirty" if dirty.strip() else "")


@functools.cache
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cuda() -> dict[str, str]:
    """CUDA's version torch was built with, the driver's, and the visible GPUs' models."""
    import torch

    cuda = torch.version.cuda or "none (a CPU build of torch)"
    gpus = "no GPU visible"
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpus = ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
    return {"cuda": cuda, "gpu_driver": _driver(), "gpu": gpus}


def _driver() -> str:
    try:
        import pynvml
    except ImportError:
        return "unknown (no NVML binding)"
    try:
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 (no driver, no GPU: NVML raises its own errors)
        return "none (NVML finds no driver)"
    return version.decode() if isinstance(version, bytes) else str(version)
