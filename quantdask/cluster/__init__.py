"""Clusters: local CPU slots and dask-cuda GPU workers, adaptive scaling and TLS settings
(``local``), worker operations such as restart, retire and capacity (``operations``), and the
SLURM recipe (``slurm``; ``from quantdask.cluster import slurm_cluster``)."""

from quantdask.cluster.slurm import slurm_cluster

__all__ = ["slurm_cluster"]
