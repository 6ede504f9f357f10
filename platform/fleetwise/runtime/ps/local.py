"""Launch a parameter-server job on this host with torchrun (tests and benchmarks).

A stopgap for `fleetwise train strategy=ps`: it writes RUN_DIR/config.yaml and runs
`python -m torch.distributed.run --nproc-per-node T+S … -m fleetwise.runtime.ps RUN_DIR` in its
own session, so that afterwards every process the job started can be found (and killed on a
timeout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import PSStrategy
from fleetwise.runtime.ps import world_size


@dataclass
class LocalRun:
    run_dir: Path
    returncode: int
    output: str  # torchrun's own stdout/stderr (the ranks log to run_dir/logs)
    wall_s: float
    session: int  # session id of the launch: every process of the job had it


def launch_local(
    cfg: RunConfig, run_dir: Path, *, env: dict[str, str] | None = None, timeout: float = 600
) -> LocalRun:
    s = cfg.strategy
    assert isinstance(s, PSStrategy)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(world_size(cfg)),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
        "--monitor-interval", "0.2",
        "-m", "fleetwise.runtime.ps", str(run_dir),
    ]  # fmt: skip
    t0 = time.perf_counter()
    p = subprocess.Popen(
        cmd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return LocalRun(run_dir, p.returncode, out, time.perf_counter() - t0, p.pid)


def session_processes(session: int) -> list[int]:
    """PIDs of live processes in a session (for orphan checks)."""
    import psutil

    left = []
    for q in psutil.process_iter():
        try:
            if os.getsid(q.pid) == session:
                left.append(q.pid)
        except OSError:
            continue
    return left
