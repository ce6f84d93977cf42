"""Shared fixtures: the committed demo model, sweep-file factories, one real 2-slot cluster."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import time
from pathlib import Path

import dask
import pytest
import yaml

from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR
from quantdask.report.kernel import leave_out_iri_checker

REPO = Path(__file__).resolve().parent.parent

# Two pytest processes share 2 cores (`make test`): each computes on one thread, as each CPU
# slot does, instead of two OpenMP threads apiece spinning against the other process. (Before
# torch is imported; the commands the tests start inherit it.)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A CPU slot's job borrows the cores of idle slots (quantdask.process.cpu_share), which are not
# idle here: the other pytest process computes on them. OpenMP's threads then spin while they
# wait (libgomp's default): two sweeps beside a busy process took 8.3 s of CPU with borrowed
# cores, 5.0 s without; with passive waiting, 3.7 s and 3.2 s.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Dask's own monitoring, at a pace the suite can afford: its sampling profiler (every worker's
# stack every 10 ms, for the dashboard's profile page) off, the event loop's tick (its
# "unresponsive" warning) every second instead of 20 ms, the memory monitor's reading of each
# worker's memory every 0.5 s instead of 0.1 s, and the system monitor's (the dashboard's
# graphs) every 2 s instead of 0.5 s. An idle 2-slot cluster takes 13% of a core with Dask's
# defaults, 2% with these (benchmarks/idle_cluster.py), and the suite keeps one per pytest
# process. Nothing a test checks depends on their pace; the commands the tests start inherit
# them.
DASK_MONITORING = {"distributed.worker.profile.enabled": False,
                   "distributed.admin.tick.interval": "1s",
                   "distributed.worker.memory.monitor-interval": "500ms",
                   "distributed.admin.system-monitor.interval": "2s"}
for _key, _value in DASK_MONITORING.items():
    os.environ.setdefault("DASK_" + _key.upper().replace(".", "__").replace("-", "_"),
                          str(_value))
dask.config.set(DASK_MONITORING)

# The tests' processes check charts and notebooks as the `quantdask` command does: without
# jsonschema's IRI format checker, whose import took 3.7 s of CPU in each pytest process.
leave_out_iri_checker()

# The files that take longest, longest first (each file's test durations summed under `make
# test`; every file of 9 s or more). `make test` runs two pytest processes that take whole
# files in collection order (--no-loadscope-reorder): starting with the long files, the last
# file to finish is a short one, not test_multinode (nor test_tasks, last alphabetically).
# test_faults comes second: its deadlines then wait beside test_multinode's busy start, not
# beside its waiting end (machine idle 91 to 85 CPU-s).
LONGEST_FIRST = ("test_multinode.py", "test_faults.py", "test_report.py", "test_gptq.py",
                 "test_install.py", "test_benchmarks.py", "test_handle.py", "test_search.py",
                 "test_gguf.py", "test_gptq_search.py", "test_gguf_search.py",
                 "test_gguf_experts.py", "test_calibration.py", "test_tasks.py",
                 "test_streaming.py", "test_for_people.py", "test_slot_memory.py",
                 "test_sweep_cluster.py", "test_tasks_sweep.py",
                 "test_quantized_size.py", "test_kl_exact.py", "test_operator.py",
                 "test_artifacts.py", "test_gptq_families.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file keeps its own order


# The tests reach no address but loopback: a name lookup of any other host (a library looking
# for a model or a data set on the Hub, say) fails at once, and the test that made it fails
# with the name. (The commands a test starts run their own Python, unguarded.)
_LOOKED_UP: list[str] = []
_getaddrinfo = socket.getaddrinfo


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


def _loopback_only_getaddrinfo(host, *args, **kwargs):
    name = host.decode() if isinstance(host, bytes) else host
    if name and not _is_loopback(name):
        _LOOKED_UP.append(name)
        raise socket.gaierror(socket.EAI_NONAME, f"the tests reach no other address: {name}")
    return _getaddrinfo(host, *args, **kwargs)


@pytest.fixture(autouse=True)
def reaches_only_loopback():
    socket.getaddrinfo = _loopback_only_getaddrinfo
    start = len(_LOOKED_UP)
    yield
    looked_up = _LOOKED_UP[start:]
    assert not looked_up, f"this test looked up hosts other than loopback: {sorted(set(looked_up))}"


@pytest.fixture(scope="session", autouse=True)
def bitsandbytes_imported_offline():
    """bitsandbytes imported as quantdask imports it (``util.import_offline``), before any
    test: a test that reloads a saved 4-bit model with plain ``from_pretrained`` first would
    import it through transformers, and its import asks the Hub for a CPU kernel (a lookup
    this file's guard refuses, in whichever test came first)."""
    import importlib.util

    from quantdask.util import import_offline

    if importlib.util.find_spec("bitsandbytes") is not None:
        import_offline("bitsandbytes")


@pytest.fixture(scope="session", autouse=True)
def in_process_jobs_run_on_the_cpu():
    """Jobs and references that tests run in this process (``run_job``, ``compute_reference``)
    run on the CPU, as a CPU slot's do. On a machine with a GPU they would pick ``cuda:0``, and
    what these tests check is the CPU's (a CPU slot's device memory is its RSS; a float32
    model's torchao int4 is skipped on the CPU). The GPU has its own tests (tests/test_gpu.py,
    through real GPU workers, which this does not touch)."""
    import quantdask.job.job

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantdask.job.job, "torch_device", lambda: ("cpu", "cpu", False))
        yield


