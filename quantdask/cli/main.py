"""The ``quantdask`` command's arguments: thin parsing over the commands (``commands``).

Exit codes: 0 all jobs done or skipped, 1 some job failed, 2 invalid input (nothing ran), 3 a
done job failed a gate.

The libraries' known notices (``process.library_noise``) stay off the terminal, here and in the
workers this command starts, unless ``-v`` is given.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from typing import NoReturn

from quantdask.cli.commands import (
    cmd_demo,
    cmd_logs,
    cmd_plan,
    cmd_report,
    cmd_run,
    cmd_scale,
    cmd_status,
)
from quantdask.cli.compare import cmd_compare
from quantdask.cli.exits import EXIT_BAD_INPUT, EXIT_FAILED_JOBS
from quantdask.cli.exports import cmd_export, cmd_export_allocation
from quantdask.cli.gguf_setup import cmd_gguf_setup
from quantdask.errors import (
    CompareError,
    PlacementError,
    QuantdaskError,
    RunDirError,
    SpecError,
)
from quantdask.process import library_noise
from quantdask.report.kernel import leave_out_iri_checker


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump: the message names the argument
        self.exit(EXIT_BAD_INPUT, f"quantdask: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _adapt(text: str):
    from quantdask.cluster.adapt import Adapt

    try:
        return Adapt.parse(text)
    except SpecError as err:
        raise argparse.ArgumentTypeError(err.message) from None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
    return value


def _worker_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be worker counts separated by commas, like 1,2,4; got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"must be positive counts like 1,2,4; got {text!r}")
    return counts


def _version() -> str:
    """The installed distribution's version (the package's own when run from a checkout that
    is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("quantdask")
    except PackageNotFoundError:
        from quantdask import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="quantdask", description="Quantize models across GPUs with Dask.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log every job event, and the libraries' notices")
    parser.add_argument("--version", action="version", version=f"quantdask {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_sweep_commands(commands)
    _add_run_dir_commands(commands)
    _add_compare_command(commands)
    _add_setup_commands(commands)
    _add_export_commands(commands)
    return parser


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", help="where results and logs go (default runs/<sweep name>)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=_positive_int, help="CPU slots (no GPU) to start")
    where.add_argument("--gpus", help="GPU ids to use, e.g. 0,1 (default: all)")
    where.add_argument("--scheduler", help="address of an existing Dask scheduler")
    p.add_argument("--host", default="127.0.0.1",
                   help="interface the local cluster binds to (default 127.0.0.1)")
    p.add_argument("--dashboard-address", default="127.0.0.1:0",
                   help="where the local cluster's Dask dashboard listens (default "
                        "127.0.0.1 on a free port; e.g. :8787 to expose it)")
    p.add_argument("--memory-limit", metavar="SIZE",
                   help="each CPU slot's Dask memory limit, e.g. 1600MiB: its nanny restarts a "
                        "slot past 95%% of it, and jobs are placed against that less the "
                        "slot's resting memory (CPU slots only)")
    p.add_argument("--adapt", type=_adapt, metavar="MIN:MAX",
                   help="let the local cluster grow while jobs wait and shrink when idle, "
                        "between MIN and MAX workers (on GPUs: at most one per GPU)")
    tls = p.add_argument_group(
        "TLS (mutual; see docs/beyond-one-machine.md, 'Secure transport')")
    tls.add_argument("--tls-ca-file", help="CA certificate (PEM) that signed every cert")
    tls.add_argument("--tls-cert", help="this driver's certificate (PEM); a local cluster "
                                        "uses it for its scheduler and workers too")
    tls.add_argument("--tls-key", help="the key of --tls-cert (if not in the cert file)")
    p.add_argument("--no-report", action="store_true",
                   help="do not write RUN_DIR/report.html at the end")


def _add_sweep_commands(commands) -> None:
    """The commands that take a sweep (or the demo's) and run or plan it."""
    run = commands.add_parser("run", help="run a sweep, then write its HTML report")
    run.add_argument("sweep", help="sweep YAML file")
    _add_cluster_args(run)
    run.set_defaults(func=cmd_run)

    scale = commands.add_parser("scale", help="run a sweep fresh at several worker counts")
    scale.add_argument("sweep", help="sweep YAML file")
    scale.add_argument("--workers", type=_worker_counts, default=[1, 2, 4],
                       help="worker counts, e.g. 1,2,4 (GPUs with GPUs, else CPU slots)")
    scale.add_argument("--out", help="a new directory for the runs and scaling.parquet "
                                     "(default runs/<sweep name>-scaling)")
    scale.add_argument("--host", default="127.0.0.1",
                       help="interface the local clusters bind to (default 127.0.0.1)")
    scale.add_argument("--repeats", type=int, default=None,
                       help="runs of each count, interleaved (1, 2, 1, 2, ...); default 3 for "
                            "a sweep of at most 16 jobs, else 1")
    scale.set_defaults(func=cmd_scale)

    plan = commands.add_parser("plan", help="show a sweep's jobs in scheduling order with "
                                             "estimates; runs nothing")
    plan.add_argument("sweep", help="sweep YAML file")
    plan.add_argument("--run-dir", help="where earlier results are (default runs/<sweep name>):"
                                        " finished jobs and the estimates come from there")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=cmd_plan)

    demo = commands.add_parser("demo", help="run the built-in demo sweep, a scaling "
                                             "measurement at 1 and 2 workers, and the report")
    _add_cluster_args(demo)
    demo.add_argument("--no-scaling", action="store_true",
                      help="skip the scaling measurement (RUN_DIR/scaling)")
    demo.set_defaults(func=cmd_demo)


