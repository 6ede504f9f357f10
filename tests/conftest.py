"""Shared fixtures: config composition helpers, CPU-only settings, the console script."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Tests never touch a GPU and never talk to a tracking server unless they start one themselves.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def compose(*overrides: str):
    """Compose + validate; returns (RunConfig | None, problems)."""
    from fleetwise.config.problems import ConfigError
    from fleetwise.config.validate import load_config

    try:
        return load_config(list(overrides)), []
    except ConfigError as err:
        return None, err.problems


@pytest.fixture(scope="session")
def fleetwise_bin() -> str:
    """The installed console script (the same one users run)."""
    exe = Path(sys.executable).parent / "fleetwise"
    found = str(exe) if exe.exists() else shutil.which("fleetwise")
    assert found, "the fleetwise console script is not installed (pip install -e .)"
    return found
