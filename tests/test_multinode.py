"""Beyond one machine: separate `dask` processes as nodes, a node lost mid-sweep, placement by
device memory, adaptive scaling, TLS, and the SLURM recipe's job script."""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import logging
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest
import yaml
from conftest import sweep_dict, with_slow_jobs
from dask_processes import DaskProcesses
from distributed import Client
from distributed.security import Security

from quantdask.cluster.local import Adapt, start_cluster, tls_security
from quantdask.errors import PlacementError, SpecError
from quantdask.plan.placement import slot_memories
from quantdask.run.sweep import run_sweep
from quantdask.store.readers import read_attempts, read_results
from quantdask.sweepfile.sweep import DEVICE_MEMORY
from quantdask.sweepfile.sweep_file import sweep_from_dict

QUANTDASK = str(Path(sys.executable).parent / "quantdask")
BNB = "bitsandbytes"
FOUR_BIT = {"backend": BNB, "grid": {"bits": [4], "quant_type": ["nf4", "fp4"],
                                     "double_quant": [False, True]}}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """Two `dask worker` nodes ("node-1", "node-2": nanny and all) and their scheduler, every
    connection over TLS with certificates made here (``Nodes``), shared by the tests below in
    order: the first checks who gets in, the next kills node-2 mid-sweep, the next runs on
    node-1 alone, the last takes node-1 away for good."""
    directory = tmp_path_factory.mktemp("nodes")
    tls = make_certificates(directory)
    nodes = DaskProcesses(directory, tls)
    try:
        address = nodes.start_scheduler()
        for name in ("node-1", "node-2"):
            # One thread each: Dask queues a second task on a node while one runs.
            nodes.start_worker(name)
        security = tls_security(*tls)
        wait_for_workers(address, {"node-1", "node-2"}, security)
        yield Nodes(nodes, address, tls, security)
    finally:
        nodes.close()


@dataclasses.dataclass(frozen=True)
class Nodes:
    """The shared nodes: their processes, the scheduler's address, the certificates."""

    processes: DaskProcesses
    address: str
    tls: tuple[str, str, str]  # (ca, cert, key) PEM paths
    security: Security

    def tls_args(self) -> list[str]:
        """The same certificates as `quantdask run` takes them."""
        ca, cert, key = self.tls
        return ["--tls-ca-file", ca, "--tls-cert", cert, "--tls-key", key]


def wait_for_workers(address: str, names: set[str], security=None, timeout_s: float = 90):
    """Wait until the scheduler's workers are exactly ``names``; return their resources."""
    with Client(address, security=security) as client:
        def workers() -> dict:
            return {str(w["name"]): w["resources"]
                    for w in client.scheduler_info(n_workers=-1)["workers"].values()}

        wait_until(lambda: set(workers()) == names, timeout_s, f"workers {sorted(names)}")
        return workers()


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


# -- separate `dask worker` processes: a node lost mid-sweep -------------------------------------


@pytest.mark.timeout(300)
def test_nodes_over_tls_let_in_only_certificates_from_their_ca(two_nodes, tmp_path):
    # The sweeps through the shared nodes (the tests below) run over the same TLS.
    assert two_nodes.address.startswith("tls://127.0.0.1:")
    wait_for_workers(two_nodes.address, {"node-1", "node-2"}, two_nodes.security)
    # Without a certificate from this CA nobody gets in: not plain TCP, not TLS with a
    # certificate from another CA.
    (tmp_path / "other").mkdir()
    plain = "tcp://" + two_nodes.address.removeprefix("tls://")
    for where, security in ((plain, None), (two_nodes.address,
                                            tls_security(*make_certificates(tmp_path / "other")))):
        with pytest.raises((OSError, TimeoutError)):
            Client(where, security=security, timeout=3)
    assert two_nodes.processes.listening_addresses() == {"127.0.0.1"}
    # A local cluster takes the same settings: every address it has is tls://.
    with start_cluster(workers=1, security=two_nodes.security,
                       dashboard_address=None) as cluster:
        assert cluster.client.scheduler.address.startswith("tls://127.0.0.1:")
        assert all(a.startswith("tls://127.0.0.1:")
                   for a in cluster.client.scheduler_info()["workers"])


