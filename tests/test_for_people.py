"""What a new user meets: a terminal without the libraries' noise (unless -v), and inputs that
used to start a cluster refused up front with exit 2 and one line naming the field."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from quantdask.cli import main
from quantdask.demo_model import DEMO_MODEL_DIR
from tests.conftest import OUR_LINE, REPO, sweep_dict

pytestmark = pytest.mark.timeout(300)

NOTICES = ("Failed to load", "kernels-community", "is an Enum subclass")


def quantdask(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantdask", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=280,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.slow
def test_v_shows_the_libraries_notices_that_a_plain_run_leaves_out(write_sweep, tmp_path):
    # Without -v the terminal carries quantdask's lines only (OUR_LINE): the demo run from the
    # wheel checks that, task accuracy and all (tests/test_install.py). The libraries' notices
    # come as they are imported: a sweep without tasks shows them.
    loud = quantdask("-v", "run", write_sweep(name="loud.yaml"), "--workers", "1",
                     "--no-report", "--run-dir", "loud", cwd=tmp_path)
    assert loud.returncode == 0, loud.stderr[-2000:]
    assert any(notice in loud.stderr for notice in NOTICES)
    assert not all(OUR_LINE.match(line) for line in loud.stderr.splitlines() if line.strip())


def model_of_type(tmp_path, model_type: str, **extra) -> str:
    copy = tmp_path / "model"
    shutil.copytree(DEMO_MODEL_DIR, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": model_type, **extra}))
    return str(copy)


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_model_type_transformers_does_not_know_is_refused_before_a_cluster(
        command, tmp_path, write_sweep, capsys):
    data = sweep_dict(models=[{"name": "x", "path": model_of_type(tmp_path, "llama9000")}])
    assert main([command, write_sweep(data), "--run-dir", str(tmp_path / "run")]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("quantdask: error: models[0].path: ") and err.count("\n") == 1
    assert "model_type 'llama9000'" in err and "pip install -U transformers" in err
    assert "workers" not in out and not (tmp_path / "run").exists()


def test_a_model_with_its_own_code_is_pointed_at_trust_remote_code(tmp_path):
    from quantdask.errors import SpecError
    from quantdask.sweepfile.model import ModelSpec

    path = model_of_type(tmp_path, "mine", auto_map={"AutoConfig": "configuration.MyConfig"})
    with pytest.raises(SpecError, match="set trust_remote_code: true"):
        ModelSpec(path=path)
    ModelSpec(path=path, trust_remote_code=True)  # its code would be loaded: accepted


def test_artifacts_to_a_url_without_its_filesystem_are_refused(tmp_path, write_sweep, capsys):
    pytest.importorskip("fsspec")
    try:
        import s3fs  # noqa: F401
        pytest.skip("s3fs is installed here")
    except ImportError:
        pass
    data = sweep_dict(artifacts={"keep": "done", "to": "s3://bucket/models"})
    assert main(["run", write_sweep(data), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("quantdask: error: artifacts.to: s3://bucket/models needs")
    assert "pip install s3fs" in err and "Traceback" not in err


def test_a_calibration_block_no_backend_uses_is_named_in_a_warning(write_sweep, caplog):
    from quantdask.demo_model import DEMO_EVAL_TEXT

    data = sweep_dict(calibration={"text": DEMO_EVAL_TEXT, "samples": 2, "seq_len": 16})
    with caplog.at_level(logging.WARNING, logger="quantdask.spec"):
        assert main(["plan", write_sweep(data)]) == 0
    [warning] = [r for r in caplog.records if r.name == "quantdask.spec"]
    assert warning.getMessage().startswith("calibration: no backend of this sweep calibrates")
