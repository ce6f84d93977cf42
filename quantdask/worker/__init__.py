"""What runs inside a Dask worker: the job (``job.run_job``), the unquantized reference
(``reference``), the model source, metrics and streaming logits, per-layer stats, coverage,
calibration, artifact saving, the device sampler, core sharing and the worker plugins.

The driver imports the small pieces it needs to submit work (keys, shard plans); nothing here
imports the driver."""
