"""The smoke test of `make check`: one real 2-rank job through `fleetwise train`."""

from __future__ import annotations

import math

import pytest
from helpers.cli import run_cli
from helpers.runs import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.smoke]


def test_a_two_rank_job_trains_and_writes_its_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli(
        "train",
        "recipe=gpt/tiny",
        "strategy=sharding",
        "strategy.sharding_stage=3",
        "hardware.devices_per_node=2",
        "train.steps=3",
        "tracking.enabled=false",
        f"run.dir={run_dir}",
        timeout=300,
        # the test session's own PASSIVE unset (the launcher's default), and its agent a new
        # interpreter, as users run it (not forked from the session's warm pool: agent_pool.py)
        env={"OMP_WAIT_POLICY": "", "FLEETWISE_AGENT_POOL": ""},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [m["step"] for m in records] == [1, 2, 3]
    assert all(math.isfinite(m["train/loss"]) and m["train/loss"] > 0 for m in records)
    # the plan the ranks used is the one the launcher wrote, and memory came out near it
    last = records[-1]
    assert 0.8 < last["memory/peak_bytes_max"] / last["memory/predicted_bytes"] < 1.25
    assert sorted(p.name for p in (run_dir / "logs").glob("rank_*.log")) == ["rank_0.log", "rank_1.log"]
    assert "final loss" in r.stdout
    assert "warm pool" not in (run_dir / "logs" / "launcher.log").read_text()  # a new agent, as users run
    # the ranks were forked from a preloaded fork server (not two more interpreters importing
    # torch), which is the agent itself (not one more interpreter importing what the agent has),
    # with the one intra-op thread torchrun gives ranks that share a node, waiting passively
    for log in (run_dir / "logs").glob("rank_*.log"):
        start_up = next(line for line in log.read_text().splitlines() if "start-up:" in line)
        assert "forked from the fork server (the agent), 1 threads (OpenMP waits: passive);" in start_up, start_up
