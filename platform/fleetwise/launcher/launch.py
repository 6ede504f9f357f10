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
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from rich.console import Console

from fleetwise import rundir
from fleetwise.config.problems import Problem
from fleetwise.config.run import RunConfig
from fleetwise.launcher.failure import TracebackFold
from fleetwise.launcher.hostnet import (
    NetworkError,
    NodeNet,
    describe,
    interface_env,
    node_network,
    torchrun_args,
)
from fleetwise.plan.records import Plan
from fleetwise.rundir import Metric
from fleetwise.runtime.lifeline import die_with_parent

WORKER = "fleetwise.runtime.worker"
AGENT = "fleetwise.launcher.agent"


@dataclass
class JobResult:
    returncode: int
    run_dir: Path
    error: str | None
    records: list[dict]
    fold: TracebackFold | None = None  # rank 0's traceback, held back from the console


# What a job writes into its run directory (run.overwrite=true clears exactly these).
JOB_FILES = (
    rundir.CONFIG_FILE,
    rundir.PLAN_FILE,
    rundir.COMMAND_FILE,
    rundir.METRICS_FILE,
    rundir.TRACKING_FILE,
    rundir.ERROR_FILE,
    rundir.PS_SUMMARY_FILE,
)
JOB_DIRS = (rundir.LOGS_DIR, rundir.CHECKPOINTS_DIR)
LOCK_NAME = ".fleetwise.lock"


def run_dir_problems(cfg: RunConfig) -> list[Problem]:
    """A run directory that already holds something is refused unless the job resumes it or
    run.overwrite=true: reusing it would continue the old MLflow run, drop steps as re-runs, mix
    the summary and let keep-N delete what was just written. The other nodes of the same
    multi-node job (same config but node_rank, on a shared filesystem) are not "something"."""
    if not cfg.run.dir or cfg.checkpoint.resume != "none" or cfg.run.overwrite:
        return []
    path = Path(cfg.run.dir)
    if not path.is_dir():
        return [] if not path.exists() else [Problem("run.dir", f"{path} is a file", "choose a directory")]
    entries = sorted(p.name for p in path.iterdir() if not p.name.startswith(LOCK_NAME))
    if not entries:
        return []
    if _node_count(cfg) > 1:
        written = path / rundir.CONFIG_FILE
        if _same_job(cfg, written):
            return []
        if cfg.launch.node_rank > 0 and not written.exists():
            # node 0 checked the directory before writing into it and may be writing it now (its
            # .hydra/ and plan.json come before config.yaml): only a different job's config refuses
            # it here -- else node 1 starting a moment late saw a half-written job and exited 2
            return []
    shown = ", ".join(entries[:5]) + (", …" if len(entries) > 5 else "")
    return [
        Problem(
            "run.dir",
            f"{path} is not empty ({shown}): a new job there would mix with the one that wrote it",
            "resume it with checkpoint.resume=auto, choose a new run.dir, or run.overwrite=true to "
            "replace the old job's files",
        )
    ]


def _same_job(cfg: RunConfig, written: Path) -> bool:
    try:
        theirs = yaml.safe_load(written.read_text())
    except (OSError, yaml.YAMLError):
        return False
    if not isinstance(theirs, dict) or not isinstance(theirs.get("launch"), dict):
        return False
    return per_job(cfg.model_dump(mode="json")) == per_job(theirs)


def per_job(data: dict) -> dict:
    """A resolved config (as JSON data) without what differs between the nodes of one job: the
    node's rank and its run directory (by default a timestamp of when that node started)."""
    out = dict(data)
    for section, key in (("launch", "node_rank"), ("run", "dir")):
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k != key}
    return out


class RunDirBusy(RuntimeError):
    """Another live job holds the run directory."""


def lock_run_dir(run_dir: Path, node_rank: int = 0):
    """Hold an exclusive lock on the run directory for the life of this job (released when the
    returned file is closed, or when the process dies). Each node of a multi-node job locks its
    own file, so the nodes can share one directory on a shared filesystem."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / (LOCK_NAME if node_rank == 0 else f"{LOCK_NAME}.node{node_rank}")
    f = path.open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RunDirBusy(
            f"run directory {run_dir} is in use by a running job ({holder}): "
            "wait for it, or choose another run.dir"
        ) from None
    f.truncate(0)
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f


def clear_run_dir(run_dir: Path) -> None:
    """run.overwrite=true: remove the previous job's files (and nothing else of the directory)."""
    import shutil

    for name in JOB_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in JOB_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)


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


MAX_RANKS_PER_CORE = 8  # the 16-rank 4D mesh trains on 2 cores; far beyond, gloo times out
RANK_BASE_BYTES = 200 << 20  # a CPU rank before its tensors: interpreter, torch, gloo (RSS)


