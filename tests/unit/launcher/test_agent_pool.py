"""Which launches a warm pool process may serve (launcher/agent_pool.py); the jobs themselves are
in tests/integration/test_agent_pool.py."""

from __future__ import annotations

import json

from fleetwise.launcher import agent_pool
from fleetwise.launcher.agent_pool import POOL_VAR, signature, start_pooled


def test_the_signature_is_the_environment_read_as_the_interpreter_and_torch_start():
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "MALLOC_ARENA_MAX": "2"}
    same = signature(base)
    assert signature({**base, "PATH": "/bin", "PYTEST_CURRENT_TEST": "x", "RANDOM_VAR": "1"}) == same
    for key, value in (("OMP_NUM_THREADS", "2"), ("OMP_WAIT_POLICY", "ACTIVE"), ("MALLOC_ARENA_MAX", "4"),
                       ("PYTHONHASHSEED", "0"), ("TORCH_SHOW_CPP_STACKTRACES", "1"), ("LD_PRELOAD", "x.so"),
                       ("LANG", "C"), ("LC_ALL", "C")):  # fmt: skip
        assert signature({**base, key: value}) != same, key


def test_no_pool_without_the_variable_or_from_other_namespaces(tmp_path, monkeypatch):
    monkeypatch.setenv(POOL_VAR, "")
    assert start_pooled(["python", "-m", "agent"], {}, 1) is None
    agent_pool.open_pool(tmp_path)
    (tmp_path / agent_pool.NAMESPACES_FILE).write_text(json.dumps({"net": "net:[1]", "mnt": "mnt:[1]"}))
    assert start_pooled(["python", "-m", "agent"], {}, 1) is None  # a test's network namespace as a host
    assert not list(tmp_path.glob("*.sock"))  # and no pool process started for it
