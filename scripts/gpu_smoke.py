"""The GPU smoke check: real CUDA metrics, lm-eval, two jobs sharing one GPU, torchao, tests.

    scripts/gpu_smoke.sh [--dry-run] [--out DIR] [--tar FILE]     (it sets up, then calls this)

On a CUDA machine: a LocalCUDACluster over every GPU runs a 4-config bitsandbytes sweep of the
demo model (plus its baseline) and checks that each job recorded a peak device memory above
zero and its GPU (``cuda:<id>``), that NVML samples were taken, and that each job scored a few
questions of the demo's multiple-choice task with lm-eval (the tasks frame: acc and acc_norm in
[0, 1] for every job, the baseline's recovery 1); on the same cluster, torchao
int8 and int4 weight-only run on the demo model loaded in bfloat16 (int4's size must not count
its layout's padding: below int8's), and a speed sweep times generation of bf16, int8 and nf4
(``qd.read_speed`` printed); then one GPU with ``jobs_per_gpu: 2`` runs two jobs at once (held
until both are inside their measured spans: ``held_backend``), whose peaks must be flagged
shared (the bitsandbytes sweep's jobs, one per worker, must not be) and whose samples must name
both; then ``tests/test_gpu.py`` runs under pytest. Each worker must advertise its GPU's memory
(the ``DEVICE_MEMORY`` resource that placement by memory uses). ``--dry-run`` does the same on
CPU slots (the tests run it so that this script does not rot), checking ``cpu`` where CUDA would
be (tests/test_gpu.py skips).

It prints first the versions of cuda-core and cuda-bindings (dask-cuda 26.10 imports ``from
cuda.core import Device``: cuda-core 0.5 or later), of the task path's libraries and the host's
memory, then each stage's time.
The output directory is new every run (a rerun of an old one would resume and check stale
results); ``--tar FILE`` packs it for the trip back, in a ``finally``: a failure, or the SIGTERM
of gpu_smoke.sh's ``timeout`` (packed at once, before the cluster closes), still leaves the
tarball with what finished. No HTML report here: the lent machine has no
Jupyter stack; ``quantdask report DIR/sweep`` writes it from the unpacked directory.
Exit 0 when every check passed, 1 otherwise, 2 when it cannot start.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIGS = [{"bits": 4, "quant_type": "nf4"}, {"bits": 4, "quant_type": "fp4"},
           {"bits": 4, "quant_type": "nf4", "double_quant": True}, {"bits": 8}]


TASK_LIMIT = {True: 8, False: 32}
"""Questions of the demo's task (data/tasks/demo_facts) each job of the smoke sweep scores,
in a dry run (True) and on a GPU: a few, to check the task path, not the accuracy."""


def sweep(name: str, jobs_per_gpu: int = 1, dry_run: bool = False, configs: int = len(CONFIGS),
          tasks: bool = False, backend: str = "bitsandbytes"):
    """The smoke sweep (the baseline and the first ``configs`` of ``CONFIGS``, of ``backend``:
    bitsandbytes or ``held_backend``'s), with ``tasks`` a few questions of the demo's
    multiple-choice task scored by lm-eval; a dry run evaluates a
    quarter of the tokens (CPU slots are slow, and the checks are about where and how jobs ran,
    not about the numbers)."""
    from quantdask import sweep_from_dict
    from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR, DEMO_TASKS_DIR

    return sweep_from_dict({
        "name": name, "models": [{"name": "demo", "path": DEMO_MODEL_DIR}],
        "backends": [{"backend": backend, "configs": CONFIGS[:configs]}],
        "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 64 if dry_run else 128,
                 "samples": 16 if dry_run else 32, "batch_size": 8},
        **({"tasks": {"names": ["demo_facts"], "include_path": DEMO_TASKS_DIR,
                      "limit": TASK_LIMIT[dry_run], "batch_size": 8}} if tasks else {}),
        "retries": 1, "jobs_per_gpu": jobs_per_gpu,
    })


def task_checks(tasks, results, limit: int) -> list[tuple[bool, str]]:
    """What the tasks frame must show: demo_facts' acc and acc_norm for every job, each a
    value in [0, 1] over ``limit`` questions, and the baseline's recovery exactly 1 (its own
    score over itself)."""
    labels = dict(zip(results["job_id"], results["config_label"], strict=True))
    rows = tasks.filter(tasks["task"] == "demo_facts").to_dicts()
    got = {(labels.get(r["job_id"]), r["metric"]) for r in rows}
    wanted = {(label, metric) for label in labels.values() for metric in ("acc", "acc_norm")}
    valued = all(r["value"] is not None and 0 <= r["value"] <= 1 and r["samples"] == limit
                 for r in rows)
    baseline = [r["recovery"] for r in rows if labels.get(r["job_id"]) == "baseline"]
    return [
        (bool(rows) and got == wanted and len(rows) == len(wanted) and valued,
         f"task rows (demo_facts acc, acc_norm) for all {len(labels)} jobs, each a value in "
         f"[0, 1] over {limit} questions: {len(rows)} rows"),
        (len(baseline) == 2 and all(r == 1 for r in baseline),
         f"the baseline's task recovery is 1 ({baseline})"),
    ]


def print_tasks(tasks, results) -> None:
    """Each job's demo_facts accuracy, with the baseline's and the recovery."""
    labels = dict(zip(results["job_id"], results["config_label"], strict=True))
    for r in tasks.sort("job_id", "metric").to_dicts():
        print(f"smoke:      {labels.get(r['job_id'], r['job_id']):14} {r['task']} "
              f"{r['metric']:8} {r['value'] if r['value'] is not None else float('nan'):.4f} "
              f"+- {r['stderr'] or 0:.4f} (baseline {r['baseline_value'] or float('nan'):.4f}, "
              f"recovery {r['recovery'] or float('nan'):.4f}; {r['samples']} questions)",
              flush=True)


RENDEZVOUS_S = 30.0
"""How long a packed job of a held backend waits for the other (``held_backend``)."""


def held_backend(original, folder: Path, patience: float = RENDEZVOUS_S):
    """``original`` (a registered ``Backend``) as ``<name>-held``, whose quantize first waits
    until another job has reached the same point (a file each in ``folder``: the jobs are
    threads of one worker, or processes of one machine).

    The quantize phase is inside a job's measured span (its ``PeakMemory`` block), so two
    packed jobs of this backend that are both done were both inside their spans at the moment
    the second arrived: they surely ran at once, however short their jobs are. (Judged by their
    start and end times, a job of a tenth of a second, such as the baseline, which the
    model's reference spares its work, overlapped another's attempt while its span did not:
    the check failed once that way.) One that waits ``patience`` seconds alone fails its job."""
    import dataclasses

    quantize, where = original.quantize, str(folder)

    def held_quantize(source, options, device, **kwargs):
        import os
        import threading
        import time
        from pathlib import Path

        here = Path(where)
        here.mkdir(parents=True, exist_ok=True)
        (here / f"{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}").touch()
        deadline = time.monotonic() + patience
        while len(list(here.iterdir())) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no other packed job reached quantize within {patience:g}s:"
                                   " the packed jobs did not run at once")
            time.sleep(0.01)
        return quantize(source, options, device, **kwargs)

    return dataclasses.replace(original, name=f"{original.name}-held", quantize=held_quantize)


def ran_alone(results) -> set[str]:
    """The done jobs whose attempt overlapped no other job's on its worker, by the worker's
    clock: their measured spans (inside the attempts) surely overlapped none, so their peaks
    must not be flagged shared."""
    rows = results.filter(results["status"] == "done").to_dicts()
    return {a["job_id"] for a in rows
            if not any(b is not a and a["worker"] == b["worker"]
                       and a["started_at"] < b["finished_at"]
                       and b["started_at"] < a["finished_at"] for b in rows)}


def print_packed(results, met: list[str], alone: set[str]) -> None:
    """Each packed job's attempt (seconds from the first start), measured span, quantize time
    (the held backend's includes its wait) and flag, with what is known of it."""
    labels = dict(zip(results["job_id"], results["config_label"], strict=True))
    zero = results["started_at"].min()
    for r in results.sort("started_at").to_dicts():
        known = ("met another inside its span" if r["job_id"] in met
                 else "ran alone" if r["job_id"] in alone else "not judged")
        print(f"smoke:      {labels[r['job_id']]:14} {r['status']:7} attempt "
              f"{(r['started_at'] - zero).total_seconds():6.2f}-"
              f"{(r['finished_at'] - zero).total_seconds():6.2f}s, measured "
              f"{r['wall_s'] or 0:.2f}s, quantize {r['quantize_s'] or 0:.2f}s: {known}; "
              f"peak_shared {r['peak_shared']}", flush=True)


def memory_advertised_as_expected(client, gpus: list[str], dry_run: bool) -> tuple[bool, str]:
    """Whether every worker advertises its device memory for placement: the total of one of
    the chosen GPUs by NVML, or on a CPU slot what its nanny lets jobs use of its memory limit
    (``process.slot_memory``)."""
    from quantdask.plan.placement import advertised_memory, slot_memories

    advertised = advertised_memory(client)
    if dry_run:
        limits = {str(w["name"]): w["memory_limit"]
                  for w in client.scheduler_info(n_workers=-1)["workers"].values()}
        slots = slot_memories(client)
        ok = bool(advertised) and set(slots) == set(limits) and advertised == {
            name: slot.offered for name, slot in slots.items()} and all(
            slot.limit == limits[name] for name, slot in slots.items())
    else:
        from quantdask.process.devices import NvmlProbe, nvml_uuid

        # The cluster runs on every GPU this process sees, in order: the i-th has CUDA index
        # i here, looked up in NVML by its UUID. (``gpus`` holds physical ids: numbers of an
        # inherited CUDA_VISIBLE_DEVICES, or its GPU-/MIG- UUIDs.)
        totals = {NvmlProbe(nvml_uuid(i)).sample()["memory_total_bytes"]
                  for i in range(len(gpus))}
        ok = bool(advertised) and all(m in totals for m in advertised.values())
    shown = ", ".join(f"{n}: {(m or 0) / 2**30:.1f} GiB" for n, m in sorted(advertised.items()))
    return ok, shown


def torchao_sweep(dry_run: bool):
    """torchao int8 and int4 weight-only on the demo model loaded in bfloat16 (what int4 on CUDA
    needs)."""
    from quantdask import sweep_from_dict
    from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR

    return sweep_from_dict({
        "name": "smoke-torchao",
        "models": [{"name": "demo-bf16", "path": DEMO_MODEL_DIR, "dtype": "bfloat16"}],
        "backends": [{"backend": "torchao", "configs": [
            {"mode": "int8_weight_only"}, {"mode": "int4_weight_only", "group_size": 128}]}],
        "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 64 if dry_run else 128,
                 "samples": 8 if dry_run else 32, "batch_size": 8},
        "retries": 1,
    })


