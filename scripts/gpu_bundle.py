"""Build the carry for the lent GPU machine: what its python3 lacks, as one archive.

    python scripts/gpu_bundle.py [--wheels DIR] [--out .gpu-bundle]      (or: make gpu-bundle)

The lent machine (the device tool's KINDS.md) runs Python 3.12 with a CUDA 13 torch,
transformers, accelerate, cuda-core, cuda-bindings, nvidia-ml-py, rich, psutil and pytest, and
it has no network. This script downloads cp312 manylinux wheels of exactly what it lacks
(``BUNDLE``, pinned), installs them into one folder (``pip --target``, no dependencies), keeps
only the bitsandbytes libraries a CUDA 13 torch loads, leaves out bytecode, torchao's top-level
``test`` package and whatever differs from build to build (``LEFT_OUT``, ``UNSTABLE_METADATA``),
and packs that folder as ``.gpu-bundle/site.tar.xz`` (an ignored folder) with one mtime, no
owner and sorted entries: the same pins give the same archive bytes, so the lock's digest
changes only when the pins (or this script) do. ``scripts/gpu_smoke.sh`` unpacks it there and
puts it on ``PYTHONPATH``. It also writes ``scripts/gpu_bundle.lock.json``: each package's
version, wheel, sha256 and requirements, and the archive's size, which the tests check offline
(every requirement is bundled or on the machine, nothing extra, the size fits one call).

``--wheels DIR`` takes the wheels from DIR instead of downloading them (they must be the pins).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "scripts" / "gpu_bundle.lock.json"
CALL_LIMIT_MIB = 64  # what one device call carries: the tree and the carried paths
TARGET_MIB = 55  # the bundle and the tree together: room left for the run's own files

LENT_PYTHON = "3.12"
LENT_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax
e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist
fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo
pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov
pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
"""The lent machine's packages (KINDS.md, as read on a machine running its image, 2026-11-17)."""

LENT_VERSIONS = {"torch": "2.11.0", "transformers": "5.17.0", "accelerate": "1.15.0",
                 "numpy": "2.5.2", "safetensors": "0.8.0", "tokenizers": "0.23.2",
                 "huggingface-hub": "1.33.0", "triton": "3.6.0"}
"""Versions of some of them (KINDS.md's pip list), checked against the requirements."""

BUNDLE = {
    "dask": "2026.7.1", "distributed": "2026.7.1", "dask-cuda": "26.10.0",
    "rapids-dask-dependency": "26.10.0", "partd": "1.4.2", "locket": "1.0.0",
    "tblib": "3.2.2", "tornado": "6.6.1", "zict": "3.0.0",
    "polars": "2.1.0", "polars-runtime-32": "2.1.0",
    "bitsandbytes": "0.50.2", "torchao": "0.18.0",
    # Task accuracy (the tasks extra): lm-eval and what it needs that the machine lacks.
    "lm-eval": "0.4.13", "datasets": "5.2.0", "evaluate": "0.4.6", "dill": "0.4.1",
    "multiprocess": "0.70.19", "more-itertools": "11.2.1", "pytablewriter": "1.2.1",
    "dataproperty": "1.1.1", "mbstrdecoder": "1.1.5", "pathvalidate": "3.3.1",
    "tabledata": "1.3.5", "tcolorpy": "0.1.7", "typepy": "1.3.5", "chardet": "6.0.0.post1",
    "pytz": "2026.6",
    # The autoround extra: auto-round and pydantic.
    "auto-round": "0.16.1", "pydantic": "2.14.4", "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0", "typing-inspection": "0.4.5",
}
"""What the bundle carries, pinned: the versions the tests run against here (dask-cuda, which
needs a GPU, at the pyproject's 26.10). On ``PYTHONPATH`` a ``.pth`` file is not run:
rapids-dask-dependency's installs an import hook whose dask and distributed patches are empty
in 26.10, so nothing is lost. lm-eval's task path imports datasets, dill and multiprocess
(its wheel is made for Python 3.12 alone: ``build`` installs for the lent machine's python);
evaluate and pytablewriter (with the six below it, chardet and pytz among them) are required
by its metadata and imported only by its Hugging Face metrics and its results table: carried
all the same (half a MiB packed)."""