def capacity_problem(cfg: RunConfig, plan: Plan, cores: int | None = None, available: int | None = None):
    """A CPU job whose ranks this machine cannot hold (4096 ranks on 2 cores; processes whose
    memory adds up past what is free) is refused before anything is spawned, unless
    launch.oversubscribe=true. Returns (loc, message, hint) or None."""
    if cfg.hardware.device_type != "cpu":
        return None
    ranks = nproc_per_node(cfg)
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    available = _mem_available() if available is None else available
    need = ranks * (RANK_BASE_BYTES + int(plan.memory_bytes.get("total", 0)))
    what = None
    if ranks > MAX_RANKS_PER_CORE * cores:
        what = f"{ranks} ranks on this node, but it has {cores} CPU cores (at most {MAX_RANKS_PER_CORE} per core)"
    elif available is not None and need > available:
        what = (
            f"{ranks} ranks need about {need / 2**30:,.1f} GiB here ({RANK_BASE_BYTES >> 20} MiB of "
            f"start-up per rank + the plan's {plan.memory_bytes.get('total', 0) / 2**30:,.2f} GiB), "
            f"but {available / 2**30:,.1f} GiB are available"
        )
    if what is None:
        return None
    return (
        "hardware.devices_per_node" if cfg.strategy.name != "ps" else "strategy.num_trainers",
        what,
        "use fewer ranks, or launch.oversubscribe=true to start them anyway",
    )


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def torchrun_command(cfg: RunConfig, run_dir: Path, net: NodeNet | None = None) -> list[str]:
    """The torchrun command of this node; `net` (multi-node: this node's address and role on the
    route to the rendezvous endpoint) is derived here when not given."""
    launch = cfg.launch
    host, _, port = launch.rdzv_endpoint.rpartition(":")
    nproc = f"--nproc-per-node={nproc_per_node(cfg)}"
    if launch.nnodes == "1":
        # One node: torchrun through fleetwise.launcher.agent, whose stores listen on loopback
        # only (torch's own bind every interface), with a random rendezvous id.
        cmd = [sys.executable, "-m", AGENT, nproc, "--nnodes=1", "--rdzv-backend=c10d"]
        cmd += [
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-conf=is_host=true",
            f"--rdzv-id={rdzv_id(cfg)}",
            "--local-addr=127.0.0.1",
        ]
    else:
        cmd = [sys.executable, "-m", AGENT, "--any-interface", nproc]
        cmd += [
            f"--nnodes={launch.nnodes}",
            f"--node-rank={launch.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{port}",
            f"--rdzv-id={rdzv_id(cfg)}",
        ]
        net = net or node_network(launch.rdzv_endpoint)
        cmd += torchrun_args(net, [f"last_call_timeout={launch.rdzv_last_call_s}"])
    cmd += [
        f"--max-restarts={launch.max_restarts}",
        f"--monitor-interval={launch.monitor_interval_s}",
        f"--log-dir={rundir.logs_dir(run_dir) / 'torchrun'}",
        "-m",
        WORKER,
        str(run_dir),
    ]
    return cmd


# Names of environment variables that hold credentials. The ranks never talk to MLflow (this
# launcher does) and read only local files, so none of these reach them: a rank's environment is
# readable by every process of its user (/proc/PID/environ) and lands in crash reports.
SECRET_NAME = re.compile(r"(^|_)(PASSWORD|PASSWD|SECRET|TOKEN|API_KEY|ACCESS_KEY|CREDENTIALS?)(_|$)")
SECRET_PREFIXES = ("MLFLOW_", "DATABRICKS_")


def is_secret_name(name: str) -> bool:
    return name.upper().startswith(SECRET_PREFIXES) or bool(SECRET_NAME.search(name.upper()))


# glibc malloc in the ranks (unless the user set these): blocks from 4 MiB up are mapped and given
# back to the system when freed, and at most 2 heap arenas. With glibc's adaptive defaults, the
# whole-parameter temporaries of layout-invariant initialization and FSDP's per-unit buffers stay
# in the heap once freed. Measured (RSS per rank, fp32 ZeRO-3 GPTs; a d=512 GPT's step on 2 ranks):
# glibc-like 2.45 GB (235M, 2 ranks) / 759-796 ms; 1 MiB 2.07 GB / 2.18 GB (0.84B, 8 ranks) but
# 894-972 ms, every activation mapped and faulted in each step; 4 MiB 2.39 GB (0.84B) / 809-832 ms;
# 16 MiB 2.15 GB (235M) / 2.49 GB (0.84B) / 778-902 ms.
# That is the start-up setting: once its model is built, a rank of any engine but FSDP raises both
# thresholds to glibc's ceiling for the steps (runtime/hostmalloc.py: the per-step page faults).
HOST_MALLOC = {
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_MMAP_THRESHOLD_": str(4 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(4 << 20),
}


def rank_malloc_env(environ) -> dict[str, str]:
    """The malloc variables a rank gets beyond `environ`: HOST_MALLOC where the user set none, and
    then leave to raise the thresholds after start-up (runtime/hostmalloc.py's OWNED_VAR)."""
    from fleetwise.runtime.hostmalloc import OWNED_VAR

    out = {k: v for k, v in HOST_MALLOC.items() if k not in environ}
    out[OWNED_VAR] = "1" if "MALLOC_MMAP_THRESHOLD_" in out and "MALLOC_TRIM_THRESHOLD_" in out else "0"
    return out


