"""What each ``quantdask`` subcommand does, over the same library functions a notebook calls;
a run ends with its closing summary (``cli.summary``) and exit code (``cli.exits``)."""

from __future__ import annotations

import os
import sys

from quantdask.cli.exits import EXIT_FAILED_JOBS
from quantdask.cli.render import table
from quantdask.cli.summary import print_gate_failures, print_protocol, print_summary
from quantdask.errors import QuantdaskError, RunDirError, SpecError
from quantdask.store.run_store import RunStore, default_run_dir
from quantdask.words import BASELINE, PlanState, Status


def _security(args):
    """Dask security settings from the ``--tls-*`` options (None without them)."""
    from quantdask.cluster.local import tls_security

    given = [args.tls_ca_file, args.tls_cert]
    if not any(given) and not args.tls_key:
        return None
    if not all(given):
        raise SpecError("--tls-ca-file" if not args.tls_ca_file else "--tls-cert",
                        "TLS needs both --tls-ca-file and --tls-cert (and --tls-key unless "
                        "the cert file holds the key)")
    return tls_security(args.tls_ca_file, args.tls_cert, args.tls_key)


def _check_run_dir(path: str) -> str:
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunDirError(f"--run-dir {path} exists and is not a directory; give a directory")
    return path


def stream_lines(plan, stream: str) -> list[str]:
    """One line per model on streaming (``sweep-files.md#streaming``): when it streams, and
    what its largest job would need streamed against resident."""
    from quantdask.util import format_bytes

    lines = []
    for model, rows in plan.group_by("model", maintain_order=True):
        streamed = rows["est_streamed_bytes"].max()
        if stream == "never" or not streamed:
            continue
        when = ("every job streams (stream: always)" if stream == "always" else
                "its jobs stream where its weights and eval fit no worker (stream: auto)")
        lines.append(f"stream: {model[0]}: {when}; streamed one layer at a time they need "
                     f"~{format_bytes(streamed)}")
    return lines


def slot_memory_lines(client) -> list[str]:
    """What the CPU slots' memory limits mean, one line per limit: Dask's memory limit, where
    each slot's nanny restarts it, the slots' resting memory and what jobs are placed
    against (their offer, ``process.slot_memory``)."""
    from quantdask.plan.placement import slot_memories
    from quantdask.util import format_bytes

    def span(values: list[int]) -> str:
        low, high = min(values), max(values)
        return format_bytes(low) if low == high else f"{format_bytes(low)}-{format_bytes(high)}"

    by_limit: dict = {}
    for name, slot in sorted(slot_memories(client).items()):
        by_limit.setdefault((slot.limit, slot.terminate), []).append((name, slot))
    return [f"memory: {len(slots)} CPU slot(s), each with memory limit {format_bytes(limit)} "
            f"(Dask's memory_limit; its nanny restarts a slot past {terminate:.0%}, at "
            f"{format_bytes(slots[0][1].kill_line)}); resting "
            f"{span([s.resting for _, s in slots])}, so jobs are placed against "
            f"{span([s.offered for _, s in slots])}"
            for (limit, terminate), slots in by_limit.items()]


def _search_prices(sweep) -> list[str]:
    """Each search's description and its price from the model's shapes (``search.pricing``)."""
    from quantdask.plan.model_facts import model_facts
    from quantdask.search.pricing import check_budget_from_shapes, price_lines
    from quantdask.sweepfile.sweep import expand_grid

    jobs = expand_grid(sweep) if sweep.searches else []
    lines = []
    for search in sweep.searches:
        job = next(j for j in jobs if j.model.label == search.model)
        facts = model_facts(job)
        check_budget_from_shapes(sweep, search, facts)
        lines += [search.describe(), *price_lines(sweep, search, facts)]
    return lines