NOT_CARRIED = {
    "bokeh": "the Dask dashboard's pages only (distributed runs without it)",
    "altair": "the report, written here from the run directory that comes back",
    "vl-convert-python": "the report", "nbformat": "the report", "nbclient": "the report",
    "nbconvert": "the report", "ipykernel": "the report", "jupyterlab": "the report",
    "ipywidgets": "a notebook's live progress widget", "great-tables": "the report",
    # lm-eval's, published as source only (no wheel to pin), imported only where a sweep on
    # the lent machine cannot go: built-in tasks, whose data it cannot download there.
    "rouge-score": "lm-eval's built-in tasks' ROUGE metric (and nltk under it); source only",
    "word2number": "lm-eval's built-in math tasks; source only",
    "sqlitedict": "lm-eval's request cache (use_cache), which quantdask does not set; "
                  "source only",
}
"""Requirements the smoke run does without, and why."""

EXTRAS = ("gpu-cu13", "torchao", "tasks", "datasets", "autoround", "search")
"""quantdask's extras (pyproject.toml) on the smoke path: a GPU sweep there can quantize with
torchao and auto-round, score lm-eval tasks, read eval text from local datasets and solve a
search's allocation exactly (scipy is the machine's own)."""

NOT_WALKED = {
    "gpu": "other CUDA bindings (the machine's torch is CUDA 13: gpu-cu13)",
    "gpu-cu12": "CUDA 12 bindings (the machine's torch is CUDA 13: gpu-cu13)",
    "hqq": "hqq is published as source only: no wheel to pin",
    "gptq": "gptqmodel 7.6.0 is published as source only, and so are five of its requirements "
            "(pypcre, compiled against PCRE2, device-smi, tokenicer, logbar, defuser): no wheel "
            "to pin, and a pypcre built here for 3.12 would link this machine's glibc, newer "
            "than the lent machine's; it also pins numpy==2.2.6 below the machine's 2.5.2",
    "slurm": "dask-jobqueue submits to SLURM, which the lent machine has none of",
    "mlflow": "an export, run here from the run directory that comes back",
    "gguf": "llama-cpp-python is published as source only: no wheel to pin, and a build here "
            "(CPU flags) would not be the lent machine's CUDA build",
    "compare": "a comparison of run directories, run here on the ones that come back (its "
               "scipy is the machine's own anyway)",
    "test": "the test tools the machine lacks are not needed by the smoke (pytest is there)",
}
"""quantdask's other extras, each with why the bundle does not carry it: a GPU sweep there
that needs one is refused before it runs, with the install command, like anywhere else."""

KEEP_LIBRARIES = {"bitsandbytes": ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so")}
"""Of a package's native libraries (``lib*.so`` in its top folder), the ones a CUDA 13 torch
loads; the rest (other CUDA versions, ROCm, XPU: 120 MB unpacked) are left out."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64")


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def roots() -> list[str]:
    """quantdask's own requirements on the smoke path: its dependencies and its ``EXTRAS``
    (pyproject.toml), less what the smoke run does without."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *(r for extra in EXTRAS for r in extras[extra])]
    return [r for r in wanted if canonical(_requirement(r).name) not in NOT_CARRIED]


def _requirement(text: str):
    from packaging.requirements import Requirement

    return Requirement(text)


def _lent_environment(extra: str) -> dict[str, str]:
    from packaging.markers import default_environment

    return {**default_environment(), "python_version": LENT_PYTHON,
            "python_full_version": LENT_PYTHON + ".3", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "extra": extra}


def _applies(requirement, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate(_lent_environment(e)) for e in {"", *extras})


def check_closure(packages: dict[str, dict], top: list[str]) -> list[str]:
    """What is wrong with a bundle of ``packages`` (name -> {"version", "requires"}) for the
    requirements ``top``: a requirement that is neither bundled (at a version it accepts) nor
    on the lent machine, and a bundled package that nothing requires. Empty when it is right."""
    from packaging.version import Version

    problems: list[str] = []
    seen: set[tuple[str, tuple]] = set()  # (package, extras) walked already

    def need(text: str, wanted_by: str, extras: set[str]) -> None:
        req = _requirement(text)
        if not _applies(req, extras):
            return
        name = canonical(req.name)
        if name in packages:
            version = packages[name]["version"]
            if not req.specifier.contains(Version(version), prereleases=True):
                problems.append(f"{wanted_by} needs {text}; the bundle pins {name} {version}")
            if (name, tuple(sorted(req.extras))) in seen:
                return
            seen.add((name, tuple(sorted(req.extras))))
            for inner in packages[name]["requires"]:
                need(inner, name, set(req.extras))
        elif name in LENT_PACKAGES:
            version = LENT_VERSIONS.get(name)
            if version and not req.specifier.contains(Version(version), prereleases=True):
                problems.append(f"{wanted_by} needs {text}; the lent machine has {version}")
        elif name not in NOT_CARRIED:
            problems.append(f"{wanted_by} needs {text}: neither bundled nor on the lent "
                            f"machine; add it to BUNDLE in scripts/gpu_bundle.py")

    for text in top:
        need(text, "quantdask", set())
    problems += [f"{name} is bundled but nothing on the smoke path needs it; remove it from "
                 "BUNDLE" for name in sorted(set(packages) - {name for name, _ in seen})]
    return problems


def wheel_metadata(wheel: Path) -> tuple[str, str, list[str]]:
    """A wheel's distribution name, version and requirements (``Requires-Dist``)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode()
    fields = [line.split(": ", 1) for line in text.split("\n\n", 1)[0].splitlines()
              if ": " in line]
    get = {k: v for k, v in fields if k in ("Name", "Version")}
    return (canonical(get["Name"]), get["Version"],
            [v for k, v in fields if k == "Requires-Dist"])


def download(pins: dict[str, str], dest: Path) -> None:
    """cp312 manylinux wheels of ``pins``, no dependencies (each is pinned itself)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "--python-version", LENT_PYTHON,
                    "--implementation", "cp", *platforms, "-d", str(dest),
                    *(f"{name}=={version}" for name, version in pins.items())], check=True)


