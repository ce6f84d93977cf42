"""Where the test suite's CPU goes: runs ``make test``'s pytest command while sampling every
process on the machine, then attributes CPU to each test and to the kind of process that
spent it (the pytest process itself, a cluster's forked workers, a `quantdask` command, a
notebook kernel...).

    .venv/bin/python scripts/suite_cpu.py [pytest arguments, e.g. tests/test_report.py]

The suite is CPU-bound on 2 cores (benchmarks/RESULTS.md section 16), so its time is the sum
of this CPU over two. A process is charged to the test that was running in the pytest process
it descends from, for the CPU it spent during that test (a session cluster's worker is charged
test by test). Samples every 0.3 s: a process that lives less than that is missed. What no test
started (the kernel's own threads, other tenants) is listed apart, and so is the machine's idle
time during each test: what tests that wait leave unused. SUITE_CPU_JSON=FILE writes every
figure there.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
KINDS = (("forkserver import main", "cluster worker (forked)"),
         ("spawn_main", "cluster worker (spawned)"), ("quantdask.report.kernel", "report kernel"),
         (r"bin/dask (worker|scheduler)", "dask command"), (r"-m quantdask|bin/quantdask",
                                                            "quantdask command"),
         ("gpu_smoke", "gpu smoke"), ("chromium", "chromium"), (r"\bpip\b", "pip"))


def sample(stop: subprocess.Popen) -> tuple[dict, dict, list]:
    """Until ``stop`` ends: each process's (pid, parent, start, command), its CPU series, and
    the machine's idle CPU-seconds series."""
    about: dict[str, dict] = {}
    cpu: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    idle: list[tuple[float, float]] = []
    while stop.poll() is None:
        now = time.time()
        machine = psutil.cpu_times()
        idle.append((now, machine.idle + getattr(machine, "iowait", 0.0)))
        for process in psutil.process_iter(["pid", "ppid", "cmdline", "cpu_times",
                                            "create_time", "name"]):
            info = process.info
            if info["cpu_times"] is None:
                continue
            key = f"{info['pid']}@{info['create_time']}"
            about.setdefault(key, {"pid": info["pid"], "ppid": info["ppid"],
                                   "start": info["create_time"],
                                   "cmd": " ".join(info["cmdline"] or [info["name"] or ""])})
            cpu[key].append((now, info["cpu_times"].user + info["cpu_times"].system))
        time.sleep(0.3)
    return about, cpu, idle


def idle_per_test(idle: list, spans: list[dict]) -> collections.Counter:
    """The machine's idle CPU-seconds during each test (a test beside another in the other
    pytest process shares that idle time with it): what tests that wait leave unused."""
    times = [t for t, _ in idle]

    def at(when: float) -> float:
        i = bisect.bisect_right(times, when)
        return idle[i - 1][1] if i else 0.0

    return collections.Counter({span["test"]: at(span["end"]) - at(span["start"])
                                for span in spans})


def attribute(about: dict, cpu: dict, spans: list[dict]) -> tuple[collections.Counter, ...]:
    """CPU per test, per (test file, process kind), and per process no test started."""
    pytest_pids = {span["pid"] for span in spans}
    by_pid = collections.defaultdict(list)
    for key, process in about.items():
        by_pid[process["pid"]].append(key)

    def runner(key: str) -> str | None:  # the pytest process ``key`` descends from
        for _ in range(40):
            if about[key]["pid"] in pytest_pids:
                return key
            parents = [k for k in by_pid.get(about[key]["ppid"], [])
                       if about[k]["start"] <= about[key]["start"] + 1]
            if not parents:
                return None
            key = max(parents, key=lambda k: about[k]["start"])
        return None

    times = {key: [t for t, _ in series] for key, series in cpu.items()}

    def at(key: str, when: float) -> float:  # its CPU at ``when`` (0 before it was seen)
        i = bisect.bisect_right(times[key], when)
        return cpu[key][i - 1][1] if i else 0.0

    per_test, per_kind, unattributed = (collections.Counter() for _ in range(3))
    roots = {key: runner(key) for key in about}
    for key, root in roots.items():
        if root is None:
            # What it spent while sampled (a kernel thread's total counts from the boot).
            unattributed[about[key]["cmd"][:90]] += cpu[key][-1][1] - cpu[key][0][1]
    for span in spans:
        for key, root in roots.items():
            if root is None or about[root]["pid"] != span["pid"] \
                    or about[key]["start"] > span["end"]:
                continue
            spent = at(key, span["end"]) - at(key, span["start"])
            if spent > 0:
                kind = "pytest process" if key == root else next(
                    (name for pattern, name in KINDS if re.search(pattern, about[key]["cmd"])),
                    about[key]["cmd"][:50])
                per_test[span["test"]] += spent
                per_kind[(span["test"].split("::")[0], kind)] += spent
    return per_test, per_kind, unattributed


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        spans_file = Path(scratch) / "spans.jsonl"
        started = time.monotonic()
        suite = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile",
             "--no-loadscope-reorder", "-q", "-p", "no:cacheprovider", *sys.argv[1:]],
            cwd=REPO, env={**os.environ, "QUANTDASK_TEST_SPANS": str(spans_file)})
        about, cpu, idle = sample(suite)
        wall = time.monotonic() - started
        spans = [json.loads(line) for line in spans_file.read_text().splitlines()] \
            if spans_file.exists() else []
    per_test, per_kind, unattributed = attribute(about, cpu, spans)
    idle_during = idle_per_test(idle, spans)
    per_file = collections.Counter()
    for (test_file, _), spent in per_kind.items():
        per_file[test_file] += spent
    print(f"\nwall {wall:.0f} s; CPU charged to tests {sum(per_test.values()):.0f} s; "
          f"started by no test {sum(unattributed.values()):.0f} s; machine idle "
          f"{idle[-1][1] - idle[0][1] if idle else 0:.0f} CPU-s")
    for title, counts, n in (("per test file", per_file, 25), ("per file and process kind",
                             per_kind, 40), ("per test", per_test, 30),
                             ("started by no test", unattributed, 8),
                             ("machine idle during each test", idle_during, 25)):
        print(f"\nCPU s, {title}:")
        for what, spent in counts.most_common(n):
            print(f"{spent:8.1f}  {' / '.join(what) if isinstance(what, tuple) else what}")
    if os.environ.get("SUITE_CPU_JSON"):  # every figure, for a closer look
        Path(os.environ["SUITE_CPU_JSON"]).write_text(json.dumps({
            "per_test": per_test, "idle_during": idle_during,
            "per_kind": {" / ".join(k): v for k, v in per_kind.items()}, "spans": spans},
            indent=1))
    return suite.returncode


if __name__ == "__main__":
    sys.exit(main())