@pytest.fixture(scope="session")
def demo_model() -> str:
    assert os.path.isfile(os.path.join(DEMO_MODEL_DIR, "config.json")), "data/demo-model missing"
    return DEMO_MODEL_DIR


OUR_LINE = re.compile(
    r"^(quantdask[: ]|\d{4}-\d\d-\d\d[ T][\d:,.]+ (INFO|WARNING|ERROR) quantdask)")
"""A line quantdask itself writes to the terminal's stderr (the libraries' notices go to the
logs unless -v)."""


def sweep_dict(**overrides) -> dict:
    """A small valid sweep over the demo model; ``overrides`` replace top-level keys."""
    data = {
        "name": "t",
        "models": [{"name": "demo", "path": DEMO_MODEL_DIR}],
        "backends": [{"backend": "bitsandbytes", "grid": {"bits": [4], "quant_type": ["nf4"]}}],
        "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 32, "samples": 8, "batch_size": 8},
        "seed": 0,
        "retries": 0,
        "retry_backoff_s": 0.1,
    }
    data.update(overrides)
    return data


def with_slow_jobs(data: dict, attempts: tuple[int, ...] = (1,)) -> dict:
    """``data`` with a ``slow`` fault (1.5 s more, and no CPU) on every quantized job's
    ``attempts``, before its own faults: jobs surely still running a second after they began,
    to kill or watch one mid-job, where evaluating more windows would cost CPU instead."""
    from quantdask.sweepfile.sweep import expand_grid
    from quantdask.sweepfile.sweep_file import sweep_from_dict

    labels = sorted({job.config_label for job in expand_grid(sweep_from_dict(data))
                     if not job.is_baseline})
    slow = [{"config": label, "attempt": attempt, "kind": "slow"}
            for label in labels for attempt in attempts]
    return {**data, "faults": slow + list(data.get("faults", []))}


@pytest.fixture
def write_sweep(tmp_path):
    """Factory: write a sweep YAML (a dict, or raw text) and return its path."""

    def write(content=None, name: str = "sweep.yaml", **overrides) -> str:
        path = tmp_path / name
        if isinstance(content, str):
            path.write_text(content)
        else:
            data = content if content is not None else sweep_dict(**overrides)
            path.write_text(yaml.safe_dump(data))
        return str(path)

    return write


@pytest.fixture(scope="session")
def cluster():
    """One real LocalCluster with two single-threaded CPU slots on 127.0.0.1, for the session."""
    from quantdask.cluster.local import start_cluster

    with start_cluster(workers=2) as handle:
        yield handle


def calibration_file(tmp_path_factory, sentences: int, seed: int) -> str:
    """A calibration text of ``sentences`` sentences of the demo's language (``seed``: not
    the eval text's), written once for a module."""
    from quantdask.demo_model import generate_text

    path = tmp_path_factory.mktemp("calibration") / "calibration.txt"
    path.write_text(generate_text(sentences, seed=seed))
    return str(path)


# scripts/suite_cpu.py: each test's span (its process, start, end), to attribute the CPU of
# every process the suite starts to the test that started it.
_TEST_SPANS = os.environ.get("QUANTDASK_TEST_SPANS")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started = time.time()
    yield
    if _TEST_SPANS:
        with open(_TEST_SPANS, "a", encoding="utf-8") as spans:
            spans.write(json.dumps({"pid": os.getpid(), "test": item.nodeid, "start": started,
                                    "end": time.time()}) + "\n")


def write_generate_task(folder: Path, questions: int = 12) -> list[dict]:
    """demo_facts' first ``questions`` as a generate_until task ``demo_generate`` in
    ``folder``/gen (stop at '.' or ',', 4 new tokens, exact match); its documents."""
    import json

    from quantdask.demo_model import DEMO_TASKS_DIR

    task = folder / "gen"
    task.mkdir(parents=True, exist_ok=True)
    docs = [json.loads(line) for line in Path(DEMO_TASKS_DIR, "demo_facts", "demo_facts.jsonl")
            .read_text().splitlines()][:questions]
    (task / "gen.jsonl").write_text("".join(
        json.dumps({"query": d["query"], "answer": d["choices"][d["gold"]]}) + "\n"
        for d in docs))
    (task / "gen.yaml").write_text(
        "task: demo_generate\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        "    test: gen.jsonl\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{query}}'\ndoc_to_target: ' {{answer}}'\n"
        "generation_kwargs:\n  until: ['.', ',']\n  max_new_tokens: 4\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n"
        "    higher_is_better: true\nmetadata:\n  version: 1.0\n")
    return docs


class KeptRunDir:
    """A run directory with one file recorded before a refused command, and whether the
    command left it exactly as it was (``unchanged()``: names and modification times)."""

    def __init__(self, path: Path):
        self.path = path
        path.mkdir()
        (path / "results.txt").write_text("recorded before")
        self._before = self._listing()

    def _listing(self) -> list[tuple[str, int]]:
        return sorted((p.name, p.stat().st_mtime_ns) for p in self.path.iterdir())

    def unchanged(self) -> bool:
        return self._listing() == self._before