def pinned_wheels(wheels: Path, pins: dict[str, str]) -> dict[str, Path]:
    """The wheel of each pin in ``wheels``; an error names any that is missing or another
    version."""
    found = {}
    for wheel in sorted(wheels.glob("*.whl")):
        name, version, _ = wheel_metadata(wheel)
        if pins.get(name) == version:
            found[name] = wheel
    missing = [f"{n}=={v}" for n, v in pins.items() if n not in found]
    if missing:
        raise SystemExit(f"gpu_bundle: no wheel in {wheels} for {', '.join(missing)}; "
                         "run without --wheels to download them")
    return found


LEFT_OUT = {
    "test": "torchao's own tests, installed as a top-level package: on PYTHONPATH it would "
            "shadow the standard library's test package",
    "shared-actions": "dask-cuda's CI scripts (not a package)",
    "bin": "console scripts whose first line names the python that built the bundle",
}
"""Top-level entries of the installed folder that the bundle leaves out, and why."""

UNSTABLE_METADATA = ("direct_url.json",)
"""Files in each ``*.dist-info`` that differ from build to build (``direct_url.json`` names the
path of the wheel installed); left out, with their lines in ``RECORD``."""

EPOCH = 315532800
"""The one mtime every archive entry gets (1980-01-01T00:00:00Z, the earliest a zip can hold),
unless ``SOURCE_DATE_EPOCH`` sets another: the same pins give the same archive bytes."""


def prune(site: Path, keep: dict[str, tuple[str, ...]]) -> list[str]:
    """Remove what would make the archive differ between builds or harm the lent machine:
    compiled caches (``__pycache__``, ``*.pyc``), ``LEFT_OUT``'s top-level entries and each
    dist-info's ``UNSTABLE_METADATA``, whose lines ``RECORD`` then loses too; and of each
    ``keep`` package the native libraries it does not name. Returns the libraries kept."""
    for cache in sorted(site.rglob("__pycache__")):
        shutil.rmtree(cache)
    for compiled in [*site.rglob("*.pyc"), *site.rglob("*.pyo")]:
        compiled.unlink()
    for name in LEFT_OUT:
        entry = site / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.exists() or entry.is_symlink():
            entry.unlink()
    for info in site.glob("*.dist-info"):
        for name in UNSTABLE_METADATA:
            (info / name).unlink(missing_ok=True)
    kept = []
    for package, names in keep.items():
        for library in sorted((site / package).glob("lib*.so")):
            if library.name in names:
                kept.append(f"{package}/{library.name}")
            else:
                library.unlink()
    for record in site.glob("*.dist-info/RECORD"):
        _record_only_what_is_there(record, site)
    return kept


def _record_only_what_is_there(record: Path, site: Path) -> None:
    """Drop from a ``RECORD`` the lines of files the bundle does not hold (pruned, or outside
    the folder: ``../../bin/...``), so that it lists what is there."""
    lines = record.read_text(encoding="utf-8").splitlines(keepends=True)
    root = site.resolve()

    def there(line: str) -> bool:
        path = next(csv.reader([line]), [""])[0]
        if not path:
            return False
        target = (site / path).resolve()
        return target.is_relative_to(root) and target.is_file()

    record.write_text("".join(line for line in lines if there(line)), encoding="utf-8")


