"""Launcher: the parent side of `fleetwise train`.

It writes the run directory (resolved config, plan, command line), starts the ranks with torchrun
(`torch.distributed.run`: one process per device, c10d rendezvous, restarts), follows rank 0's log
and metrics for the console, and reports how the job ended. It never imports torch: a bad setup is
reported before anything heavy starts.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console

from fleetwise.config.run import RunConfig
from fleetwise.plan.planner import Plan

WORKER = "fleetwise.runtime.worker"


@dataclass
class JobResult:
    returncode: int
    run_dir: Path
    error: str | None
    records: list[dict]


def write_run_dir(run_dir: Path, cfg: RunConfig, plan: Plan, argv: list[str]) -> None:
    """The files every rank (and every later tool) reads; written atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    _atomic_write(run_dir / "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    _atomic_write(run_dir / "plan.json", json.dumps(plan.to_dict(), indent=2))
    _atomic_write(run_dir / "command.txt", shlex.join(["fleetwise", "train", *argv]) + "\n")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def nproc_per_node(cfg: RunConfig) -> int:
    s = cfg.strategy
    if s.name == "ps":  # servers and trainers are processes of one node, or spread over nodes
        return -(-(s.num_servers + s.num_trainers) // max(1, _node_count(cfg)))
    return cfg.hardware.devices_per_node


def _node_count(cfg: RunConfig) -> int:
    return int(cfg.launch.nnodes.split(":")[-1])


def gpu_problem(cfg: RunConfig) -> str | None:
    """A GPU profile on a machine without (enough) GPUs fails fast, before any process starts."""
    if cfg.hardware.device_type != "cuda":
        return None
    found = len(glob.glob("/dev/nvidia[0-9]*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        found = min(found, len([d for d in visible.split(",") if d.strip()]))
    need = nproc_per_node(cfg)
    if found >= need:
        return None
    return (f"hardware={cfg.hardware.name} runs {need} CUDA devices per node, but this machine has {found}. "
            "Train here with hardware=cpu (validate and plan work for any profile).")


def torchrun_command(cfg: RunConfig, run_dir: Path) -> list[str]:
    launch = cfg.launch
    host, _, port = launch.rdzv_endpoint.rpartition(":")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node(cfg)}"]
    if launch.nnodes == "1" and int(port) == 0:
        cmd.append("--standalone")  # c10d rendezvous on a free local port
    else:
        rdzv_id = launch.rdzv_id or cfg.run.name or run_dir.name
        cmd += [f"--nnodes={launch.nnodes}", f"--node-rank={launch.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={host}:{port}", f"--rdzv-id={rdzv_id}"]
    cmd += [f"--max-restarts={launch.max_restarts}", f"--monitor-interval={launch.monitor_interval_s}",
            f"--log-dir={run_dir / 'logs' / 'torchrun'}", "-m", WORKER, str(run_dir)]
    return cmd


class Follower:
    """Tails a growing text file, returning complete new lines."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, ""

    def lines(self) -> list[str]:
        try:
            with self.path.open() as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        data = self.partial + data
        *complete, self.partial = data.split("\n")
        return complete


def launch_job(cfg: RunConfig, plan: Plan, run_dir: Path, argv: list[str], console: Console,
               on_poll=None) -> JobResult:
    write_run_dir(run_dir, cfg, plan, argv)
    cmd = torchrun_command(cfg, run_dir)
    env = dict(os.environ)
    threads = max(1, (os.cpu_count() or 1) // max(1, nproc_per_node(cfg)))
    env.setdefault("OMP_NUM_THREADS", str(threads))  # one process per core share, no oversubscription
    env["PYTHONUNBUFFERED"] = "1"
    rank0_log = Follower(run_dir / "logs" / "rank_0.log")
    metrics = Follower(run_dir / "metrics.jsonl")
    records: list[dict] = []
    with (run_dir / "logs" / "launcher.log").open("ab") as launcher_log:
        # a session of its own: the whole process tree can be stopped together (no orphans)
        proc = subprocess.Popen(cmd, stdout=launcher_log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while True:
                done = proc.poll() is not None
                for line in rank0_log.lines():
                    console.print(line, highlight=False, markup=False, soft_wrap=True)
                for line in metrics.lines():
                    if line.strip():
                        records.append(json.loads(line))
                if on_poll is not None:
                    on_poll()
                if done:
                    break
                time.sleep(0.2)
        except KeyboardInterrupt:
            _stop(proc)
            raise
        finally:
            if proc.poll() is None:
                _stop(proc)
    error = None if proc.returncode == 0 else root_cause(run_dir, proc.returncode)
    return JobResult(proc.returncode, run_dir, error, records)


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the torchrun group (torchrun forwards it to the workers), then SIGKILL stragglers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def root_cause(run_dir: Path, returncode: int) -> str:
    """The first failure of the job: the earliest error file a rank wrote (@record), else the
    failure summary torchrun printed (hard exits and signals leave no error file)."""
    found = []
    for path in glob.glob(str(run_dir / "logs" / "torchrun" / "**" / "error.json"), recursive=True):
        try:
            info = json.loads(Path(path).read_text())["message"]
            msg = info["message"] if isinstance(info, dict) else str(info)
            stamp = int(info.get("extraInfo", {}).get("timestamp", 0)) if isinstance(info, dict) else 0
            found.append((stamp, path, msg))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if found:
        _, path, msg = min(found)
        rank = _rank_of_error_file(run_dir, Path(path))
        return f"rank {rank} failed: {msg.strip().splitlines()[-1] if msg.strip() else msg}"
    summary = _torchrun_summary(run_dir / "logs" / "launcher.log")
    return summary or f"torchrun exited with code {returncode}; see {run_dir / 'logs'}"


def _rank_of_error_file(run_dir: Path, path: Path) -> str:
    # torchrun layout: logs/torchrun/<run id>/attempt_<k>/<local rank>/error.json
    return path.parent.name


def _torchrun_summary(launcher_log: Path) -> str | None:
    try:
        text = launcher_log.read_text(errors="replace")
    except OSError:
        return None
    lines = [ln.strip() for ln in text.splitlines()]
    failure = {}
    for ln in lines:
        for key in ("rank", "exitcode", "error_file", "traceback"):
            if ln.startswith(f"{key}") and ":" in ln:
                failure.setdefault(key, ln.split(":", 1)[1].strip())
    if "exitcode" not in failure:
        return None
    code = failure["exitcode"]
    how = f"exit code {code}"
    if "Signal" in failure.get("traceback", "") or code.startswith("-"):
        how = failure.get("traceback", f"signal {code}")
    return f"rank {failure.get('rank', '?').split()[0]} died ({how})"