def rank_environment(environ) -> dict[str, str]:
    """The environment torchrun and the ranks get: this one without credentials."""
    return {k: v for k, v in environ.items() if not is_secret_name(k)}


def rdzv_id(cfg: RunConfig) -> str:
    """The rendezvous id: the user's launch.rdzv_id; else, for one node, a random one per job
    (nothing else has to agree on it, and a peer on the network cannot guess it); for several
    nodes, a hash of the resolved config without node_rank, which every node of the job computes
    alike whatever second it starts in. (The store itself is unauthenticated: multi-node jobs
    assume a trusted network, see the README.)"""
    if cfg.launch.rdzv_id:
        return cfg.launch.rdzv_id
    if cfg.launch.nnodes == "1":
        import secrets

        return f"fw-{secrets.token_hex(12)}"
    import hashlib

    data = per_job(cfg.model_dump(mode="json"))  # every node computes the same id
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    return f"fw-{digest[:24]}"


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
    rundir.write_run_dir(run_dir, cfg, plan, argv)
    try:  # checked before launch; a SLURM node resolves its job's endpoint only here
        net = None if cfg.launch.nnodes == "1" else node_network(cfg.launch.rdzv_endpoint)
    except NetworkError as err:
        return JobResult(2, run_dir, f"launch.rdzv_endpoint={cfg.launch.rdzv_endpoint}: {err}", [])
    cmd = torchrun_command(cfg, run_dir, net)
    from fleetwise.tracking.store import without_credentials

    env = without_credentials(rank_environment(os.environ))  # ranks never talk to MLflow
    threads = max(1, (os.cpu_count() or 1) // max(1, nproc_per_node(cfg)))
    env.setdefault("OMP_NUM_THREADS", str(threads))  # one process per core share, no oversubscription
    env["PYTHONUNBUFFERED"] = "1"
    env.update(rank_malloc_env(env))
    if cfg.launch.nnodes == "1" and "GLOO_SOCKET_IFNAME" not in env and Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"  # one node: the ranks' gloo mesh on loopback, off the network
    if net is not None:  # several nodes: every library on the interface that reaches node 0
        env.update(interface_env(net, env))
        # torch shares the rendezvous TCPStore with the workers and publishes MASTER_ADDR/PORT only
        # in the round where a node first became rank 0: a node joining a later round (a lost host
        # coming back) waits for them under the new round's prefix that no one writes, and the group
        # dies on a 60 s store timeout (role_info / MASTER_ADDR). Not shared, rank 0 publishes them
        # every round and the ranks' own store lives on rank 0's node. Not for ps: its RPC shutdown
        # needs the store after trainer 0 (rank 0, its host without the agent's) has exited.
        if cfg.strategy.name != "ps":
            env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    rank0_log = Follower(rundir.rank_log(run_dir, 0))
    fold = TracebackFold()  # a traceback stays in the log; the failure report leads with the cause
    metrics = Follower(rundir.metrics_path(run_dir))
    records: list[dict] = []
    with rundir.launcher_log(run_dir).open("ab") as launcher_log:
        if net is not None:  # how this node reaches the others, for whoever reads the log
            launcher_log.write((describe(net, env) + "\n").encode())
            launcher_log.flush()
        # A session of its own: the whole process tree can be stopped together (no orphans). The
        # session also keeps a terminal's SIGHUP away from it, so torchrun gets SIGTERM when this
        # launcher dies by any means, SIGKILL included (the ranks die with torchrun: worker.py).
        launcher = os.getpid()
        proc = subprocess.Popen(
            cmd,
            stdout=launcher_log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM, launcher),
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
                        if (shown := fold.feed(line)) is not None:
                            console.print(shown, highlight=False, markup=False, soft_wrap=True)
                    for line in metrics.lines():
                        record = metrics_record(line)
                        if record is not None:
                            records.append(record)
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
    return JobResult(proc.returncode, run_dir, error, latest_per_step(records), fold)


def metrics_record(line: str) -> dict | None:
    """One step's record from a metrics.jsonl line, or None for a blank or torn line (a crash or a
    full disk mid-write): one bad line must not stop every later resume of the run."""
    from fleetwise.tracking.spool import parse_record

    record = parse_record(line.encode()) if line.strip() else None
    return record if record is not None and isinstance(record.get("step"), int) else None


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
        f"{record[Metric.TOKENS_PER_S]:,.0f} tokens/s"
        if Metric.TOKENS_PER_S in record
        else f"{record.get(Metric.SAMPLES_PER_S, 0):,.0f} samples/s"
    )
    loss = record.get(Metric.LOSS)
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
    log = rundir.launcher_log(run_dir)
    failures = _torchrun_failures(log)
    if not failures:  # torchrun itself failed (bad arguments, rendezvous): its last words
        try:
            lines = log.read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        last = lines[-1].strip() if lines else ""
        return f"torchrun exited with code {returncode}: {last} (see {log})"
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
    log_name = rundir.rank_log(run_dir, rank).relative_to(run_dir)
    return f"rank {rank} died with exit code {code} (no Python exception: see {log_name})"


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