SPEED = {"prompt_length": 128, "new_tokens": 32, "batch_sizes": [1, 8], "warmup": 1,
         "repeats": 3}
DRY_SPEED = {"prompt_length": 16, "new_tokens": 4, "batch_sizes": [1], "warmup": 0,
             "repeats": 1}
"""The speed block of the smoke's speed sweep (tiny in a dry run: it checks the path, not the
figures, which on CPU slots say nothing about GPU speed)."""


def speed_sweep(dry_run: bool):
    """Generation speed of bf16 (the baseline: the demo model loaded in bfloat16), int8 and nf4
    (bitsandbytes) on the demo model, each job holding its device alone; a short eval (the
    speed phase runs after quality)."""
    from quantdask import sweep_from_dict
    from quantdask.demo_model import DEMO_EVAL_TEXT, DEMO_MODEL_DIR

    return sweep_from_dict({
        "name": "smoke-speed",
        "models": [{"name": "demo-bf16", "path": DEMO_MODEL_DIR, "dtype": "bfloat16"}],
        "backends": [{"backend": "bitsandbytes", "configs": [
            {"bits": 8}, {"bits": 4, "quant_type": "nf4"}]}],
        "eval": {"text": DEMO_EVAL_TEXT, "seq_len": 64, "samples": 8, "batch_size": 8},
        "speed": DRY_SPEED if dry_run else SPEED,
        "retries": 1,
    })