@pytest.mark.timeout(420)
def test_a_sweep_over_tls_through_scheduler_survives_a_node_killed_mid_sweep(two_nodes,
                                                                              tmp_path):
    # node-2 is killed here; the tests after it use node-1 alone
    nodes, address = two_nodes.processes, two_nodes.address
    resources = wait_for_workers(address, {"node-1", "node-2"}, two_nodes.security)
    # Each worker advertises its device memory (here a CPU slot: what its nanny lets jobs use
    # of its memory limit, process.slot_memory).
    with Client(address, security=two_nodes.security) as client:
        limits = {str(w["name"]): w["memory_limit"]
                  for w in client.scheduler_info(n_workers=-1)["workers"].values()}
        slots = slot_memories(client)
    assert {name: r["GPU"] for name, r in resources.items()} == dict.fromkeys(limits, 1)
    assert {name: r[DEVICE_MEMORY] for name, r in resources.items()} == {
        name: int(0.95 * limit) - slots[name].resting for name, limit in limits.items()}
    data = sweep_dict(name="nodes", retries=2, backends=[
        FOUR_BIT, {"backend": BNB, "grid": {"bits": [8], "int8_threshold": [0.0, 6.0]}}])
    # A second or two a job, of real work: with jobs that sleep instead (a slow fault), Dask
    # queued every quantized job on node-1 while node-2 ran the baseline, and none to kill
    # ever started on node-2.
    data["eval"].update(seq_len=128, samples=64)
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    with open(tmp_path / "driver.log", "wb") as log:
        driver = subprocess.Popen(
            [QUANTDASK, "run", str(sweep_file), "--scheduler", address, "--run-dir", str(run_dir),
             "--no-report", *two_nodes.tls_args()], stdout=log, stderr=subprocess.STDOUT)
    try:
        def quantizing_on_node_2() -> bool:
            # The driver prints each start within a quarter second (it writes to a file, so
            # plain lines); a quantized job runs a second or more, so the kill lands mid-job.
            log = (tmp_path / "driver.log").read_text()
            return bool(re.search(r"start +demo (nf4|fp4|int8)\S* .*on worker node-2", log))

        wait_until(quantizing_on_node_2, 180, "a quantized job starting on node-2")
        killed_at = dt.datetime.now(dt.UTC)
        nodes.kill("node-2")
        assert driver.wait(timeout=300) == 0, (tmp_path / "driver.log").read_text()
    finally:
        if driver.poll() is None:
            driver.kill()
    results = read_results(run_dir)
    jobs = 1 + 4 + 2  # the baseline, four 4-bit configs, two 8-bit
    assert f"{jobs} jobs: {jobs} done, 0 failed, 0 skipped" in (tmp_path / "driver.log").read_text()
    assert results.height == jobs and results["job_id"].n_unique() == jobs
    assert results["status"].to_list() == ["done"] * jobs
    attempts = read_attempts(run_dir)
    lost = attempts.filter(pl.col("failure_class") == "worker_lost")
    assert lost.height >= 1 and set(lost["worker"].drop_nulls()) <= {"node-2"}
    # Nothing ran on the dead node after it was killed; the others took its work.
    after = attempts.filter((pl.col("status") == "done") & (pl.col("started_at") > killed_at))
    assert after.height >= 1 and "node-2" not in after["worker"].to_list()
    assert nodes.listening_addresses() == {"127.0.0.1"}


@pytest.mark.timeout(300)
def test_jobs_queued_on_a_dead_worker_are_requeued_uncounted_and_the_last_is_never_retired(
        two_nodes, tmp_path, caplog):
    from quantdask.cluster.operations import retire_worker

    address, security = two_nodes.address, two_nodes.security
    wait_for_workers(address, {"node-1"}, security)  # node-2 was killed by the test above
    # nf4 goes first (the highest priority) and kills its worker; the others wait on that
    # worker meanwhile (Dask sends resource-restricted tasks to it at once).
    data = sweep_dict(name="requeue", retries=1,
                      backends=[{"backend": BNB, "priority": 10,
                                 "grid": {"bits": [4], "quant_type": ["nf4"]}},
                                {"backend": BNB, "grid": {"bits": [4], "quant_type": ["fp4"],
                                                          "double_quant": [False, True]},
                                 }, {"backend": BNB, "grid": {"bits": [8]}}],
                      faults=[{"config": "nf4", "attempt": 1, "kind": "kill"}])
    caplog.set_level(logging.INFO, logger="quantdask.driver")
    with start_cluster(address=address, security=security) as cluster:
        results = run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client)
        # The last worker is kept however it fails: a sweep without workers gets nowhere.
        assert retire_worker(cluster.client, "node-1") is False
        assert {str(w["name"]) for w in
                cluster.client.scheduler_info(n_workers=-1)["workers"].values()} == {"node-1"}
    attempts = dict(zip(results["config_label"], results["attempts"]))
    assert results["status"].to_list() == ["done"] * 5
    assert attempts.pop("nf4") == 2 and set(attempts.values()) == {1}
    # The job queued behind the killing one died with the worker before it began: requeued,
    # not counted (one attempt row per job but nf4's two).
    assert "was dropped before it started (KilledWorker); resubmitting" in caplog.text
    rows = read_attempts(tmp_path / "run")
    assert rows.height == 6 and rows["failure_class"].drop_nulls().to_list() == ["worker_lost"]