def cmd_plan(args) -> int:
    import json

    from quantdask.plan.planning import plan_sweep
    from quantdask.store.figures import bos_text
    from quantdask.sweepfile.sweep_file import load_sweep
    from quantdask.util import format_bytes, format_duration

    sweep = load_sweep(args.sweep)
    run_dir = args.run_dir or default_run_dir(sweep.name)
    plan = plan_sweep(sweep, run_dir)
    states = {s: plan.filter(plan["state"] == s).height for s in PlanState}
    to_run = plan.filter(plan["state"] == PlanState.TO_RUN)
    known = to_run["est_duration_s"].drop_nulls()
    if args.json:
        print(json.dumps({"sweep": sweep.name, "run_dir": run_dir, "jobs": plan.to_dicts(),
                          "searches": [s.describe() for s in sweep.searches],
                          "counts": states,
                          "est_work_s": float(known.sum()) if len(known) else None},
                         indent=1))
        return 0
    rows = [{**row, "est_gpu_memory": format_bytes(row["est_device_mem_bytes"]),
             "est_cpu_slot": format_bytes(row["est_host_rss_bytes"]),
             "est_time": format_duration(row["est_duration_s"]),
             "quantized": "-" if row["quantized_share"] is None or row["backend"] == BASELINE
             else f"{row['quantized_share']:.0%}"} for row in plan.to_dicts()]
    print(table(rows, ["order", "job_id", "model", "config_label", "priority", "state",
                        "quantized", "est_gpu_memory", "est_cpu_slot", "memory_from",
                        "peak_phase", "est_time"]))
    for row in plan.filter(plan["max_positions"].is_null()).unique("model",
                                                                   maintain_order=True).to_dicts():
        print(f"positions: {row['model']}: {row['positions_from']}; its lengths are not checked")
    for row in plan.filter(plan["state"] == PlanState.UNSUPPORTED).to_dicts():
        print(f"{PlanState.UNSUPPORTED}: {row['config_label']}: {row['reason']}")
    for model in sweep.models:
        print(f"eval windows of {model.label} (eval.bos: {sweep.eval.bos}): "
              f"{bos_text(sweep.eval_for(model).bos_token_id)}")
    for line in _search_prices(sweep):
        print(line)
    for line in stream_lines(plan, sweep.stream):
        print(line)
    work = (f"; about {format_duration(float(known.sum()))} of job time for the {len(known)} "
            "with an estimate" if len(known) else "")
    print(f"{plan.height} jobs: {states[PlanState.TO_RUN]} to run, "
          f"{states[PlanState.FINISHED]} finished, "
          f"{states[PlanState.UNSUPPORTED]} unsupported here{work}")
    return 0


def _run(sweep, args) -> int:
    from quantdask.cli.dashboard import LiveDashboard, PlainLog
    from quantdask.cluster.local import start_cluster
    from quantdask.run.sweep import refuse_early, run_sweep

    run_dir = _check_run_dir(args.run_dir or default_run_dir(sweep.name))
    RunStore(run_dir).check_unlocked()
    # The same check run_sweep makes on its client, made here before connecting to it.
    sweep.check_workers("--scheduler" if args.scheduler else None)
    refuse_early(sweep)  # the sweep and the models' files alone: before a cluster starts
    with start_cluster(workers=args.workers, gpus=args.gpus, address=args.scheduler,
                       host=args.host, dashboard_address=args.dashboard_address,
                       adapt=args.adapt, security=_security(args),
                       memory_limit=args.memory_limit,
                       jobs_per_worker=1 if args.scheduler else sweep.jobs_per_gpu) as cluster:
        print(f"quantdask: {cluster.n_workers} workers ({cluster.kind}); "
              f"Dask dashboard: {cluster.dashboard_link}", flush=True)
        for line in slot_memory_lines(cluster.client):
            print(line, flush=True)
        # A terminal gets the live dashboard; a pipe or a log file, timestamped lines.
        if sys.stdout.isatty():
            with LiveDashboard() as dashboard:
                results = run_sweep(sweep, run_dir, cluster.client,
                                    on_progress=dashboard.update)
        else:
            results = run_sweep(sweep, run_dir, cluster.client,
                                on_progress=PlainLog().update)
    return print_summary(run_dir, results)


def _write_report(run_dir: str, output: str | None = None) -> int:
    from quantdask.report.html import write_report

    print(f"report: running the report notebook on {run_dir} ...", flush=True)
    path = write_report(run_dir, output)
    print(f"report: {path} (opens offline; executed notebook: {path.with_suffix('.ipynb')})")
    return 0


