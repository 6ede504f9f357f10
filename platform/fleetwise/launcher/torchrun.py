"""One job's ranks under torchrun: the command, the ranks' environment, and the loop that follows them.

`launch_job` writes the run directory (resolved config, plan, command line), starts the ranks with
torchrun (`torch.distributed.run`: one process per device, c10d rendezvous, restarts), follows rank
0's log and metrics for the console, stops the process group when asked to, and reports how the
job ended (its root cause: launcher/failure.py). It never imports torch: a bad setup is reported
before anything heavy starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from fleetwise import rundir
from fleetwise.config.run import RunConfig
from fleetwise.hostnet import (
    NetworkError,
    NodeNet,
    describe,
    interface_env,
    node_network,
    torchrun_args,
)
from fleetwise.launcher.agent import WORKER
from fleetwise.launcher.agent_pool import POOL_VAR, start_pooled
from fleetwise.launcher.failure import TracebackFold, root_cause
from fleetwise.plan.records import Plan
from fleetwise.rundir import Metric
from fleetwise.runtime.lifeline import die_with_parent

AGENT = "fleetwise.launcher.agent"


@dataclass
class JobResult:
    returncode: int
    run_dir: Path
    error: str | None
    records: list[dict]
    fold: TracebackFold | None = None  # rank 0's traceback, held back from the console


def nproc_per_node(cfg: RunConfig) -> int:
    s = cfg.strategy
    if s.name == "ps":  # servers and trainers are processes of one node, or spread over nodes
        return -(-(s.num_servers + s.num_trainers) // max(1, node_count(cfg)))
    return cfg.hardware.devices_per_node


def node_count(cfg: RunConfig) -> int:
    """Nodes of the job (an elastic job: its largest count)."""
    return int(cfg.launch.nnodes.split(":")[-1])


def torchrun_command(cfg: RunConfig, run_dir: Path, net: NodeNet | None = None) -> list[str]:
    """The torchrun command of this node; `net` (multi-node: this node's address and role on the
    route to the rendezvous endpoint) is derived here when not given."""
    launch = cfg.launch
    host, _, port = launch.rdzv_endpoint.rpartition(":")
    nproc = f"--nproc-per-node={nproc_per_node(cfg)}"
    if launch.nnodes == "1":
        # One node: torchrun through fleetwise.launcher.agent, whose stores listen on loopback
        # only (torch's own bind every interface), with a random rendezvous id.
        cmd = [sys.executable, "-m", AGENT, "--bind=127.0.0.1", nproc, "--nnodes=1", "--rdzv-backend=c10d"]
        cmd += [
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-conf=is_host=true",
            f"--rdzv-id={rdzv_id(cfg)}",
            "--local-addr=127.0.0.1",
        ]
    else:
        net = net or node_network(launch.rdzv_endpoint)
        # the stores node 0 hosts listen on its address on the route the other nodes take, only
        cmd = [sys.executable, "-m", AGENT, f"--bind={net.local_addr}"]
        if not net.loopback and not net.is_host:  # node 0's store may not be up yet (hostnet.wait_for_store)
            cmd.append(f"--wait-for={host}:{port}")
        cmd.append(nproc)
        cmd += [
            f"--nnodes={launch.nnodes}",
            f"--node-rank={launch.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={host}:{port}",
            f"--rdzv-id={rdzv_id(cfg)}",
        ]
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


def rank_thread_env(environ, nproc: int) -> dict[str, str]:
    """OpenMP settings a rank gets where `environ` has none: its share of the cores as intra-op
    threads, and threads that sleep at a barrier instead of spinning (OMP_WAIT_POLICY=PASSIVE).
    torch's CPU builds use GNU OpenMP, whose default spins: when anything else wants the core (the
    launcher, the agent, a second job, a CI runner's neighbours), a rank's 2 threads spin-wait on
    each other at every parallel region. Measured (gpt/tiny, 1 rank, 2 threads, 3 steps, load ~10):
    22-32 CPU-s and 48-68 s a job spinning, 10-11 CPU-s and 23 s passive -- the same as 1 thread."""
    threads = max(1, (os.cpu_count() or 1) // max(1, nproc))
    defaults = {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    return {k: v for k, v in defaults.items() if not environ.get(k)}  # (set empty: not set)


def rank_environment(environ) -> dict[str, str]:
    """The environment torchrun and the ranks get: this one without credentials."""
    return {k: v for k, v in environ.items() if not is_secret_name(k)}


def per_job(data: dict) -> dict:
    """A resolved config (as JSON data) without what differs between the nodes of one job: the
    node's rank and its run directory (by default a timestamp of when that node started)."""
    out = dict(data)
    for section, key in (("launch", "node_rank"), ("run", "dir")):
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k != key}
    return out


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
    env.update(rank_thread_env(env, nproc_per_node(cfg)))  # one process per core share, no spinning
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
        # (in the test suite: forked from a warm pool process with torch imported, launcher/agent_pool.py)
        proc = start_pooled(cmd, env, launcher_log.fileno()) or subprocess.Popen(
            cmd,
            stdout=launcher_log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: die_with_parent(signal.SIGTERM, launcher),
        )
        if not isinstance(proc, subprocess.Popen):
            launcher_log.write(f"agent {proc.pid}: forked from the warm pool at ${POOL_VAR}\n".encode())
            launcher_log.flush()
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


def _stop(proc, grace_s: float = 10.0) -> None:
    """SIGTERM the torchrun group (torchrun forwards it to the workers), then SIGKILL stragglers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
