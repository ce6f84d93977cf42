"""The sweep driver: the loop that submits jobs and collects outcomes (``sweep.run_sweep``), its
pure policy with an injected clock, retries, placement by device memory, planning, per-model
references, progress, scaling runs and artifact pruning."""
