"""The Dask dashboard a sweep prints is the real one: its Bokeh apps, served on 127.0.0.1."""

from __future__ import annotations

import urllib.request
from urllib.parse import urlsplit

import pytest

from quantdask.run.sweep import run_sweep
from quantdask.sweepfile.sweep_file import sweep_from_dict
from tests.conftest import REPO, sweep_dict

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PAGES = ("/status", "/individual-task-stream")


def fetch(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.read().decode("utf-8", "replace")


def test_the_task_stream_and_status_pages_are_bokeh_apps_while_a_sweep_runs(cluster, tmp_path):
    link = urlsplit(cluster.dashboard_link)
    assert link.hostname == "127.0.0.1", cluster.dashboard_link
    pages: dict[str, tuple[int, str]] = {}

    def fetch_while_running(progress) -> None:
        # On the driver's thread while jobs run: what a user opening the link then would see.
        if not pages and progress.running:
            for path in PAGES:
                pages[path] = fetch(f"http://127.0.0.1:{link.port}{path}")

    # One job 1.5 s longer (asleep): progress updates (4 a second) surely come while it runs.
    data = sweep_dict(name="dash", backends=[{"backend": "bitsandbytes", "grid": {
        "bits": [4], "quant_type": ["nf4", "fp4"], "double_quant": [False, True]}}],
        faults=[{"config": "nf4", "attempt": 1, "kind": "slow"}])
    results = run_sweep(sweep_from_dict(data), tmp_path / "run", cluster.client,
                        on_progress=fetch_while_running)
    assert results["status"].to_list() == ["done"] * 5
    assert set(pages) == set(PAGES), "no progress update came while a job ran"
    for path, (status, html) in pages.items():
        assert status == 200, path
        assert "needs bokeh" not in html, f"{path}: {html[:300]}"
        # A Bokeh server document: BokehJS loaded and the app's document embedded.
        assert "bokeh" in html.lower() and "Bokeh.embed" in html, f"{path}: {html[:300]}"


def test_the_readme_says_how_to_open_the_task_stream():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Watching a sweep", 1)[1].split("\n## ", 1)[0]
    for path in PAGES:
        assert path in section, path
    assert "cluster.dashboard_link" in section and "127.0.0.1" in section