def _normalized(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """An archive entry without what differs between builds and builders: one mtime, root's
    ids and no names, modes from the executable bit alone (not the umask)."""
    info.mtime = int(os.environ.get("SOURCE_DATE_EPOCH", EPOCH))
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    executable = info.isdir() or info.mode & 0o111
    info.mode = 0o755 if executable else 0o644
    return info


def pack(site: Path, archive: Path) -> None:
    """``site`` as one xz tarball (Python's lzma, so the lent machine unpacks it with
    tarfile alone), the same bytes for the same files: entries in path order, normalized
    (``_normalized``)."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_suffix(".partial")
    entries = sorted(site.rglob("*"), key=lambda p: p.relative_to(site).as_posix())
    with lzma.open(partial, "wb", preset=6) as xz, \
            tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in entries:
            tar.add(path, arcname=path.relative_to(site).as_posix(), recursive=False,
                    filter=_normalized)
    os.replace(partial, archive)


def tree_bytes(repo: Path = REPO) -> int:
    """Bytes of the working tree a device call sends: tracked files and untracked ones git does
    not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout
    return sum((repo / p).stat().st_size for p in listed.split("\0") if p and
               (repo / p).is_file())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def build(wheels: Path, out: Path, pins: dict[str, str] = BUNDLE, top: list[str] | None = None,
          keep: dict[str, tuple[str, ...]] = KEEP_LIBRARIES) -> dict:
    """Install the pinned ``wheels`` into one folder, prune it and pack it as
    ``out/site.tar.xz``; returns the lock (what ``LOCK`` holds). Refuses a bundle that
    ``check_closure`` finds wrong, before installing anything."""
    chosen = pinned_wheels(wheels, pins)
    packages = {}
    for name, wheel in chosen.items():
        _, version, requires = wheel_metadata(wheel)
        packages[name] = {"version": version, "wheel": wheel.name, "sha256": sha256(wheel),
                          "requires": requires}
    problems = check_closure(packages, roots() if top is None else top)
    if problems:
        raise SystemExit("gpu_bundle: the bundle is not right for the lent machine:\n  "
                         + "\n  ".join(problems))
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        # Installed as for the lent machine's CPython 3.12, whatever python builds it: a wheel
        # may be made for 3.12 alone (multiprocess ships one copy of multiprocessing per
        # Python version, tagged py312), which pip refuses for another interpreter.
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                        "--no-deps", "--no-compile", "--python-version", LENT_PYTHON,
                        "--implementation", "cp", *platforms, "--target", str(site),
                        *map(str, chosen.values())], check=True)
        libraries = prune(site, keep)
        unpacked = sum(p.stat().st_size for p in site.rglob("*") if p.is_file())
        top_level = sorted(p.name for p in site.iterdir())
        archive = out / "site.tar.xz"
        pack(site, archive)
    return {"python": LENT_PYTHON, "packages": dict(sorted(packages.items())),
            "libraries_kept": libraries, "top_level": top_level,
            "archive": {"name": archive.name, "bytes": archive.stat().st_size,
                        "sha256": sha256(archive), "unpacked_bytes": unpacked}}


def drift(pins: dict[str, str], installed: dict[str, str] | None = None) -> list[str]:
    """Pins that differ from the versions installed here (what the tests run against):
    ``installed`` (default: this environment's)."""
    import importlib.metadata

    if installed is None:
        installed = {}
        for name in pins:
            try:
                installed[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue  # dask-cuda: GPU machines only
    return [f"{name}: bundle {version}, here {installed[name]}"
            for name, version in pins.items() if name in installed and installed[name] != version]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="take the pinned wheels from this folder")
    parser.add_argument("--out", type=Path, default=REPO / ".gpu-bundle")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheels = args.wheels
        if wheels is None:
            wheels = Path(tmp)
            download(BUNDLE, wheels)
        lock = build(wheels, args.out)
    LOCK.write_text(json.dumps(lock, indent=1) + "\n")
    bundle, tree = lock["archive"]["bytes"], tree_bytes()
    print(f"gpu_bundle: {args.out / lock['archive']['name']}: {bundle / 2**20:.1f} MiB "
          f"({lock['archive']['unpacked_bytes'] / 2**20:.0f} MiB unpacked, "
          f"{len(lock['packages'])} packages); with the tree ({tree / 2**20:.1f} MiB): "
          f"{(bundle + tree) / 2**20:.1f} MiB of the {CALL_LIMIT_MIB} MiB a call carries "
          f"(target {TARGET_MIB})")
    print(f"gpu_bundle: lock written to {LOCK.relative_to(REPO)}")
    for line in drift(BUNDLE):
        print(f"gpu_bundle: the tests here run another version: {line}; update BUNDLE")
    return 0 if bundle + tree <= TARGET_MIB * 2**20 else 1


if __name__ == "__main__":
    sys.exit(main())
