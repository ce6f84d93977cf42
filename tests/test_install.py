"""quantdask installed from its wheel, as a user installs it: the notebooks, the report template
and the demo ship inside the package, and the demo runs to a finished report from anywhere."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.browser import inspect_page, require_chromium
from tests.conftest import OUR_LINE

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
# What a checkout holds that is not source: the venv, runs, caches, earlier builds.
NOT_SOURCE = shutil.ignore_patterns(".venv", ".git", "runs", "build", "dist", "*.egg-info",
                                    "__pycache__", ".pytest_cache", ".ruff_cache",
                                    ".ipynb_checkpoints", "dask-worker-space")


def test_every_subpackage_is_listed_for_the_wheel():
    # pyproject.toml lists the packages (the mapped notebooks/ and data/ cannot be found), so a
    # new subpackage left off the list would be missing from the wheel: say so here, fast.
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts)
             for p in (REPO / "quantdask").rglob("__init__.py") if "__pycache__" not in p.parts}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"
    mapped = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert mapped == {"quantdask.notebooks": "notebooks", "quantdask.data": "data"}


def _build_wheel(source: Path, out: Path) -> Path:
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
               "-w", str(out), str(source)]
    if importlib.util.find_spec("setuptools"):  # build offline with this environment's own
        command[4:4] = ["--no-build-isolation", "--no-index"]
    # (else pip fetches the build backend from its configured index, as `pip install .` does)
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = out.glob("quantdask-*.whl")
    return wheel


def _shipped_files(source: Path) -> set[str]:
    """Where every module, notebook and data file of the source goes in the wheel."""
    package = source / "quantdask"
    files = {p.relative_to(source).as_posix() for p in package.rglob("*.py")
             if "__pycache__" not in p.parts}
    files |= {p.relative_to(source).as_posix()
              for p in (package / "report" / "template").iterdir()}
    files |= {f"quantdask/notebooks/{p.name}" for p in (source / "notebooks").glob("*.ipynb")}
    files |= {f"quantdask/data/{p.relative_to(source / 'data').as_posix()}"
              for p in (source / "data").rglob("*") if p.is_file()}
    return files


def _venv_with(wheel: Path, venv: Path) -> tuple[Path, Path]:
    """A fresh virtual environment holding the wheel; return its bin folder and site-packages.

    The dependencies (torch, transformers, dask, jupyter, ...) come from this test's
    environment, not from an index (that would download gigabytes again): a .pth file in the
    new site-packages puts this environment's site-packages folders on ``sys.path``, after the
    new one. A .pth line only adds its folder; the .pth files inside it are not run, so the
    editable install of the checkout there (setuptools' ``__editable__`` finder) does not come
    along, and the new site-packages comes first: ``import quantdask`` is the wheel (asserted
    by the test).
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    bin_dir = venv / "bin"
    python = bin_dir / "python"
    # This environment's pip installs into the new one (``--python``, pip >= 22.3); before the
    # .pth exists, so pip sees no other quantdask there.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    dependencies = [p for p in dict.fromkeys(sys.path)
                    if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (site / "_quantdask_test_dependencies.pth").write_text("\n".join(dependencies) + "\n")
    # The dependencies' data files too: nbconvert's base templates and the kernel spec live in
    # PREFIX/share/jupyter, which Jupyter looks up from the running Python's prefix.
    jupyter_data = Path(sys.prefix, "share", "jupyter")
    if jupyter_data.is_dir():
        (venv / "share").mkdir()
        (venv / "share" / "jupyter").symlink_to(jupyter_data, target_is_directory=True)
    return bin_dir, site


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


PROBE = """
import importlib.metadata, importlib.resources, json, quantdask
from quantdask import demo_model
from quantdask.report import html as html_report
print(json.dumps({
    "package": quantdask.__file__,
    "notebooks": str(importlib.resources.files("quantdask.notebooks") / "report.ipynb"),
    "NOTEBOOKS_DIR": str(html_report.NOTEBOOKS_DIR),
    "TEMPLATE_DIR": str(html_report.TEMPLATE_DIR),
    "report": str(html_report.notebook_path("report")),
    "DEMO_MODEL_DIR": demo_model.DEMO_MODEL_DIR,
    "DEMO_EVAL_TEXT": demo_model.DEMO_EVAL_TEXT,
    "DEMO_SWEEP": demo_model.DEMO_SWEEP,
    "version": importlib.metadata.version("quantdask"),
}))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_wheel_ships_everything_and_runs_the_demo_outside_the_checkout(tmp_path):
    from quantdask.demo_model import DEMO_SWEEP
    from quantdask.store.readers import read_results
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import load_sweep

    # Built from a copy: building in place would write build/ and *.egg-info into the checkout,
    # and a stale build/lib can carry files deleted since into the wheel.
    source = Path(shutil.copytree(REPO, tmp_path / "src", ignore=NOT_SOURCE))
    wheel = _build_wheel(source, tmp_path / "wheels")
    assert _shipped_files(source) <= set(zipfile.ZipFile(wheel).namelist())

    bin_dir, site = _venv_with(wheel, tmp_path / "venv")
    work = tmp_path / "work"  # outside the checkout, with no path to it
    work.mkdir()
    assert not work.resolve().is_relative_to(REPO)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"

    def run(*command, timeout=120) -> subprocess.CompletedProcess:
        return subprocess.run([str(c) for c in command], cwd=work, env=env, capture_output=True,
                              text=True, timeout=timeout)

    probe = run(bin_dir / "python", "-c", PROBE)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    version = PYPROJECT["project"]["version"]
    assert found.pop("version") == version
    for name, path in found.items():  # everything from the installed wheel, nothing from here
        assert Path(path).is_relative_to(site / "quantdask"), (name, path)
        assert Path(path).exists(), (name, path)

    for command in ([bin_dir / "quantdask", "--version"],
                    [bin_dir / "python", "-m", "quantdask", "--version"]):
        shown = run(*command)
        assert (shown.returncode, shown.stdout) == (0, f"quantdask {version}\n"), shown.stderr

    installed = _snapshot(site / "quantdask")
    demo = run(bin_dir / "quantdask", "demo", "--no-scaling", "--workers", "2",
               "--run-dir", "run", timeout=780)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "building the demo model" not in demo.stdout  # it shipped
    assert "Dask dashboard: http://127.0.0.1:" in demo.stdout  # the local cluster: loopback
    results = read_results(work / "run")
    n_jobs = results.height  # the configs' jobs and the search's (made once it has probed)
    assert n_jobs > len(expand_grid(load_sweep(DEMO_SWEEP))) and set(results["status"]) == {
        "done"}
    assert f"{n_jobs} jobs: {n_jobs} done, 0 failed, 0 skipped" in demo.stdout
    # What the report says, at the terminal (issue 39): task accuracy and the gates' verdict.
    assert "task accuracy (score ± standard error; recovery = " in demo.stdout
    assert f"gates: passed: all {n_jobs - 1} quantized configs meet every gate" in demo.stdout
    # It leads with its search's answer (issue 56), before the jobs' table: the mix to ship,
    # the uniform format within the budget and the two at equal bytes, and why there is no file.
    answer = ("answer: at 6.9 bits/weight (whole model; search mix, demo-llama), ship mix 6.9b "
              "#1: KL ")
    assert answer in demo.stdout and demo.stdout.index(answer) < demo.stdout.index(
        "config_label")
    assert "  uniform b3 (hqq 3b g64), the largest within the budget: KL " in demo.stdout
    assert "  at equal bytes (6.890 bits/weight): mixed " in demo.stdout
    assert "  its file: not saved as a file: " in demo.stdout
    report = work / "run" / "report.html"
    assert f"report: {report.resolve()}" in demo.stdout
    assert report.stat().st_size > 500_000  # the charts' JavaScript inlined
    assert "quantdask report: run" in report.read_text(encoding="utf-8")
    # The report opens with it too, and shows the search (tests/test_search.py's run has no
    # report of its own: this one covers it).
    html = report.read_text(encoding="utf-8")
    assert html.index(answer) < html.index("Mixed against uniform, by size")
    for title in ("Sensitivity by depth and format", "Predicted against measured KL",
                  "measured_over_predicted"):
        assert title in html, title
    assert "no search in this run" not in html
    # Every section filled: the demo's speed block gives the speed section its figures.
    assert "this sweep timed no generation" not in report.read_text(encoding="utf-8")
    # Seen in a browser, the size axes fit the quantized configs (issue 70): the baseline's
    # 32 bits is a rule, not a point that squeezes them into a corner of a 0-35 axis.
    page = inspect_page(report, chromium=require_chromium())
    sized = [panel for panel in page.spreads if "bits per weight" in panel["x_axis"]
             and panel["points"] > 2]
    assert len(sized) >= 2, page.spreads  # perplexity and KL, at the least
    assert all(panel["spread"] > 0.6 for panel in sized), sized
    assert "WARNING" not in demo.stderr  # notebook and kernel clean-up stay quiet
    # Only quantdask's own lines on stderr: the libraries' notices (their imports, lm-eval's
    # `git describe` in a folder that is no repository, as this one) stay in the logs.
    assert all(OUR_LINE.match(line) for line in demo.stderr.splitlines() if line.strip()), \
        demo.stderr
    assert _snapshot(site / "quantdask") == installed  # the demo wrote nothing into the install