def speed_checks(speed, results, settings: dict, device_pattern: str) -> list[tuple[bool, str]]:
    """What the speed frame must show: a row per job and batch size, each with exactly the
    tokens asked for, its device held alone, figures above zero and a speed-up against bf16."""
    labels = dict(zip(results["job_id"], results["config_label"], strict=True))
    rows = speed.to_dicts()
    batches = settings["batch_sizes"]
    wanted = {(label, b) for label in labels.values() for b in batches}
    got = {(labels.get(r["job_id"]), r["batch_size"]) for r in rows}
    whole = all(r["new_tokens"] == settings["new_tokens"] and r["exclusive"]
                and r["repeats"] == settings["repeats"]
                and re.fullmatch(device_pattern, r["device"] or "") for r in rows)
    figures = all((r[c] or 0) > 0 for r in rows for c in (
        "ttft_s", "decode_tokens_per_s", "prefill_tokens_per_s", "decode_speedup"))
    return [
        (len(labels) == 3 and got == wanted and len(rows) == len(wanted) and whole,
         f"speed rows for {sorted(labels.values())} at batch sizes {batches}: {len(rows)} rows, "
         f"{settings['new_tokens']} new tokens each, every device held alone"),
        (bool(rows) and figures, "every speed row has prefill and decode tokens/s above zero "
                                 "and a decode speed-up against bf16"),
    ]


