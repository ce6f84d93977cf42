"""The ``quantdask`` command's exit codes: 0 all jobs done or skipped (and every done job met
the sweep's gates), 1 some job failed, 2 invalid input (nothing ran), 3 no job failed but a done
job failed a gate (or, for ``compare``, a comparison failed one)."""

EXIT_FAILED_JOBS = 1
EXIT_BAD_INPUT = 2
EXIT_GATE_FAILED = 3
