"""Warm agents (launcher/agent_pool.py): a job's torchrun agent forked from a pool process that
imported torch once -- what the suite's jobs run on -- is the agent a new interpreter would be."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from helpers.cli import run_cli

TINY = ("recipe=gpt/tiny", "optim=sgd", "tracking.enabled=false")


def _pooled_agent(run_dir: Path) -> int | None:
    for line in (run_dir / "logs" / "launcher.log").read_text().splitlines():
        if "forked from the warm pool" in line:
            return int(line.split()[1].rstrip(":"))
    return None


def _start_up(run_dir: Path) -> str:
    log = (run_dir / "logs" / "rank_0.log").read_text()
    return next(line for line in log.splitlines() if "start-up:" in line)


def _pool_pids(pool: Path) -> dict[str, int]:
    """The agent pool processes (not run_cli's launcher server, helpers/cli_pool.py: cli-*.pid)."""
    return {p.stem: int(p.read_text()) for p in pool.glob("*.pid") if not p.stem.startswith("cli-")}


def test_pooled_agents_run_jobs_as_new_ones_do_one_pool_process_per_startup_environment(tmp_path, own_pool):
    runs = {}
    for name, devices in (("a", 2), ("b", 2), ("c", 1)):
        runs[name] = tmp_path / name
        r = run_cli(
            "train", *TINY, "train.steps=2", f"hardware.devices_per_node={devices}", f"run.dir={runs[name]}"
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert _pooled_agent(runs[name]) is not None, (runs[name] / "logs" / "launcher.log").read_text()
    # the ranks' start-up environment is the launch's: 1 intra-op thread for 2 ranks a node, 2 for
    # one (OpenMP reads it as torch loads: another pool process), waiting passively either way
    assert "forked from the fork server (the agent), 1 threads (OpenMP waits: passive)" in _start_up(
        runs["a"]
    )
    assert "forked from the fork server (the agent), 2 threads (OpenMP waits: passive)" in _start_up(
        runs["c"]
    )
    pids = _pool_pids(own_pool)
    assert len(pids) == 2, pids  # a and b shared one
    # pool processes that died leave stale sockets: the next launch starts another
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    r = run_cli("train", *TINY, "train.steps=2", "hardware.devices_per_node=2", f"run.dir={tmp_path / 'd'}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _pooled_agent(tmp_path / "d") is not None
    restarted = [k for k, pid in _pool_pids(own_pool).items() if pid != pids[k]]
    assert len(restarted) == 1 and psutil.pid_exists(_pool_pids(own_pool)[restarted[0]])


def test_a_pooled_agent_and_its_ranks_die_with_a_sigkilled_launcher(tmp_path, own_pool):
    """Its parent is the pool process, not the launcher: it watches the launcher (a pidfd) and
    stops as a new agent does when PR_SET_PDEATHSIG fires."""
    run_dir = tmp_path / "run"
    exe = Path(sys.executable).parent / "fleetwise"
    args = [
        str(exe),
        "train",
        *TINY,
        "train.steps=100000",
        "hardware.devices_per_node=2",
        f"run.dir={run_dir}",
    ]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    agent, left = None, None
    try:
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        agent = _pooled_agent(run_dir)
        assert agent is not None
        session = [q.pid for q in psutil.process_iter() if _sid(q.pid) == agent]
        assert len(session) >= 4, session  # the agent, its fork server, two ranks
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 60
        while (left := _alive(session)) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        for pid in [q.pid for q in psutil.process_iter() if _sid(q.pid) == agent] if agent else []:
            os.kill(pid, signal.SIGKILL)  # never leave them running for other tests
        if proc.poll() is None:
            proc.kill()
    assert left == []


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            continue
    return out
