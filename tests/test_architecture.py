"""The package's shape holds: imports point one way (the import-linter contract in
pyproject.toml), no import cycles, no module past about 400 lines, and the public API imports."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
MAX_LINES = 420  # "about 400": a module past it has more than one role


def _import_graph() -> dict[str, set[str]]:
    import grimp

    graph = grimp.build_graph("quantdask", exclude_type_checking_imports=True)
    return {module: set(graph.find_modules_directly_imported_by(module))
            for module in graph.modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.mark.timeout(120)
def test_imports_point_one_way():
    run = subprocess.run([str(LINT_IMPORTS)], cwd=REPO, capture_output=True, text=True,
                         timeout=110)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 kept, 0 broken" in run.stdout


@pytest.mark.timeout(60)
def test_no_import_cycle():
    graph = _import_graph()
    assert "quantdask.run.sweep" in graph and "quantdask.job.job" in graph
    assert _cycles(graph) == []


@pytest.mark.timeout(10)
def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


@pytest.mark.timeout(10)
def test_no_module_is_past_about_400_lines():
    long = {str(p.relative_to(REPO)): n for p in (REPO / "quantdask").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


@pytest.mark.timeout(60)
def test_every_public_name_imports():
    import quantdask as qd

    missing = [name for name in qd.__all__ if not hasattr(qd, name)]
    assert missing == [] and len(qd.__all__) == len(set(qd.__all__))
    from quantdask import report
    from quantdask.cluster import slurm_cluster  # the SLURM recipe's import

    assert callable(slurm_cluster)
    assert all(callable(getattr(report, name)) for name in report.__all__)


def _module_names_held_as_strings() -> set[str]:
    """Every string constant of the package that names a quantdask module (``quantdask.x.y``,
    ``x`` one of its packages or modules), but a logger's channel (``getLogger("quantdask.job")``,
    ``*_CHANNEL = ...``)."""
    import ast

    tops = {p.stem for p in (REPO / "quantdask").iterdir() if p.suffix == ".py" or p.is_dir()}
    pattern = re.compile(rf"^quantdask\.({'|'.join(sorted(tops))})(\.\w+)*$")
    found: set[str] = set()
    for path in sorted((REPO / "quantdask").rglob("*.py")):
        tree = ast.parse(path.read_text())
        channels = {id(node.args[0]) for node in ast.walk(tree)
                    if isinstance(node, ast.Call) and node.args
                    and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getLogger"}
        channels |= {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                     and any(getattr(t, "id", "").endswith("CHANNEL") for t in node.targets)}
        found |= {node.value for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and pattern.match(node.value) and id(node) not in channels}
    return found


@pytest.mark.timeout(60)
def test_every_module_named_as_a_string_imports():
    """Names held as strings move silently with their modules: the fork server's preload list
    (CPython's fork server swallows an ImportError of one), the report's lazy names, the
    worker preload."""
    import importlib

    from quantdask.cluster.local import FORK_SERVER_PRELOAD, WORKER_PRELOAD
    from quantdask.report import _MODULES

    held = _module_names_held_as_strings()
    assert {"quantdask.process.library_noise", "quantdask.process.fork_server_exit",
            WORKER_PRELOAD} <= held and set(_MODULES) <= held
    assert set(FORK_SERVER_PRELOAD) - held <= {"distributed", "torch", "transformers",
                                              "transformers.modeling_utils", "bitsandbytes"}
    unimportable = []
    for name in sorted(held):
        try:
            importlib.import_module(name)
        except ImportError as err:
            unimportable.append(f"{name}: {err}")
    assert unimportable == []


MAX_FUNCTION_LINES = 60  # a function past it holds two steps (GUIDE: "one role per module")


def _functions() -> list[tuple[int, str]]:
    """(lines, 'path:line name') of every function in quantdask/, docstring included."""
    import ast

    found = []
    for path in sorted((REPO / "quantdask").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((node.end_lineno - node.lineno + 1,
                              f"{path.relative_to(REPO)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


@pytest.mark.timeout(30)
def test_no_function_is_past_60_lines():
    functions = _functions()
    assert len(functions) > 300  # it read the package
    assert [f for f in functions if f[0] > MAX_FUNCTION_LINES] == []


# The same word meaning something else than an outcome (or the baseline), where it is not the
# vocabulary's: (module, word) -> what it means there.
OTHER_MEANINGS = {
    ("quantdask/store/summary.py", "done"): "the sweep summary's column: jobs done",
    ("quantdask/cli/commands.py", "done"): "the scaling table's column of the same name",
    ("quantdask/run/handle.py", "cancelled"): "the sweep's state in the handle's summary line",
    ("quantdask/plan/references.py", "cancelled"): "a Dask future's status",
    ("quantdask/sweepfile/tasks.py", "none"): "prose in a message: no include_path was given",
}
VOCABULARY = "quantdask/words.py"


def _outcome_literals() -> dict[tuple[str, str], int]:
    """Every string constant in quantdask/ that spells a status, a failure class, an attempt's
    end or ``"none"`` (the baseline's backend, lm-eval's unfiltered answers, ``keep: none``),
    by module."""
    import ast

    from quantdask.words import AttemptEnd, FailureClass, Status

    words = {str(word) for word in (*Status, *FailureClass, *AttemptEnd)} | {"none"}
    found: dict[tuple[str, str], int] = {}
    for path in sorted((REPO / "quantdask").rglob("*.py")):
        module = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in words:
                found[(module, node.value)] = found.get((module, node.value), 0) + 1
    return found


@pytest.mark.timeout(30)
def test_outcome_words_are_spelled_only_in_the_vocabulary():
    found = _outcome_literals()
    assert (VOCABULARY, "out_of_memory") in found and (VOCABULARY, "none") in found  # it sees them
    stray = {where: n for where, n in found.items()
             if where[0] != VOCABULARY and where not in OTHER_MEANINGS}
    assert stray == {}
    assert set(OTHER_MEANINGS) <= set(found)  # no stale exception


@pytest.mark.timeout(60)
def test_the_old_spec_path_is_a_deprecated_alias_of_sweepfile():
    """``quantdask.spec`` (users' notebooks import ``quantdask.spec.gates``) is the sweep-file
    model under its old name for one release: the same module objects, and a warning."""
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import quantdask.spec.gates\nexcept DeprecationWarning as w:\n"
            "    print('warned:', w)\n")
    warned = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=50)
    assert "warned: quantdask.spec is now quantdask.sweepfile" in warned.stdout, warned.stderr
    import quantdask.sweepfile.gates
    import quantdask.sweepfile.sweep

    with pytest.warns(DeprecationWarning) if "quantdask.spec" not in sys.modules else \
            contextlib.nullcontext():
        import quantdask.spec.gates
        from quantdask.spec.sweep import Sweep
    assert quantdask.spec.gates is quantdask.sweepfile.gates
    assert Sweep is quantdask.sweepfile.sweep.Sweep


@pytest.mark.timeout(30)
def test_a_backend_is_a_small_core_and_each_refusal_is_written_once():
    """A backend's core has at most 8 fields; what it can do beyond them is a capability, and
    each capability's refusal is written in one place (backends/capabilities.py)."""
    import dataclasses

    from quantdask.backends import Backend
    from quantdask.backends.capabilities import Capability

    assert len(dataclasses.fields(Backend)) <= 8
    home = REPO / "quantdask" / "backends" / "capabilities.py"
    elsewhere = "\n".join(p.read_text() for p in (REPO / "quantdask").rglob("*.py") if p != home)
    kinds = Capability.__subclasses__()
    assert len(kinds) >= 6
    for kind in kinds:
        words = kind.refuses.split("{why}")[0].replace("{backend}", "").strip(" :")
        usual = kind.refusal("", kind.usual_why).strip(" :")
        assert usual not in elsewhere, (kind.__name__, usual)
        assert words in home.read_text() and (len(words) < 20 or words not in elsewhere), words
