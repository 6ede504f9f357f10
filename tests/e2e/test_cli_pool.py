"""The suite's warm launchers (helpers/cli_pool.py): `run_cli` forked from a pool server answers
exactly what the console script as a new interpreter answers, with the call's environment, working
directory, argv and exit code -- else every test using `run_cli` would check something else than
what users run."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from helpers.cli import run_cli
from helpers.repo import REPO

from fleetwise.launcher.agent_pool import POOL_VAR

EXE = str(Path(sys.executable).parent / "fleetwise")


def cold(*args, cwd=None, env=None):
    return subprocess.run(
        [EXE, *args], capture_output=True, text=True, cwd=cwd, timeout=120, env={**os.environ, **(env or {})}
    )


def servers(pool: Path) -> set[str]:
    return {p.read_text() for p in pool.glob("cli-*.pid")}


def test_a_pooled_launcher_answers_what_a_new_interpreter_answers(tmp_path, own_pool):
    # without a pool (FLEETWISE_AGENT_POOL empty: the smoke test, cold_agents) no server is started
    r = run_cli("validate", "recipe=gpt/tiny", env={POOL_VAR: ""}, cwd=tmp_path)
    assert r.returncode == 0 and "valid" in r.stdout
    assert not servers(own_pool)
    # stdout, exit 0 (a plan as JSON); stderr, exit 2 (every problem of a bad config)
    for args in (
        ("plan", "recipe=gpt/tiny", "strategy=hybrid", "strategy.mp_degree=2", "--json"),
        ("validate", "recipe=gpt/tiny", "strategy.dp_degree=3", "train.stepz=2"),
    ):
        warm, new = run_cli(*args, cwd=tmp_path), cold(*args, cwd=tmp_path)
        assert (warm.returncode, warm.stdout, warm.stderr) == (new.returncode, new.stdout, new.stderr), args
    assert new.returncode == 2 and "dp_degree(3)" in new.stdout + new.stderr
    assert len(servers(own_pool)) == 1, "the calls above were not served by one pool server"

    # the call's environment: a user config tree named by FLEETWISE_CONFIG_DIR
    tree = tmp_path / "tree"
    (tree / "recipe").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "gpt" / "tiny.yaml", tree / "recipe" / "mine.yaml")
    env = {"FLEETWISE_CONFIG_DIR": str(tree)}
    assert run_cli("validate", "recipe=mine", env=env).returncode == 0
    assert run_cli("validate", "recipe=mine").returncode == 2  # the pool server's own is not it

    # the call's working directory: --config-dir relative to it
    mynet = REPO / "examples" / "mynet"
    assert run_cli("validate", "--config-dir", "my_conf", "recipe=mynet", cwd=mynet).returncode == 0
    assert run_cli("validate", "--config-dir", "my_conf", "recipe=mynet", cwd=tmp_path).returncode == 2
