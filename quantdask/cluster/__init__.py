"""Clusters: local CPU slots and dask-cuda GPU workers, adaptive scaling and TLS settings,
worker operations (restart, retire, capacity) and the SLURM recipe."""
