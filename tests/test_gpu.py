"""The GPU path for real: LocalCUDACluster and CUDA metrics. Skipped on machines without CUDA."""

from __future__ import annotations

import pytest

from quantdask.cluster.operations import cuda_device_count

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(cuda_device_count() == 0, reason="needs a CUDA GPU"),
]


def test_sweep_on_local_cuda_cluster_records_cuda_metrics(tmp_path):
    from quantdask.cluster.local import start_cluster
    from quantdask.demo_model import load_demo_sweep
    from quantdask.run.sweep import run_sweep

    with start_cluster(gpus=[0]) as cluster:
        assert cluster.kind == "cuda"
        assert cluster.dashboard_link.startswith("http://127.0.0.1:")
        # The GPU bundle carries no lm-eval: there the demo comes without its tasks.
        results = run_sweep(load_demo_sweep(), tmp_path / "run", cluster.client)
    assert results["status"].to_list() == ["done"] * results.height
    for row in results.to_dicts():
        assert row["device"] == "cuda:0"
        assert row["peak_device_mem_bytes"] > 0
        assert row["peak_device_reserved_bytes"] >= row["peak_device_mem_bytes"]
    from quantdask.store.readers import read_device_samples

    samples = read_device_samples(tmp_path / "run")  # real NVML readings
    assert set(samples["device"]) == {"cuda:0"} and samples["memory_used_bytes"].max() > 0
    assert samples["memory_total_bytes"].min() > 10 * 2**30
