"""Launcher: the parent side of `fleetwise train`.

It writes the run directory (resolved config, plan, command line), starts the ranks with torchrun
(`torch.distributed.run`: one process per device, c10d rendezvous, restarts), follows rank 0's log
and metrics for the console, and reports how the job ended. It never imports torch: a bad setup is
reported before anything heavy starts.
"""

from __future__ import annotations

import contextlib
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
    return (
        f"hardware={cfg.hardware.name} runs {need} CUDA devices per node, but this machine has {found}. "
        "Train here with hardware=cpu (validate and plan work for any profile)."
    )


def job_id(cfg: RunConfig) -> str:
    """An id every node of one job derives alike: a hash of the resolved config without what
    differs per node (its rank, its run directory -- by default a timestamp of when that node
    started, so nodes starting in different seconds would join different rendezvous)."""
    import hashlib

    data = cfg.model_dump(mode="json")
    data["launch"] = {k: v for k, v in data["launch"].items() if k not in ("node_rank", "rdzv_id")}
    data["run"] = {k: v for k, v in data["run"].items() if k != "dir"}
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]
    return f"fleetwise-{digest}"


def torchrun_command(cfg: RunConfig, run_dir: Path) -> list[str]:
    launch = cfg.launch
    host, _, port = launch.rdzv_endpoint.rpartition(":")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node(cfg)}"]
    if launch.nnodes == "1" and int(port) == 0:
        cmd.append("--standalone")  # c10d rendezvous on a free local port
    else:
        rdzv_id = launch.rdzv_id or cfg.run.name or job_id(cfg)
        cmd += [
            f"--nnodes={launch.nnodes}",
            f"--node-rank={launch.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{port}",
            f"--rdzv-conf=last_call_timeout={launch.rdzv_last_call_s}",
            f"--rdzv-id={rdzv_id}",
        ]
    cmd += [
        f"--max-restarts={launch.max_restarts}",
        f"--monitor-interval={launch.monitor_interval_s}",
        f"--log-dir={run_dir / 'logs' / 'torchrun'}",
        "-m",
        WORKER,
        str(run_dir),
    ]
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


def launch_job(
    cfg: RunConfig,
    plan: Plan,
    run_dir: Path,
    argv: list[str],
    console: Console,
    on_started=None,
    on_poll=None,
) -> JobResult:
    """Start torchrun and follow it: rank 0's log to the console, metrics.jsonl into records;
    `on_started` runs once the ranks are starting, `on_poll` on every turn of the loop."""
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
        proc = subprocess.Popen(
            cmd, stdout=launcher_log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        progress = _progress_bar(console)
        task = progress.add_task("train", total=cfg.train.steps, status="starting the ranks")
        try:
            if on_started is not None:
                on_started()
            with progress:  # log lines print above the bar; no bar when the console is not a terminal
                while True:
                    done = proc.poll() is not None
                    for line in rank0_log.lines():
                        console.print(line, highlight=False, markup=False, soft_wrap=True)
                    for line in metrics.lines():
                        if line.strip():
                            records.append(json.loads(line))
                            progress.update(
                                task, completed=records[-1].get("step", 0), status=_status(records[-1])
                            )
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
    return JobResult(proc.returncode, run_dir, error, latest_per_step(records))


def _progress_bar(console: Console):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]steps"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def _status(record: dict) -> str:
    rate = (
        f"{record['perf/tokens_per_s']:,.0f} tokens/s"
        if "perf/tokens_per_s" in record
        else f"{record.get('perf/samples_per_s', 0):,.0f} samples/s"
    )
    loss = record.get("train/loss")
    return f"loss {loss:.4f} · {rate}" if isinstance(loss, (int, float)) else rate


def latest_per_step(records: list[dict]) -> list[dict]:
    """metrics.jsonl is append-only: steps re-run after a resume appear again; the last one counts."""
    by_step = {r.get("step", i): r for i, r in enumerate(records)}
    return [by_step[k] for k in sorted(by_step)]


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the torchrun group (torchrun forwards it to the workers), then SIGKILL stragglers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# Failures that only echo another rank's death (its peers lose the connection or time out).
SYMPTOMS = ("Connection reset by peer", "Connection closed by peer", "Timed out waiting", "connectFullMesh")


def root_cause(run_dir: Path, returncode: int) -> str:
    """The first failure of the job: the rank and its exception message (from the error file
    @record wrote), or its exit code / signal when it died without one (os._exit, SIGKILL, OOM
    killer). torchrun's "first observed failure" can be a peer's connection error observed before
    the dead rank was reaped, so failures are ranked by _blame_order."""
    failures = _torchrun_failures(run_dir / "logs" / "launcher.log")
    if not failures:  # torchrun itself failed (bad arguments, rendezvous): its last words
        try:
            lines = (run_dir / "logs" / "launcher.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        last = lines[-1].strip() if lines else ""
        return f"torchrun exited with code {returncode}: {last} (see {run_dir / 'logs' / 'launcher.log'})"
    described = []
    for rank, code, error_file in failures:
        message = _error_file_message(Path(error_file)) if error_file and error_file != "<N/A>" else None
        described.append((rank, code, message))
    rank, code, message = min(described, key=_blame_order)  # min is stable: ties keep torchrun's order
    if message:
        return f"rank {rank} failed: {message}"
    if code.lstrip("-").isdigit() and int(code) < 0:
        try:
            name = signal.Signals(-int(code)).name
        except ValueError:
            name = f"signal {-int(code)}"
        return f"rank {rank} was killed by {name}"
    return f"rank {rank} died with exit code {code} (no Python exception: see logs/rank_{rank}.log)"


def _blame_order(failure: tuple[str, str, str | None]) -> int:
    """How likely a failure is the cause rather than a consequence: a real exception first, then a
    rank that died without one (os._exit, SIGKILL), then a peer's connection error or collective
    timeout, and last a rank torchrun itself stopped with SIGTERM while tearing the group down
    (a hung rank ends that way; its peer's timeout says more)."""
    _, code, message = failure
    if message:
        return 2 if any(x in message for x in SYMPTOMS) else 0
    return 3 if code == f"-{signal.SIGTERM.value}" else 1


def _torchrun_failures(launcher_log: Path) -> list[tuple[str, str, str]]:
    """(rank, exitcode, error_file) of every failure in torchrun's last report, root cause first."""
    try:
        text = launcher_log.read_text(errors="replace")
    except OSError:
        return []
    marker = text.rfind("Root Cause (first observed failure)")
    if marker < 0:
        return []
    start = text.rfind("Failures:", 0, marker)
    sections = [text[marker:], text[start:marker] if start >= 0 else ""]
    out = []
    for section in sections:
        entry: dict[str, str] = {}
        for line in section.splitlines()[1:] + ["[end]:"]:
            if line.startswith("[") and line.rstrip().endswith("]:"):
                if "rank" in entry:
                    out.append(
                        (
                            entry["rank"].split()[0],
                            entry.get("exitcode", "?").split()[0],
                            entry.get("error_file", ""),
                        )
                    )
                entry = {}
                continue
            key, sep, value = line.strip().partition(":")
            if sep and key.strip() in ("rank", "exitcode", "error_file"):
                entry.setdefault(key.strip(), value.strip())
    return out


def _error_file_message(path: Path) -> str | None:
    try:
        info = json.loads(path.read_text())["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    msg = (info.get("message") if isinstance(info, dict) else str(info)) or ""
    lines = [ln for ln in msg.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else None