@pytest.mark.timeout(240)
def test_with_every_worker_gone_the_rest_fail_after_the_grace(two_nodes, tmp_path,
                                                               monkeypatch):
    import quantdask.run.loop

    monkeypatch.setattr(quantdask.run.loop, "NO_WORKERS_GRACE_S", 3.0)
    # node-1, taken away below: this test comes last of those on the shared nodes
    nodes, address, security = two_nodes.processes, two_nodes.address, two_nodes.security
    wait_for_workers(address, {"node-1"}, security)
    data = with_slow_jobs(sweep_dict(name="gone", retries=1, backends=[  # 1.5 s a job at least
        {"backend": BNB, "grid": {"bits": [8], "int8_threshold": [0.0, 3.0, 6.0]}}]))

    def lose_the_only_node(record) -> None:
        if nodes.processes["node-1"].poll() is None:
            nodes.kill("node-1")

    with start_cluster(address=address, security=security) as cluster:
        started = time.monotonic()
        results = run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client,
                            on_result=lose_the_only_node)
        took = time.monotonic() - started
    failed = results.filter(pl.col("status") == "failed")
    assert results.height == 4 and failed.height >= 2
    assert set(results["status"]) == {"done", "failed"}
    assert failed["failure_class"].to_list() == ["worker_lost"] * failed.height
    assert failed["error_class"].to_list() == ["NoWorkers"] * failed.height
    assert set(failed["error_message"]) == {"no worker left for 3s; the cluster is gone"}
    assert took < 120  # not a wait for workers that never come


# -- placement by device memory ----------------------------------------------------------------


@pytest.fixture(scope="module")
def placement_nodes(tmp_path_factory):
    """A scheduler and a small `dask worker` node (3 MB of device memory), shared by the
    placement tests below, in order: the first adds a large node (``add_large()``), the last
    takes it away. (One small node is enough: the 4-bit jobs fit both, the baseline only the
    large one.)"""
    nodes = DaskProcesses(tmp_path_factory.mktemp("placement"))
    try:
        address = nodes.start_scheduler()
        # The demo model's baseline needs ~5.4 MB by its estimate, its 4-bit configs ~1.8 MB:
        # the small worker can take a 4-bit job but never the baseline.
        nodes.start_worker("small-1", resources=f"GPU=1,{DEVICE_MEMORY}=3e6")
        wait_for_workers(address, {"small-1"})

        def add_large() -> None:
            if "large" not in nodes.processes:
                nodes.start_worker("large", resources=f"GPU=1,{DEVICE_MEMORY}=1e9")
            wait_for_workers(address, {"small-1", "large"})

        yield nodes, address, add_large
    finally:
        nodes.close()


@pytest.mark.timeout(360)
def test_large_jobs_land_only_on_the_large_worker_and_small_ones_spread(placement_nodes,
                                                                         tmp_path):
    nodes, address, add_large = placement_nodes
    data = sweep_dict(name="placed", backends=[FOUR_BIT])
    sweep = sweep_from_dict(data)
    run_dir = tmp_path / "run"
    with start_cluster(address=address) as cluster:
        with pytest.raises(PlacementError) as refused:
            run_sweep(sweep, run_dir, cluster.client)
    message = str(refused.value)
    assert "1 job(s) fit on no worker" in message
    assert "the largest device memory a worker advertises is 2.9 MiB = 3,000,000 bytes" in message
    assert "demo baseline (none-" in message and "needs ~5.1 MiB = 5,358,201 bytes" in message
    assert "(checkpoint size and config)" in message and "fix: add a worker" in message
    assert not run_dir.exists()  # refused before anything was written

    add_large()
    with start_cluster(address=address) as cluster:
        results = run_sweep(sweep, run_dir, cluster.client)
    assert results.height == 5 and results["status"].to_list() == ["done"] * 5
    where = dict(zip(results["config_label"], results["worker"], strict=True))
    assert where.pop("baseline") == "large"
    # The 4-bit jobs may run on either worker: each asks for less device memory than the small
    # one advertises (which of the two takes which is Dask's, by timing: not asserted).
    assert len(where) == 4 and set(where.values()) <= {"small-1", "large"}, where
    asked = dict(read_attempts(run_dir).select("job_id", "device_memory_request_bytes").rows())
    for label, job_id in zip(results["config_label"], results["job_id"], strict=True):
        assert (asked[job_id] <= 3e6) == (label != "baseline"), (label, asked[job_id])


