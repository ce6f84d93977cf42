"""The run directory: the results schema, atomic writes of results, attempts, layers and
samples (``run_store``), the readers, and the summaries computed from the frames."""