def print_speed(speed, results) -> None:
    """The speed frame (``qd.read_speed``), one line per job and batch size, then whole."""
    import polars as pl

    labels = dict(zip(results["job_id"], results["config_label"], strict=True))
    for r in speed.to_dicts():
        print(f"smoke:      {labels.get(r['job_id'], r['job_id']):14} batch {r['batch_size']:2} "
              f"{r['device'] or '-':8} ttft {(r['ttft_s'] or 0) * 1e3:8.2f} ms  decode p50 "
              f"{(r['decode_s_p50'] or 0) * 1e3:7.2f} ms p90 {(r['decode_s_p90'] or 0) * 1e3:7.2f}"
              f" ms  {r['decode_tokens_per_s'] or 0:9.1f} tok/s  prefill "
              f"{r['prefill_tokens_per_s'] or 0:10.1f} tok/s  x{r['decode_speedup'] or 0:.2f} "
              f"of bf16  peak {(r['peak_device_mem_bytes'] or 0) / 2**20:.1f} MiB", flush=True)
    with pl.Config(tbl_cols=-1, tbl_rows=-1, tbl_width_chars=400, fmt_str_lengths=40):
        print(speed, flush=True)


def fresh_directory(path: str | None) -> Path:
    """The run's output directory, checked (not made): new (``runs/gpu-smoke-<UTC time>`` by
    default) or empty."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(path) if path else REPO / "runs" / f"gpu-smoke-{stamp}"
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"smoke: --out {out} is not empty; a rerun there would resume and "
                         "check stale results: give a new directory")
    return out


def cannot_import() -> str:
    """The last lines of the error if what the smoke needs does not import here, else ''."""
    # Offline, as quantdask's workers import it (quantdask.util.import_offline): on a processor
    # with AVX512-BF16, bitsandbytes would look for a CPU kernel on the Hub as it is imported.
    # The smoke needs nothing from the network (the lent machine reaches none).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import bitsandbytes  # noqa: F401
        import dask.distributed  # noqa: F401
        import lm_eval  # noqa: F401
        import polars  # noqa: F401

        import quantdask  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import is reported as it is
        return "".join(traceback.format_exc().splitlines(keepends=True)[-8:])
    return ""


def run_gpu_tests(out: Path, dry_run: bool) -> tuple[bool, str]:
    """tests/test_gpu.py under pytest, its output kept in ``out/test_gpu.log``: it must pass on
    a GPU and skip (no GPU) on CPU slots."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_gpu.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=150)
    (out / "test_gpu.log").write_text(run.stdout + run.stderr)
    summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    wanted = r"\d+ skipped" if dry_run else r"\d+ passed"
    ok = run.returncode == 0 and bool(re.search(wanted, summary)) \
        and "failed" not in summary and "error" not in summary
    return ok, summary


class Terminated(BaseException):
    """SIGTERM (``timeout`` cutting the smoke short): raised in the main thread so that every
    ``with`` and ``finally`` runs and the tarball holds what finished."""


