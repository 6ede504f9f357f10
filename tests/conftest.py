"""Shared fixtures: config composition helpers, CPU-only settings, the console script."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Tests never touch a GPU and never talk to a tracking server unless they start one themselves.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# ... nor read the developer's own config tree (~/.config/fleetwise, where `fleetwise calibrate`
# writes hardware/local.yaml: with one there the hardware group's key check read a local.yaml
# that conf/ lacks and failed); tests that need a local profile make their own.
os.environ["FLEETWISE_CONFIG_DIR"] = tempfile.mkdtemp(prefix="fleetwise-test-config-")


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


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None):
    """Run the fleetwise console script; returns the CompletedProcess (text)."""
    import subprocess

    exe = Path(sys.executable).parent / "fleetwise"
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, cwd=cwd, timeout=timeout, env=full_env
    )


def read_metrics(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def final_params(run_dir: Path) -> dict:
    """The model of the last checkpoint of a run, consolidated into one state dict."""
    import torch

    from fleetwise.runtime.checkpoint import export
    from fleetwise.runtime.checkpoint_files import complete_checkpoints

    last = complete_checkpoints(run_dir)[-1]
    out = run_dir / "final.pt"
    export(last, out)
    return torch.load(out, weights_only=True)


def pytest_collection_modifyitems(config, items):
    """Every test that starts processes is `slow` (`make check` leaves them out): all of
    tests/integration (torchrun ranks) and tests/e2e (the console script, servers, a wheel build),
    plus the unit tests marked one by one."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "integration" in parts or "e2e" in parts:
            item.add_marker(pytest.mark.slow)


def netns_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("netns_hosts", REPO / "scripts" / "netns_hosts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def netns_hosts():
    """make(n) -> scripts/netns_hosts.Hosts: n network namespaces as hosts (10.77.0.1, .2, ... on
    eth0), deleted at teardown with every process inside them; the test is skipped, saying why,
    only where namespaces cannot be created (not root, no iproute2)."""
    mod = netns_module()
    made = []

    def make(n: int):
        hosts = mod.Hosts(n)
        try:
            hosts.__enter__()
        except mod.NetnsUnavailable as err:
            pytest.skip(f"network namespaces cannot be created here: {err}")
        made.append(hosts)
        return hosts

    yield make
    for hosts in made:
        hosts.close()