@pytest.mark.timeout(300)
def test_jobs_that_only_a_lost_worker_could_hold_fail_after_the_grace(placement_nodes, tmp_path,
                                                                      monkeypatch):
    """The large node leaves after placement, before anything is submitted. The demo model's
    reference fits only there: all its jobs, parked on it, fail once each with the numbers.
    A tiny model's reference and 4-bit job fit the small node and are done; its one large job
    (a backend estimated at 400 bits a weight) fails alone. None waits forever."""
    from tiny_families import build_tiny

    import quantdask.backends
    import quantdask.run.loop
    from quantdask.demo_model import DEMO_MODEL_DIR
    from quantdask.plan.placement import advertised_memory

    nodes, address, add_large = placement_nodes
    add_large()  # there already when the test above ran first
    monkeypatch.setattr(quantdask.run.loop, "NO_WORKERS_GRACE_S", 3.0)
    monkeypatch.setitem(quantdask.backends._REGISTRY, "fat", dataclasses.replace(
        quantdask.backends.get_backend(BNB), name="fat", sizing=dataclasses.replace(
            quantdask.backends.get_backend(BNB).sizing, weight_bits=lambda options, bits: 400)))
    tiny = build_tiny("llama", tmp_path / "tiny")
    data = sweep_dict(name="unfit", models=[{"name": "demo", "path": DEMO_MODEL_DIR},
                                            {"name": "tiny", "path": str(tiny)}], backends=[
        {"backend": BNB, "grid": {"bits": [4]}}, {"backend": "fat", "grid": {"bits": [8]}}])
    data["eval"]["batch_size"] = 2  # the tiny model's logits (1,024 tokens) fit a small node
    with start_cluster(address=address) as cluster:
        def lose_the_large_node(progress) -> None:
            # The first progress update comes after placement, before anything is submitted.
            if nodes.processes["large"].poll() is None:
                nodes.kill("large")
                wait_until(lambda: set(advertised_memory(cluster.client)) == {"small-1"}, 60,
                           "the scheduler to see the large worker gone")

        started = time.monotonic()
        results = run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client,
                            on_progress=lose_the_large_node)
        took = time.monotonic() - started
    rows = {(r["model"], r["backend"]): r for r in results.to_dicts()}
    assert len(rows) == results.height == 6
    demo = [rows["demo", backend] for backend in ("none", BNB, "fat")]
    assert [(r["status"], r["failure_class"], r["error_class"], r["attempts"]) for r in demo] == [
        ("failed", "worker_lost", "NoWorkerFits", 1)] * 3
    (message,) = {r["error_message"] for r in demo}
    need = re.fullmatch(r"its model's reference needs ([\d,]+) bytes of device memory; no worker "
                        r"has had that much for 3s \(the most now: 3,000,000\)", message)
    assert need and int(need[1].replace(",", "")) > 3_000_000, message
    assert rows["tiny", "none"]["status"] == rows["tiny", BNB]["status"] == "done"
    fat = rows["tiny", "fat"]
    assert (fat["status"], fat["failure_class"], fat["error_class"], fat["attempts"]) == (
        "failed", "worker_lost", "NoWorkerFits", 1)
    assert re.fullmatch(r"needs [\d,]+ bytes of device memory; no worker has had that much "
                        r"for 3s \(the most now: 3,000,000\)", fat["error_message"])
    assert took < 90


# -- adaptive scaling --------------------------------------------------------------------------