def cuda_python_versions() -> list[str]:
    """The versions of cuda-core and cuda-bindings here ('missing' if absent), and a warning
    when cuda-core is too old: dask-cuda 26.10 imports ``from cuda.core import Device``, which
    needs cuda-core 0.5 or later (its requirement: 0.5.1)."""
    from importlib.metadata import PackageNotFoundError, version

    lines, found = [], {}
    for name in ("cuda-core", "cuda-bindings"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "missing"
    lines.append(", ".join(f"{name} {v}" for name, v in found.items()))
    try:
        from packaging.version import Version

        if found["cuda-core"] != "missing" and Version(found["cuda-core"]) < Version("0.5.1"):
            lines.append(f"cuda-core {found['cuda-core']} is older than the 0.5.1 dask-cuda "
                         "26.10 needs (from cuda.core import Device): GPU workers cannot start")
    except Exception:  # noqa: BLE001 - a version it cannot read is printed as it is above
        pass
    return lines


TASK_STACK = ("lm-eval", "datasets", "pyarrow", "fsspec", "pandas", "transformers")
"""The task path's libraries: lm-eval and datasets come with the bundle, the rest are the
machine's (datasets 5.2 needs pyarrow 24 or later and fsspec 2026.9.0 or earlier, versions
nobody has read there yet)."""


def task_stack_versions() -> str:
    """The versions of ``TASK_STACK`` here ('missing' if absent)."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in TASK_STACK:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} missing")
    return "task path: " + ", ".join(found)


def backends_left_out() -> str:
    """The backends' extras that the bundle leaves out (``gpu_bundle.NOT_WALKED`` says why):
    their sweeps are refused there, with the install command."""
    from gpu_bundle import NOT_WALKED

    backends = [extra for extra in ("hqq", "gptq") if extra in NOT_WALKED]
    return (f"backends the bundle leaves out: {', '.join(backends) or 'none'} (source-only "
            "releases; scripts/gpu_bundle.py NOT_WALKED)")


def host_memory() -> str:
    """The host's memory now: a GPU worker has no host-memory limit, but the figure is the
    first thing to look at when a worker is lost."""
    try:
        import psutil
    except ImportError:
        return "host memory: psutil missing"
    memory = psutil.virtual_memory()
    return (f"host memory {memory.total / 2**30:.1f} GiB total, "
            f"{memory.available / 2**30:.1f} GiB available; {os.cpu_count()} CPUs")


class Stages:
    """Times each stage of the smoke and prints it: ``with stages("name"):``. A SIGTERM
    between two stages (``interrupted``) stops the next one as it starts, so that every cut
    names the stage it stopped."""

    def __init__(self):
        self.started = time.perf_counter()
        self.current: str | None = None
        self.stopped: str | None = None  # the stage an exception stopped
        self.interrupted = False

    @contextlib.contextmanager
    def __call__(self, name: str):
        began = time.perf_counter()
        try:
            self.current = name  # inside the try: a SIGTERM from here is this stage's
            if self.interrupted:
                raise Terminated("SIGTERM")
            yield
            self.current = None  # from here a SIGTERM waits for the next stage's start
        except BaseException as error:
            self.current, self.stopped = None, name
            print(f"smoke: stage {name} stopped after {time.perf_counter() - began:.1f}s by "
                  f"{type(error).__name__}", flush=True)
            raise
        print(f"smoke: stage {name}: {time.perf_counter() - began:.1f}s "
              f"(at {time.perf_counter() - self.started:.0f}s)", flush=True)


class Packer:
    """Packs the output directory as ``tar`` (nothing without one): at the end, in a
    ``finally``, and at once on SIGTERM (``timeout`` kills 30 s later; closing a cluster may
    take longer). Each pack replaces the tarball whole."""

    def __init__(self, out: Path, tar: str | None, stages: Stages):
        self.out, self.tar, self.final, self.stages = out, tar, False, stages

    def pack(self) -> None:
        if not self.tar:
            return
        partial = f"{self.tar}.partial"
        with tarfile.open(partial, "w:gz") as packed:
            packed.add(self.out, arcname=self.out.name, recursive=False)
            for path in sorted(self.out.rglob("*")):
                try:
                    packed.add(path, arcname=f"{self.out.name}/{path.relative_to(self.out)}",
                               recursive=False)
                except FileNotFoundError:  # a worker's temporary file, gone since listed
                    continue
        os.replace(partial, self.tar)
        print(f"smoke: {self.out} packed as {self.tar}", flush=True)

    def last(self) -> None:
        self.final = True  # a SIGTERM from here on lets this pack finish
        self.pack()

    def on_sigterm(self, signum, frame) -> None:
        if self.final:
            return
        print("smoke: SIGTERM (the time limit): packing what finished", flush=True)
        self.pack()
        if self.stages.current is None:  # between stages: the next one stops as it starts
            self.stages.interrupted = True
            return
        raise Terminated("SIGTERM")


def no_cuda() -> bool:
    """True when torch imports and sees no CUDA GPU (a torch that cannot import is named with
    the rest by ``cannot_import``)."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - any import failure: reported by cannot_import
        return False
    return not torch.cuda.is_available()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU slots instead of GPUs")
    parser.add_argument("--out", help="a new (or empty) output directory; default "
                                      "runs/gpu-smoke-<UTC time>")
    parser.add_argument("--tar", help="also pack the output directory as this .tar.gz")
    args = parser.parse_args()
    for line in cuda_python_versions():
        print(f"smoke: {line}", flush=True)
    print(f"smoke: {task_stack_versions()}", flush=True)
    print(f"smoke: {host_memory()}", flush=True)
    print(f"smoke: {backends_left_out()}", flush=True)
    out = fresh_directory(args.out)  # before the imports: a refusal costs nothing
    if not args.dry_run and no_cuda():  # before the other imports too (seconds of CPU)
        print("smoke: no CUDA GPU visible (torch.cuda.is_available() is False); "
              "use --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    stages = Stages()
    with stages("imports"):
        missing = cannot_import()
    if missing:
        print(f"gpu_smoke: {sys.executable} cannot import what the smoke needs:\n{missing}"
              "gpu_smoke: on the lent machine, carry .gpu-bundle (make gpu-bundle builds it "
              "here); elsewhere run 'make test' first or set PYTHON", file=sys.stderr)
        return 2
    import torch
    out.mkdir(parents=True, exist_ok=True)
    print(f"smoke: writing {out}; torch {torch.__version__} (CUDA {torch.version.cuda})",
          flush=True)
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"smoke: {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failures.append(what)

    packer = Packer(out, args.tar, stages)
    signal.signal(signal.SIGTERM, packer.on_sigterm)
    terminated = False
    try:
        run_checks(args, out, check, stages)
        if stages.interrupted:  # after the last stage: its checks ran; say it was cut all the same
            raise Terminated("SIGTERM")
    except BaseException as error:  # noqa: BLE001 - SIGTERM, Ctrl-C and any failure alike
        terminated = isinstance(error, Terminated)
        if not isinstance(error, Terminated | KeyboardInterrupt):
            traceback.print_exc()
        failures.append(f"stopped in stage {stages.stopped or '-'} by "
                        f"{type(error).__name__}: {error}")
    finally:
        packer.last()
    print(f"smoke: {'passed' if not failures else 'FAILED: ' + '; '.join(failures)} "
          f"in {time.perf_counter() - stages.started:.0f}s", flush=True)
    if terminated:
        # Everything is packed and said; the interpreter's shutdown (the threads and semaphores
        # of a cluster cut mid-way) could outlast `timeout`'s grace and turn 124 into a kill.
        sys.stderr.flush()
        os._exit(1)
    return 0 if not failures else 1


def run_checks(args, out: Path, check, stages: Stages) -> None:
    """Every check of the smoke, stage by stage, into ``out``."""
    import quantdask as qd
    from quantdask.backends import get_backend, register_backend

    device_pattern = r"cpu" if args.dry_run else r"cuda:(\d+|(GPU|MIG)-\S+)"
    where = {"workers": 2} if args.dry_run else {}
    with contextlib.ExitStack() as running:
        with stages("cluster start"):
            cluster = running.enter_context(qd.start_cluster(**where))
        print(f"smoke: {cluster.n_workers} workers ({cluster.kind}), "
              f"GPUs {cluster.gpus or '-'}", flush=True)
        ok, shown = memory_advertised_as_expected(cluster.client, cluster.gpus, args.dry_run)
        check(ok, f"each worker advertises its device memory for placement ({shown})")
        with stages("bitsandbytes sweep"):
            results = qd.run_sweep(sweep("smoke", dry_run=args.dry_run, tasks=True),
                                   out / "sweep", cluster.client)
            tasks = qd.read_tasks(out / "sweep")
        with stages("torchao sweep"):
            ao = qd.run_sweep(torchao_sweep(args.dry_run), out / "torchao", cluster.client)
        with stages("speed sweep"):
            fast = qd.run_sweep(speed_sweep(args.dry_run), out / "speed", cluster.client)
            speed = qd.read_speed(out / "speed")
        with stages("cluster close"):
            running.close()
    check(results.height == len(CONFIGS) + 1 and (results["status"] == "done").all(),
          f"{results.height} jobs done: {results['status'].to_list()}")
    for row in [*results.sort("config_label").to_dicts(), *ao.sort("config_label").to_dicts()]:
        print(f"smoke:      {row['config_label']:14} {row['status']:7} {row['device'] or '-':8} "
              f"peak device {(row['peak_device_mem_bytes'] or 0) / 2**20:8.1f} MiB  size "
              f"{(row['size_bytes'] or 0) / 2**20:6.2f} MiB  wall {row['wall_s'] or 0:.2f}s  "
              f"ppl {row['perplexity'] or float('nan'):.4f}  KL "
              f"{row['kl_divergence'] or float('nan'):.3g}", flush=True)
    for row in ao.filter(ao["status"] != "done").to_dicts():
        print(f"smoke:      {row['config_label']}: {row['error_class']}: "
              f"{row['error_message']}", flush=True)
    check(bool((results["peak_device_mem_bytes"] > 0).all()),
          "every job recorded a peak device memory above zero")
    check(all(re.fullmatch(device_pattern, d or "") for d in results["device"]),
          f"every job recorded its device as {device_pattern}: "
          f"{sorted(set(results['device'].to_list()))}")
    # (Said as soon as the sweep's results are in: a smoke cut later still says it.)
    print(f"smoke: no HTML report here; where the Jupyter stack is: quantdask report "
          f"{out / 'sweep'}", flush=True)
    print_tasks(tasks, results)
    for ok, what in task_checks(tasks, results, TASK_LIMIT[args.dry_run]):
        check(ok, what)
    samples = qd.read_device_samples(out / "sweep")
    check(samples.height > 0 and bool((samples["memory_total_bytes"] > 0).all()),
          f"{samples.height} device samples with memory totals")
    size = dict(zip(ao["config_label"], ao["size_bytes"], strict=True))
    check(ao.height == 3 and (ao["status"] == "done").all(),
          f"torchao int8 and int4 on a bfloat16 model: {ao['status'].to_list()}")
    check(bool(size.get("ao int4wo g128")) and size["ao int4wo g128"] < size["ao int8wo"],
          f"torchao int4's size counts no layout padding: below int8's "
          f"({size.get('ao int4wo g128')} < {size.get('ao int8wo')} bytes)")
    print_speed(speed, fast)
    for ok, what in speed_checks(speed, fast, DRY_SPEED if args.dry_run else SPEED,
                                 device_pattern):
        check(ok, what)

    shared = {"workers": 1} if args.dry_run else {"gpus": [0]}
    held = register_backend(held_backend(get_backend("bitsandbytes"), out / "rendezvous"),
                            replace=True).name
    with stages("packed sweep (its own cluster)"):
        with qd.start_cluster(jobs_per_worker=2, **shared) as cluster:
            packed = qd.run_sweep(sweep("smoke-shared", jobs_per_gpu=2, dry_run=args.dry_run,
                                        configs=2, backend=held), out / "shared", cluster.client)
    # Its two configs met inside their quantize phases (held_backend): they ran at once,
    # whatever the timing. Jobs whose attempts overlapped none ran alone: the bitsandbytes
    # sweep's above (one job per worker), and any packed one so placed. The others (the
    # packed baseline) are not judged: their spans may or may not have overlapped.
    done = packed.filter(packed["status"] == "done")
    met = done.filter(done["backend"] == held)["job_id"].to_list()
    alone = ran_alone(packed)
    print_packed(packed, met, alone)
    check(len(met) == 2, f"two jobs ran at once on one {'slot' if args.dry_run else 'GPU'} "
                         f"({len(met)} packed jobs met inside their measured spans; "
                         f"{packed['status'].to_list()})")
    flag = dict(zip(packed["job_id"], packed["peak_shared"], strict=True))
    flagged = [flag[job] for job in sorted(met)]
    alone_flags = [flag[job] for job in sorted(alone)] + results["peak_shared"].to_list()
    check(len(met) == 2 and all(flagged) and not any(alone_flags),
          f"the peaks of jobs that ran at once are flagged shared ({flagged}), of jobs that ran "
          f"alone not ({len(alone)} packed, {results.height} one per worker: {alone_flags})")
    tags = qd.read_device_samples(out / "shared")["job_id"].drop_nulls().to_list()
    check(any("," in tag for tag in tags),
          f"samples taken while two jobs ran carry both ({sum(',' in t for t in tags)} of "
          f"{len(tags)} job samples)")

    with stages("tests/test_gpu.py"):
        ok, summary = run_gpu_tests(out, args.dry_run)
    check(ok, f"tests/test_gpu.py: {summary}")


if __name__ == "__main__":
    sys.exit(main())
