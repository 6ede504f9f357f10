"""Fixtures and pytest hooks only: CPU-only settings, the console script, network namespaces, the
`slow` marker of the process-starting folders. What tests share besides fixtures is in tests/helpers/."""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from helpers.durations import file_seconds
from helpers.repo import netns_module


def pytest_configure(config):
    # Tests never touch a GPU and never talk to a tracking server unless they start one themselves.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    # Two test workers on two cores: torch's OpenMP threads (GNU OpenMP spins at barriers by
    # default) in this process and every one it starts sleep while they wait (launcher/torchrun.py
    # rank_thread_env: up to 3x a job's CPU under load). Read when torch loads, which is later.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # ... nor read the developer's own config tree (~/.config/fleetwise, where `fleetwise calibrate`
    # writes hardware/local.yaml: with one there the hardware group's key check read a local.yaml
    # that conf/ lacks and failed); tests that need a local profile make their own.
    os.environ["FLEETWISE_CONFIG_DIR"] = tempfile.mkdtemp(prefix="fleetwise-test-config-")
    # Jobs' torchrun agents forked from a warm pool process per test process (torch imported once,
    # launcher/agent_pool.py): ~4-5 CPU-s less a job; and run_cli's launchers from a server there
    # (helpers/cli_pool.py). FLEETWISE_TEST_COLD_AGENTS=1: every agent and launcher a new
    # interpreter, as users run them (the smoke test's always are).
    if not os.environ.get("FLEETWISE_TEST_COLD_AGENTS"):
        from fleetwise.launcher.agent_pool import open_pool

        config._fleetwise_agent_pool = Path(tempfile.mkdtemp(prefix="fleetwise-agents-"))
        open_pool(config._fleetwise_agent_pool)


def pytest_unconfigure(config):
    pool = getattr(config, "_fleetwise_agent_pool", None)
    if pool is not None:
        from fleetwise.launcher.agent_pool import close_pool

        close_pool(pool)
        shutil.rmtree(pool, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Every test that starts processes is `slow` (`make check` leaves them out): all of
    tests/integration (torchrun ranks) and tests/e2e (the console script, servers, a wheel build),
    plus the unit tests marked one by one.

    Files run longest first, by tests/DURATIONS.md (a file not in it first of all: it may be long):
    the workers (`make test` runs with --dist loadfile --no-loadscope-reorder) take files in this
    order, so that the last ones are short and both workers finish together. xdist's own order, by
    number of tests, left its one-test files of a minute (the dashboards, mixed precision) to the
    end: the last two minutes of a run had one worker idle."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "integration" in parts or "e2e" in parts:
            item.add_marker(pytest.mark.slow)
    seconds = file_seconds(Path(__file__).with_name("DURATIONS.md"))
    if seconds:  # a stable sort: each file's tests stay together and in their order
        root = Path(str(config.rootpath))
        items.sort(
            key=lambda item: -seconds.get(Path(str(item.fspath)).relative_to(root).as_posix(), math.inf)
        )


@pytest.fixture(scope="session")
def fleetwise_bin() -> str:
    """The installed console script (the same one users run)."""
    exe = Path(sys.executable).parent / "fleetwise"
    found = str(exe) if exe.exists() else shutil.which("fleetwise")
    assert found, "the fleetwise console script is not installed (pip install -e .)"
    return found


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


@pytest.fixture
def cold_agents(monkeypatch):
    """The jobs this test starts run their torchrun agent (and run_cli its launcher) as a new
    interpreter, as users run them, not forked from the session's warm pool (launcher/agent_pool.py,
    helpers/cli_pool.py): for tests that find a job's
    processes by their command line (a pooled agent's is the pool process's), or that need the
    seconds a new agent takes before the ranks start."""
    monkeypatch.setenv("FLEETWISE_AGENT_POOL", "")


@pytest.fixture
def own_pool(tmp_path, monkeypatch):
    """A warm pool of this test's own, empty (the session's is left alone), its processes stopped
    after: for tests of the pools themselves (test_agent_pool, test_cli_pool)."""
    from fleetwise.launcher.agent_pool import POOL_VAR, close_pool, open_pool

    directory = tmp_path / "pool"
    monkeypatch.setenv(POOL_VAR, "")  # restored after the test; open_pool points it here
    open_pool(directory)
    yield directory
    close_pool(directory)