def _run_and_report(sweep, args, scaling: bool = False) -> int:
    run_dir = args.run_dir = args.run_dir or default_run_dir(sweep.name)
    status = _run(sweep, args)
    if scaling:
        _demo_scaling(sweep, str(RunStore(run_dir).scaling_dir), args.host)
    if args.no_report:
        return status
    try:
        _write_report(run_dir)
    except QuantdaskError as err:
        # The results are safe on disk; say what failed and how to retry just the report.
        print(f"quantdask: error: the report failed ({err}); the results are kept: "
              f"`quantdask report {run_dir}` tries again", file=sys.stderr)
        return status or EXIT_FAILED_JOBS
    return status


def without_search(sweep):
    """``sweep``'s configs alone: no search, and no calibration block (which served only the
    search): what the demo's scaling step measures."""
    import dataclasses

    return dataclasses.replace(sweep, searches=[], calibration=None) if sweep.searches else sweep


def _demo_scaling(sweep, scaling_dir: str, host: str) -> None:
    """The demo's scaling measurement at 1 and 2 workers (1 on a one-GPU machine), of its
    configs' jobs: its search (probes and verifying jobs) run twice more would double the
    demo's minute (``quantdask scale`` measures a search's probing too). It never costs the
    report: a problem is printed and the report goes on without it."""
    from quantdask.run.scaling import SCALING_FILE, worker_counts_here

    if os.path.exists(os.path.join(scaling_dir, SCALING_FILE)):
        print(f"scaling: kept the earlier measurement in {scaling_dir} (delete it to measure "
              "again)")
        return
    if os.path.isdir(scaling_dir) and os.listdir(scaling_dir):
        print(f"scaling: {scaling_dir} holds an unfinished measurement; delete it to measure "
              "again")
        return
    if sweep.searches:
        print("scaling: the demo's configs, without its search", flush=True)
    try:
        _scale(without_search(sweep), worker_counts_here([1, 2]), scaling_dir, host)
    except QuantdaskError as err:
        print(f"scaling: skipped ({err})", file=sys.stderr)


def cmd_run(args) -> int:
    from quantdask.sweepfile.sweep_file import load_sweep

    return _run_and_report(load_sweep(args.sweep), args)


def cmd_demo(args) -> int:
    from quantdask.demo_model import DEMO_MODEL_DIR, build_demo_model, load_demo_sweep

    if not os.path.isfile(os.path.join(DEMO_MODEL_DIR, "config.json")):
        print(f"quantdask: building the demo model in {DEMO_MODEL_DIR} (once)", flush=True)
        build_demo_model()
    sweep = load_demo_sweep()
    args.run_dir = args.run_dir or default_run_dir(sweep.name)
    return _run_and_report(sweep, args, scaling=not args.no_scaling)


def cmd_report(args) -> int:
    if not os.path.isdir(args.run_dir):
        raise RunDirError(f"no run directory at {args.run_dir}")
    if not RunStore(args.run_dir).is_run_dir():
        raise RunDirError(f"{args.run_dir} is not a run directory (it has no results/); "
                          "give the --run-dir of a sweep")
    return _write_report(args.run_dir, args.output)


def _scale(sweep, counts: list[int], out: str, host: str, repeats: int | None = None) -> int:
    import polars as pl

    from quantdask.run.scaling import SCALING_FILE, scale_sweep, scaling_summary
    from quantdask.store.readers import read_results

    def announce(n, run_dir):
        print(f"scaling: {n} worker{'s' if n > 1 else ''} -> {run_dir}", flush=True)

    frame = scale_sweep(sweep, out, counts, host=host, on_count=announce, repeats=repeats)
    searched = frame["search_makespan_s"].is_not_null().any()
    phases = ["search_makespan_s", "search_scaling_speedup"] if searched else []
    # Both phases when the sweep searched: its probing scales apart from its jobs.
    print(table(frame.with_columns(pl.col("scaling_efficiency") * 100).to_dicts(),
                 ["workers", "repeat", "jobs", "done", "wall_s", "makespan_s",
                  "throughput_jobs_per_min", "scaling_speedup", "scaling_efficiency",
                  "jobs_makespan_s", "jobs_scaling_speedup", *phases, "load_average",
                  "other_cpu_share"]))
    for line in scaling_lines(scaling_summary(frame), searched):
        print(line)
    print(f"scaling: {os.path.join(out, SCALING_FILE)} "
          f"(python: quantdask.read_scaling({out!r}); notebook: {_notebook('scaling')})")
    failed = sum(read_results(run_dir).filter(pl.col("status") == Status.FAILED).height
                 for run_dir in frame["run_dir"])
    if failed:
        print(f"scaling: {failed} jobs failed (see each run directory's logs/jobs)")
    return EXIT_FAILED_JOBS if failed else 0


