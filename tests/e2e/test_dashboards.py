"""The dashboards as a person sees them: a real sweep (two jobs under one parent run), `fleetwise ui`
on its store, headless Chromium reading the rendered pages (scripts/dashboards.py does the looking).

Chromium comes from the OS packages; it is installed here when missing (apt-get, as root), and the
test is skipped, saying why, only where that is impossible.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "dashboards.py"


def _ensure_chromium() -> str | None:
    """The reason Chromium cannot be had, or None once it is installed."""
    if shutil.which("chromium") or shutil.which("chromium-browser"):
        return None
    if not shutil.which("apt-get") or os.geteuid() != 0:
        return "chromium is not installed and cannot be installed here (needs apt-get as root)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    r = subprocess.run(["apt-get", "install", "-y", "chromium"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, env=env)
        r = subprocess.run(["apt-get", "install", "-y", "chromium"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        return f"apt-get install chromium failed: {r.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.fixture(scope="module")
def dashboards():
    why = _ensure_chromium()
    if why:
        pytest.skip(why)
    spec = importlib.util.spec_from_file_location("dashboards", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ui_shows_runs_tags_charts_and_sweep_children(tmp_path, dashboards, monkeypatch):
    for key in [k for k in os.environ if k.startswith("MLFLOW_")]:
        monkeypatch.delenv(key)
    dashboards.train_sweep(tmp_path)
    failures = dashboards.look(tmp_path, tmp_path / "shots")
    assert failures == []
    for shot in ("runs.png", "charts.png"):
        png = (tmp_path / "shots" / shot).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a rendered page, not a blank one