@pytest.mark.timeout(360)
def test_an_adaptive_cluster_grows_while_jobs_wait_and_shrinks_when_done(tmp_path):
    # Enough work (5 jobs, 4 of them 1.5 s or more: a slow fault) to outlast the new workers'
    # start (forked from a warm server: well under a second).
    data = with_slow_jobs(sweep_dict(name="adaptive", backends=[FOUR_BIT]))
    sweep = sweep_from_dict(data)
    adapt = Adapt(minimum=1, maximum=3, interval_s=0.5, idle_s=2.0, target_duration_s=1.0)
    counts: list[tuple[float, int]] = []
    with start_cluster(adapt=adapt, dashboard_address=None) as cluster:
        assert cluster.n_workers == 1
        outcome = {}
        runner = threading.Thread(target=lambda: outcome.setdefault(
            "results", run_sweep(sweep, tmp_path / "run", cluster.client)))
        start = time.monotonic()
        runner.start()
        while runner.is_alive():
            counts.append((time.monotonic() - start, cluster.n_workers))
            time.sleep(0.25)
        runner.join()
        assert "results" in outcome, "run_sweep raised; see the log above"
        done_at = time.monotonic() - start
        wait_until(lambda: cluster.n_workers == 1, 60, "the cluster to shrink back to 1")
        shrunk_at = time.monotonic() - start
    results = outcome["results"]
    assert results.height == 5 and results["status"].to_list() == ["done"] * 5
    peak = max(n for _, n in counts)
    assert 2 <= peak <= 3, counts
    assert results["worker"].n_unique() >= 2  # the added workers took jobs
    print(f"adaptive: peak {peak} workers while jobs waited; sweep done at {done_at:.1f}s, "
          f"back to 1 worker at {shrunk_at:.1f}s")


def test_adapt_settings_are_checked_and_parsed():
    assert Adapt.parse("0:4") == Adapt(0, 4)
    for bad, field in (("4", "adapt"), ("a:b", "adapt"), ("3:2", "adapt.maximum"),
                       ("0:0", "adapt.maximum"), ("-1:2", "adapt.minimum")):
        with pytest.raises(SpecError) as err:
            Adapt.parse(bad)
        assert err.value.field == field
    with pytest.raises(SpecError, match="adapt: a scheduler reached by address cannot scale"):
        start_cluster(address="tcp://127.0.0.1:1", adapt=Adapt(1, 2))


def test_adaptive_never_asks_for_more_gpu_workers_than_gpus(monkeypatch):
    import quantdask.cluster.local

    monkeypatch.setattr(quantdask.cluster.local, "cuda_device_count", lambda: 2)
    with pytest.raises(SpecError) as err:  # refused before dask-cuda is imported
        start_cluster(adapt=Adapt(1, 4))
    assert err.value.field == "adapt.maximum"
    assert "4 workers, but 2 GPU(s) chosen: one worker per GPU, so at most 2" in str(
        err.value)
    with pytest.raises(SpecError, match="2 workers, but 1 GPU"):
        start_cluster(gpus=[1], adapt=Adapt(0, 2))


# -- TLS ---------------------------------------------------------------------------------------


def make_certificates(directory: Path) -> tuple[str, str, str]:
    """A CA and one certificate it signs for 127.0.0.1/localhost (client and server use)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("quantdask test CA"))
          .issuer_name(name("quantdask test CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now)
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = directory / "ca.pem", directory / "node.pem", directory / "node-key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return tuple(str(p) for p in paths)


def test_tls_options_name_what_is_missing(tmp_path, capsys, monkeypatch):
    from quantdask.cli.main import main

    monkeypatch.chdir(tmp_path)
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(sweep_dict()))
    assert main(["run", str(sweep_file), "--tls-cert", str(tmp_path / "x.pem")]) == 2
    assert "--tls-ca-file: TLS needs both --tls-ca-file and --tls-cert" in capsys.readouterr().err
    assert main(["run", str(sweep_file), "--tls-ca-file", str(tmp_path / "ca.pem"),
                 "--tls-cert", str(tmp_path / "x.pem")]) == 2
    assert "tls_ca_file: no file at" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# -- SLURM -------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_the_slurm_recipe_renders_a_gpu_worker_job_script():
    from quantdask.cluster.slurm import slurm_cluster

    cluster = slurm_cluster(scheduler_host="127.0.0.1", dashboard_address="127.0.0.1:0",
                            queue="gpu", account="ml", cpus_per_gpu=8, memory="64GB",
                            walltime="02:00:00", jobs_per_gpu=2,
                            job_script_prologue=["source /opt/quantdask/.venv/bin/activate"])
    try:
        script = cluster.job_script()
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    finally:
        cluster.close()
    lines = script.splitlines()
    for directive in ("#SBATCH -p gpu", "#SBATCH -A ml", "#SBATCH --cpus-per-task=8",
                      "#SBATCH -t 02:00:00", "#SBATCH --gres=gpu:1"):
        assert directive in lines, script
    assert "source /opt/quantdask/.venv/bin/activate" in lines
    worker = next(line for line in lines if "distributed.cli.dask_worker" in line)
    assert cluster.scheduler_address in worker
    for flag in ("--nthreads 2", "--resources GPU=1", "--preload quantdask.preload", "--nanny"):
        assert flag in worker, worker
