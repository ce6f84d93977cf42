"""The carry for the lent GPU machine (scripts/gpu_bundle.py): what it holds, checked offline
against its lock, and the build itself run on wheels made here."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import gpu_bundle  # noqa: E402

pytestmark = pytest.mark.timeout(120)
LOCK = json.loads(gpu_bundle.LOCK.read_text())


def test_the_lock_holds_exactly_the_pins():
    assert {n: p["version"] for n, p in LOCK["packages"].items()} == gpu_bundle.BUNDLE
    assert LOCK["python"] == "3.12"
    for name, package in LOCK["packages"].items():
        wheel = package["wheel"]
        assert wheel.startswith(name.replace("-", "_") + "-" + package["version"] + "-")
        # Wheels the lent machine's CPython 3.12 on x86-64 takes (multiprocess's: py312).
        tags = wheel.removesuffix(".whl").split("-")[-3:]
        assert tags[0] in ("py3", "py2.py3", "py312") or tags[0] in ("cp310", "cp311", "cp312")
        assert tags[2] == "any" or "x86_64" in tags[2]


def test_every_requirement_is_bundled_or_on_the_lent_machine_and_nothing_more():
    assert gpu_bundle.check_closure(LOCK["packages"], gpu_bundle.roots()) == []
    # What the smoke path needs beyond the machine, by name (the closure found these).
    assert {"dask-cuda", "rapids-dask-dependency", "polars-runtime-32", "tornado", "zict",
            "partd", "locket", "tblib"} <= set(LOCK["packages"])
    # The tasks extra: lm-eval, and what it needs that the machine lacks (datasets, evaluate,
    # dill, multiprocess; sacrebleu, scikit-learn, pyarrow and jinja2 are the machine's).
    assert {"lm-eval", "datasets", "evaluate", "dill", "multiprocess", "pytablewriter",
            "auto-round", "pydantic"} <= set(LOCK["packages"])
    assert not {"sacrebleu", "scikit-learn", "pyarrow", "jinja2", "peft"} & set(LOCK["packages"])
    assert {"tasks", "autoround", "datasets"} <= set(gpu_bundle.EXTRAS)
    # lm-eval's requirements published as source only: left out, each with its reason.
    assert {"rouge-score", "sqlitedict", "word2number"} <= set(gpu_bundle.NOT_CARRIED)


def test_every_extra_is_carried_or_left_out_with_its_reason():
    import tomllib

    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"])
    assert set(gpu_bundle.EXTRAS) | set(gpu_bundle.NOT_WALKED) == extras
    assert not set(gpu_bundle.EXTRAS) & set(gpu_bundle.NOT_WALKED)
    assert all(len(reason) > 20 for reason in gpu_bundle.NOT_WALKED.values())
    # gptq's requirements published as source only: the bundle carries wheels alone.
    assert "source only" in gpu_bundle.NOT_WALKED["gptq"]


def test_the_bundle_and_the_tree_fit_one_device_call():
    bundle, tree = LOCK["archive"]["bytes"], gpu_bundle.tree_bytes()
    # the tree travels with it: no stray data files (8.4 MB: two tiny models, 5.4 MB of them,
    # and the demo's eval and calibration texts)
    assert tree < 9 * 2**20
    assert bundle + tree <= gpu_bundle.TARGET_MIB * 2**20 < gpu_bundle.CALL_LIMIT_MIB * 2**20
    # bitsandbytes' 15 native libraries (CUDA 11.8 to 13.2, ROCm, XPU) down to two.
    assert LOCK["libraries_kept"] == ["bitsandbytes/libbitsandbytes_cpu.so",
                                      "bitsandbytes/libbitsandbytes_cuda130.so"]
    top = set(LOCK["top_level"])
    assert {"dask", "distributed", "dask_cuda", "rapids_dask_dependency", "polars",
            "_polars_runtime_32", "bitsandbytes", "torchao", "tornado", "zict", "lm_eval",
            "datasets", "multiprocess", "auto_round"} <= top
    assert not {"torch", "numpy", "transformers", "quantdask"} & top  # the machine's, the tree's
    # torchao's top-level test/ would shadow the standard library's on PYTHONPATH; bin/ names
    # the builder's python.
    assert not {"test", "bin", "shared-actions"} & top


def test_the_pins_match_what_quantdask_pins_exactly_and_the_drift_is_reported():
    # dask and distributed are pinned by quantdask itself (dask-cuda 26.10's rapids pin): the
    # bundle must carry exactly those. The others follow ranges; a release newer than the
    # bundle's pin is reported by the build, not failed here (CI would turn red on a release).
    exact = {gpu_bundle.canonical(r.name): str(r.specifier).removeprefix("==")
             for r in map(gpu_bundle._requirement, gpu_bundle.roots())
             if str(r.specifier).startswith("==") and "*" not in str(r.specifier)}
    assert exact == {"dask": "2026.7.1", "distributed": "2026.7.1", "lm-eval": "0.4.13"}
    assert {n: gpu_bundle.BUNDLE[n] for n in exact} == exact
    drift = gpu_bundle.drift({"polars": "2.1.0", "dask": "2026.7.1", "absent": "1.0"},
                             installed={"polars": "2.2.0", "dask": "2026.7.1"})
    assert drift == ["polars: bundle 2.1.0, here 2.2.0"]


def test_a_requirement_neither_bundled_nor_there_is_named_with_the_fix():
    packages = {"dask": {"version": "2026.7.1", "requires": ["toolz", "nothere>=1"]},
                "zict": {"version": "3.0.0", "requires": []},
                "tornado": {"version": "6.6.1", "requires": []}}
    problems = gpu_bundle.check_closure(packages, ["dask>=2026", "tornado>=7", "torch>=2.12"])
    assert problems == [
        "dask needs nothere>=1: neither bundled nor on the lent machine; add it to BUNDLE in "
        "scripts/gpu_bundle.py",
        "quantdask needs tornado>=7; the bundle pins tornado 6.6.1",
        "quantdask needs torch>=2.12; the lent machine has 2.11.0",
        "zict is bundled but nothing on the smoke path needs it; remove it from BUNDLE",
    ]


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes],
               requires: tuple[str, ...] = ()) -> Path:
    """A minimal valid wheel of ``name`` holding ``files``."""
    dist = f"{name}-{version}.dist-info"
    metadata = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                          *(f"Requires-Dist: {r}" for r in requires)]) + "\n"
    content = {**files, f"{dist}/METADATA": metadata.encode(),
               f"{dist}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},,\n" for path in [*content, f"{dist}/RECORD"])
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in {**content, f"{dist}/RECORD": record.encode()}.items():
            archive.writestr(path, data)
    return wheel


@pytest.mark.timeout(180)
def test_the_build_installs_prunes_packs_and_locks_from_local_wheels(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    libraries = {f"bitsandbytes/libbitsandbytes_{k}.so": b"\x7fELF" + k.encode() * 64
                 for k in ("cpu", "cuda118", "cuda130", "rocm72")}
    make_wheel(wheels, "bitsandbytes", "0.50.2",
               {"bitsandbytes/__init__.py": b"VERSION = '0.50.2'\n", **libraries},
               requires=("torch<3,>=2.4", "numpy>=1.17", "pytest~=8.3; extra == \"test\""))
    make_wheel(wheels, "bitsandbytes", "0.49.0", {"bitsandbytes/__init__.py": b""})  # not pinned
    lock = gpu_bundle.build(wheels, tmp_path / "out", pins={"bitsandbytes": "0.50.2"},
                            top=["bitsandbytes>=0.48"])
    assert lock["packages"]["bitsandbytes"]["version"] == "0.50.2"
    assert lock["libraries_kept"] == ["bitsandbytes/libbitsandbytes_cpu.so",
                                      "bitsandbytes/libbitsandbytes_cuda130.so"]
    archive = tmp_path / "out" / "site.tar.xz"
    assert lock["archive"]["bytes"] == archive.stat().st_size
    assert lock["archive"]["sha256"] == gpu_bundle.sha256(archive)
    with tarfile.open(archive) as packed:
        names = set(packed.getnames())
        packed.extractall(tmp_path / "site", filter="data")
    assert {"bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda130.so",
            "bitsandbytes/__init__.py"} <= names
    assert not any("cuda118" in n or "rocm" in n or "__pycache__" in n for n in names)
    assert lock["top_level"] == sorted({n.split("/")[0] for n in names})
    # What gpu_smoke.sh does with it there: that folder first on the path.
    run = subprocess.run([sys.executable, "-c", "import bitsandbytes; print(bitsandbytes.VERSION,"
                          " bitsandbytes.__file__)"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path / "site")}, timeout=60)
    assert run.stdout.split()[0] == "0.50.2" and str(tmp_path / "site") in run.stdout

    with pytest.raises(SystemExit, match=r"no wheel in .* for bitsandbytes==0\.51\.0"):
        gpu_bundle.build(wheels, tmp_path / "again", pins={"bitsandbytes": "0.51.0"}, top=[])
    with pytest.raises(SystemExit, match="quantdask needs bitsandbytes>=0.51"):
        gpu_bundle.build(wheels, tmp_path / "again", pins={"bitsandbytes": "0.50.2"},
                         top=["bitsandbytes>=0.51"])
    assert not (tmp_path / "again").exists()  # refused before anything was written


@pytest.mark.timeout(120)
def test_a_wheel_made_for_python_3_12_alone_is_bundled_whatever_python_builds(tmp_path):
    # multiprocess (datasets' and lm-eval's) publishes one wheel per Python version: the lent
    # machine's is tagged py312, which pip refused when it installed for the building python.
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    made = make_wheel(wheels, "multiprocess", "0.70.19", {"multiprocess/__init__.py": b"V = 3\n"})
    made.rename(wheels / "multiprocess-0.70.19-py312-none-any.whl")
    lock = gpu_bundle.build(wheels, tmp_path / "out", pins={"multiprocess": "0.70.19"},
                            top=["multiprocess"])
    assert lock["packages"]["multiprocess"]["wheel"] == "multiprocess-0.70.19-py312-none-any.whl"
    with tarfile.open(tmp_path / "out" / "site.tar.xz") as packed:
        assert "multiprocess/__init__.py" in packed.getnames()


@pytest.mark.timeout(180)
def test_two_builds_of_the_same_pins_give_the_same_archive_bytes(tmp_path):
    # What differed between two builds: each file's mtime (pip writes them at install time),
    # the builder's uid/gid and names, modes from the umask, and each dist-info's
    # direct_url.json (the path of the wheel), with its line and size in RECORD; the console
    # scripts in bin/ name the python that built them. torchao's top-level test/ package would
    # shadow the standard library's on PYTHONPATH.
    import os
    import shutil
    import time

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    dist = "bitsandbytes-0.50.2.dist-info"
    make_wheel(wheels, "bitsandbytes", "0.50.2", {
        "bitsandbytes/__init__.py": b"VERSION = '0.50.2'\ndef main():\n    pass\n",
        "bitsandbytes/libbitsandbytes_cpu.so": b"\x7fELF cpu",
        "bitsandbytes/libbitsandbytes_cuda118.so": b"\x7fELF cuda118",
        "bitsandbytes/__pycache__/__init__.cpython-312.pyc": b"\x00stale bytecode",
        "bitsandbytes/stray.pyc": b"\x00more bytecode",
        "test/__init__.py": b"", "test/test_it.py": b"def test(): pass\n",
        f"{dist}/entry_points.txt": b"[console_scripts]\nbnb-check = bitsandbytes:main\n"})
    make_wheel(wheels, "locket", "1.0.0", {"locket/__init__.py": b"LOCK = 1\n"})
    elsewhere = tmp_path / "another-folder-with-a-longer-name" / "wheels"
    shutil.copytree(wheels, elsewhere)
    pins = {"bitsandbytes": "0.50.2", "locket": "1.0.0"}
    keep = {"bitsandbytes": ("libbitsandbytes_cpu.so",)}
    first = gpu_bundle.build(wheels, tmp_path / "one", pins=pins, top=list(pins), keep=keep)
    time.sleep(1.1)  # the next second: pip's mtimes differ
    umask = os.umask(0o077)  # and the modes pip gives
    try:
        second = gpu_bundle.build(elsewhere, tmp_path / "two", pins=pins, top=list(pins),
                                  keep=keep)
    finally:
        os.umask(umask)
    one, two = (tmp_path / d / "site.tar.xz" for d in ("one", "two"))
    assert one.read_bytes() == two.read_bytes()
    assert first["archive"] == second["archive"]
    with tarfile.open(one) as packed:
        members = packed.getmembers()
        record = packed.extractfile(f"{dist}/RECORD").read().decode()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == \
        {(gpu_bundle.EPOCH, 0, 0, "", "")}
    assert {m.mode for m in members if m.isfile()} == {0o644}
    assert {m.mode for m in members if m.isdir()} == {0o755}
    assert not [n for n in names if n.endswith(".pyc") or "__pycache__" in n
                or n.split("/")[0] in ("test", "bin") or n.endswith("direct_url.json")]
    assert first["top_level"] == sorted({n.split("/")[0] for n in names})
    # RECORD lists what the bundle holds, nothing it left out.
    listed = {line.split(",")[0] for line in record.splitlines()}
    assert "bitsandbytes/__init__.py" in listed and f"{dist}/RECORD" in listed
    assert listed <= set(names)
    assert not [p for p in listed if "direct_url" in p or "bin/" in p or p.endswith(".pyc")]