def _notebook(name: str) -> str:
    from quantdask.resources import notebooks_dir

    return os.path.join(notebooks_dir(), f"{name}.ipynb")


def scaling_lines(summary, searched: bool) -> list[str]:
    """Each count's median speedup with its spread and verdict, one line per phase, against
    the fewest workers (``run.scaling.scaling_summary``)."""
    lines = []
    for row in summary.iter_rows(named=True):
        if row["scaling_verdict"] is None:
            continue  # the fewest workers: what the others are measured against
        for name, label in (("scaling", "throughput"), ("jobs_scaling", "jobs"),
                            *([("search_scaling", "search")] if searched else [])):
            median = row[f"{name}_speedup"]
            if median is None:
                continue
            lines.append(f"scaling: {row['workers']} workers, {label}: {median:.2f}x median "
                         f"({row[f'{name}_speedup_min']:.2f}-{row[f'{name}_speedup_max']:.2f} "
                         f"over {row['runs']} runs): {row[f'{name}_verdict']}")
    return lines


def cmd_scale(args) -> int:
    from quantdask.sweepfile.sweep_file import load_sweep

    sweep = load_sweep(args.sweep)
    out = args.out or default_run_dir(sweep.name, "-scaling")
    return _scale(sweep, args.workers, out, args.host, args.repeats)


def cmd_status(args) -> int:
    from quantdask.store.summary import job_status

    if not os.path.isdir(args.run_dir):
        raise RunDirError(f"no run directory at {args.run_dir}")
    if args.watch:
        from quantdask.cli.dashboard import watch

        try:
            return watch(args.run_dir, interval_s=args.interval)
        except KeyboardInterrupt:
            return 0
    frame = job_status(args.run_dir)
    print(table(frame.to_dicts(), [c for c in ("job_id", "model", "config_label", "status",
                                                 "attempts", "worker", "perplexity",
                                                 "failure_class", "error_message")
                                     if c in frame.columns]))
    counts = frame.group_by("status").len().sort("status").rows()
    print(", ".join(f"{n} {status}" for status, n in counts) or "no jobs")
    print_protocol(RunStore(args.run_dir).read_results())
    _print_environment(args.run_dir)
    for excluded in RunStore(args.run_dir).read_excluded_workers():
        print(f"worker {excluded['worker']} taken out of rotation: {excluded['reason']}")
    return print_gate_failures(RunStore(args.run_dir).read_results())


def _print_environment(run_dir: str) -> None:
    """The latest session's environment, on one line (libraries not installed left out)."""
    from quantdask.process.environment import NOT_INSTALLED
    from quantdask.store.environment import latest_environment
    from quantdask.store.readers import read_environment

    env = latest_environment(read_environment(run_dir))
    shown = [f"{c} {v}" for c, v in env.items() if v != NOT_INSTALLED]
    print("environment: " + ("; ".join(shown) if shown else "not recorded (a run from before "
                                                             "quantdask recorded it)"))


def cmd_logs(args) -> int:
    store = RunStore(args.run_dir)
    if not store.job_logs_dir.is_dir():
        raise RunDirError(f"no job logs in {args.run_dir} (no logs/jobs/); give a run directory")
    ids = sorted(p.stem for p in store.job_logs_dir.glob("*.log"))
    matches = [i for i in ids if i == args.job_id] or [i for i in ids if i.startswith(args.job_id)]
    planned = {row["job_id"] for row in store.read_plan()}
    if not matches and args.job_id in planned:
        raise RunDirError(f"job {args.job_id} has no log yet: it has not started in "
                          f"{args.run_dir}")
    if len(matches) != 1:
        listed = ", ".join(matches or ids[:20]) + (" ..." if not matches and len(ids) > 20 else "")
        what = "matches several jobs" if matches else "matches no job"
        raise RunDirError(f"JOB_ID {args.job_id!r} {what} in {args.run_dir}; job ids: {listed}")
    sys.stdout.write(store.job_log_path(matches[0]).read_text(encoding="utf-8"))
    return 0
