"""Bad sweeps and arguments: exit code 2, one line naming the field, nothing created."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from quantdask.cli import main
from tests.conftest import sweep_dict

pytestmark = pytest.mark.timeout(60)

BNB = "bitsandbytes"

BAD_SWEEPS = {
    "not yaml": ("name: [unclosed\n  models: {", "sweep"),
    "not a mapping": ("- just\n- a list\n", "sweep"),
    "binary file": (b"\x00\xff\xfe garbage", "sweep"),
    "python object tag": ("!!python/object/apply:os.system ['echo pwned']\n", "sweep"),
    "unknown top-level key": (sweep_dict(workers=3), "workers"),
    "missing models": ({k: v for k, v in sweep_dict().items() if k != "models"}, "models"),
    "models not a list": (sweep_dict(models={"path": "x"}), "models"),
    "missing model path": (sweep_dict(models=[{"path": "/nonexistent/model"}]), "models[0].path"),
    "unknown model key": (sweep_dict(models=[{"paht": "x"}]), "models[0].paht"),
    "unknown backend": (sweep_dict(backends=[{"backend": "gptq", "grid": {"bits": [4]}}]),
                        "backends[0].backend"),
    "unknown option": (sweep_dict(backends=[{"backend": BNB, "grid": {"bits": [4],
                                                                       "group": [64]}}]),
                       "backends[0].grid.group"),
    "3-bit": (sweep_dict(backends=[{"backend": BNB, "grid": {"bits": [3]}}]),
              "backends[0].grid.bits"),
    "bits as string": (sweep_dict(backends=[{"backend": BNB, "configs": [{"bits": "four"}]}]),
                       "backends[0].configs[0].bits"),
    "empty grid": (sweep_dict(backends=[{"backend": BNB, "grid": {}}]), "backends[0].grid"),
    "empty grid values": (sweep_dict(backends=[{"backend": BNB, "grid": {"bits": []}}]),
                          "backends[0].grid.bits"),
    "grid value not a list": (sweep_dict(backends=[{"backend": BNB, "grid": {"bits": 4}}]),
                              "backends[0].grid.bits"),
    "8-bit with quant_type": (sweep_dict(backends=[{"backend": BNB, "configs": [
        {"bits": 8, "quant_type": "nf4"}]}]), "backends[0].configs[0].quant_type"),
    "negative threshold": (sweep_dict(backends=[{"backend": BNB, "configs": [
        {"bits": 8, "int8_threshold": -1}]}]), "backends[0].configs[0].int8_threshold"),
    "missing eval text": (sweep_dict(eval={"text": "x.txt", "seq_len": 8}), "eval.text"),
    "bad seq_len": (sweep_dict(eval={**sweep_dict()["eval"], "seq_len": "long"}), "eval.seq_len"),
    "zero samples": (sweep_dict(eval={**sweep_dict()["eval"], "samples": 0}), "eval.samples"),
    "negative retries": (sweep_dict(retries=-2), "retries"),
    "seed out of range": (sweep_dict(seed=2**64), "seed"),
    "timeout not finite": (sweep_dict(timeout_s=float("nan")), "timeout_s"),
    "fault on no job": (sweep_dict(faults=[{"config": "nf8", "kind": "raise"}]),
                        "faults[0].config"),
    "unknown fault kind": (sweep_dict(faults=[{"config": "nf4", "kind": "segfault"}]),
                           "faults[0].kind"),
    "fault attempt zero": (sweep_dict(faults=[{"config": "nf4", "kind": "raise",
                                               "attempt": 0}]), "faults[0].attempt"),
    "negative backoff": (sweep_dict(retry_backoff_s=-1), "retry_backoff_s"),
    "timeout not a number": (sweep_dict(timeout_s="soon"), "timeout_s"),
    "bad dtype": (sweep_dict(models=[{"path": sweep_dict()["models"][0]["path"],
                                      "dtype": "int3"}]), "models[0].dtype"),
}


@pytest.mark.parametrize("command", ["plan", "run"])
@pytest.mark.parametrize("case", list(BAD_SWEEPS), ids=list(BAD_SWEEPS))
def test_bad_sweep_exits_2_naming_the_field(case, command, tmp_path, capsys, monkeypatch):
    content, field = BAD_SWEEPS[case]
    path = tmp_path / "sweep.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        import yaml

        path.write_text(yaml.safe_dump(content))
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "out"
    args = [command, str(path), "--run-dir", str(run_dir)]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"quantdask: error: {field}:"), lines[0]
    assert "Traceback" not in err
    assert not run_dir.exists() and not (tmp_path / "runs").exists()


def exit_code(args: list[str]) -> int:
    """``quantdask ARGS`` in this process; argparse's own errors exit through SystemExit."""
    try:
        return main(args)
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("args, expected", [
    (["run", "SWEEP", "--workers", "0"], "--workers"),
    (["run", "SWEEP", "--workers", "two"], "--workers"),
    (["run", "SWEEP", "--workers", "2", "--gpus", "0"], "--gpus"),
    (["run", "SWEEP", "--gpus", "a,b"], "gpus"),
    (["run", "SWEEP", "--gpus", "99"], "gpus"),
    (["run", "SWEEP", "--run-dir", "FILE"], "--run-dir"),
    (["run", "/nonexistent/sweep.yaml"], "sweep"),
    (["status", "/nonexistent/run"], "no run directory"),
    (["frobnicate"], "argument command"),
])
def test_bad_arguments_exit_2(args, expected, write_sweep, tmp_path, capsys, monkeypatch):
    sweep = write_sweep()
    (tmp_path / "FILE").write_text("not a directory")
    monkeypatch.chdir(tmp_path)
    args = [{"SWEEP": sweep, "FILE": str(tmp_path / "FILE")}.get(a, a) for a in args]
    assert exit_code(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "runs").exists()


def test_real_command_exit_code_and_single_line(write_sweep, tmp_path):
    sweep = write_sweep(sweep_dict(backends=[{"backend": BNB, "grid": {"bits": [3]}}]))
    proc = subprocess.run([sys.executable, "-m", "quantdask.cli", "plan", sweep],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "quantdask: error: backends[0].grid.bits: must be 4 or 8, got 3")
    assert proc.stdout == ""