def _add_run_dir_commands(commands) -> None:
    """The commands that read a run directory."""
    report = commands.add_parser("report", help="write a run directory's HTML report")
    report.add_argument("run_dir")
    report.add_argument("-o", "--output", help="HTML file to write (default RUN_DIR/report.html)")
    report.set_defaults(func=cmd_report)

    status = commands.add_parser("status", help="show a run directory's jobs")
    status.add_argument("run_dir")
    status.add_argument("--watch", action="store_true",
                        help="follow the running sweep live (reads RUN_DIR/progress.json)")
    status.add_argument("--interval", type=_positive_seconds, default=1.0,
                        help="seconds between looks (default 1)")
    status.set_defaults(func=cmd_status)

    logs = commands.add_parser(
        "logs", help="print a job's log (every attempt; a running one's lines so far)")
    logs.add_argument("run_dir")
    logs.add_argument("job_id", help="a job id, or its unique beginning")
    logs.set_defaults(func=cmd_logs)


def _add_compare_command(commands) -> None:
    compare = commands.add_parser(
        "compare", help="compare two run directories: environment, references, quality, "
                        "tasks, speed and memory, with paired tests and regression gates")
    compare.add_argument("run_a", help="the run compared against (before)")
    compare.add_argument("run_b", help="the run compared (after); differences are B - A")
    compare.add_argument("--fail-on", action="append", default=[], metavar="GATE",
                         help="exit 3 when METRIC is worse by N%% (relative to A) or by an "
                              "absolute amount, and significantly: 'kl_divergence worse by "
                              "5%%' (repeatable)")
    compare.add_argument("--pair", action="append", default=[], metavar="A_LABEL=B_LABEL",
                         help="compare A's config label with another of B's (repeatable)")
    compare.add_argument("--tolerance", action="append", default=[], metavar="METRIC=N%%",
                         help="the practical tolerance of a metric for its verdicts "
                              "(repeatable; task: every task metric)")
    compare.add_argument("--html", metavar="FILE", help="also write the compare report there")
    compare.set_defaults(func=cmd_compare)


def _add_setup_commands(commands) -> None:
    setup = commands.add_parser(
        "gguf-setup", help="extract llama.cpp's converter from the pinned llama-cpp-python "
                           "sdist (the gguf backend needs it; pip download, once)")
    setup.add_argument("--sdist", help="the sdist already downloaded (else pip downloads it)")
    setup.set_defaults(func=cmd_gguf_setup)


def _add_export_commands(commands) -> None:
    """``export <tracker> RUN_DIR``: a run directory into an experiment tracker; ``export
    allocation RUN_DIR``: a search's allocation as its runtime's file."""
    export = commands.add_parser("export", help="export a run directory to a tracker, or a "
                                                "search's allocation as a file")
    trackers = export.add_subparsers(dest="tracker", required=True, parser_class=_Parser,
                                     metavar="{mlflow,allocation}")
    allocation = trackers.add_parser(
        "allocation", help="the allocation a search chose at a budget, as the file its "
                           "runtime loads (GGUF: one .gguf with a type per tensor), from the "
                           "run's records: no probe runs again")
    allocation.add_argument("run_dir")
    allocation.add_argument("--search", required=True, metavar="NAME", help="the search")
    allocation.add_argument("--budget", required=True, type=float, metavar="BITS",
                            help="one of its budgets, in bits per weight")
    allocation.add_argument("--candidate", type=int, default=1, metavar="N",
                            help="which of the budget's candidates (default 1: the best)")
    allocation.add_argument("--to", required=True, metavar="DIR", help="where to write it")
    allocation.set_defaults(func=cmd_export_allocation)
    mlflow = trackers.add_parser("mlflow", help="one MLflow run per job, under a parent run "
                                                "with the report and Parquet files; only new "
                                                "jobs on a second export")
    mlflow.add_argument("run_dir")
    mlflow.add_argument("--tracking-uri", metavar="URI",
                        help="MLflow tracking URI (default MLFLOW_TRACKING_URI, else ./mlruns)")
    mlflow.add_argument("--experiment", metavar="NAME",
                        help="MLflow experiment (default the sweep's name)")
    mlflow.set_defaults(func=cmd_export)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verbose:  # the workers this command starts show the libraries' notices again
        os.environ[library_noise.SHOW_ENV] = "1"
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except (SpecError, RunDirError, PlacementError, CompareError) as err:
        print(f"quantdask: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except QuantdaskError as err:
        print(f"quantdask: error: {err}", file=sys.stderr)
        return EXIT_FAILED_JOBS



def command() -> NoReturn:
    """The ``quantdask`` program (its console script and ``python -m quantdask``): ``main()``
    on ``sys.argv``, then exit with its status.

    The exit skips Python's teardown of the modules (after the exit handlers have run, logging's
    flush among them): with torch and transformers imported, that teardown took about 2 s of
    CPU after the command had finished its work. An exception still ends the program as usual.
    Its reports' charts and notebooks are checked without jsonschema's IRI format checker
    (``leave_out_iri_checker``), as in the report kernel.
    """
    leave_out_iri_checker()
    status = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say there
            pass
    os._exit(status)
