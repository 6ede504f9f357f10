"""`fleetwise train` as a launcher: refuses bad configs before starting anything, reports crashed
ranks without leaving processes behind, spans two "nodes" on loopback, runs Hydra sweeps."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.cli import run_cli
from helpers.runs import read_metrics

pytestmark = pytest.mark.slow

TINY = ("recipe=gpt/tiny", "train.steps=3", "tracking.enabled=false")


def leftover_processes(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_bad_config_exits_2_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli(
        "train", *TINY, "strategy.dp_degree=3", f"run.dir={run_dir}", cwd=tmp_path,
        env={"PYTHONPROFILEIMPORTTIME": "1"},
    )  # fmt: skip
    assert r.returncode == 2
    assert "dp_degree(3)" in r.stderr and "Traceback" not in r.stderr
    assert not run_dir.exists() and not (tmp_path / "outputs").exists()
    # validation only: torch (~2 s) is never imported, nor torchrun started -- asserted on the imports,
    # not on a wall-clock bound that load on the machine decides
    assert not re.search(r"\|\s+torch$", r.stderr, re.M)


def test_gpu_profile_without_gpu_fails_fast(tmp_path):
    r = run_cli("train", "recipe=gpt/tiny", "hardware=a100", f"run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 2
    assert "CUDA devices" in r.stderr and "hardware=cpu" in r.stderr
    assert not (tmp_path / "run").exists()
    assert run_cli("plan", "recipe=gpt/tiny", "hardware=a100").returncode == 0  # planning still works


@pytest.mark.usefixtures("cold_agents")  # (leftover_processes: a job's processes by their command line)
@pytest.mark.parametrize(
    "mode,expect", [("raise", "injected fault on rank 1 at step 2"), ("exit", "exit code 13")]
)
def test_failing_rank_fails_the_job_with_its_error_and_no_orphans(tmp_path, mode, expect):
    run_dir = tmp_path / f"run_{mode}"
    r = run_cli(
        "train",
        *TINY,
        "hardware.devices_per_node=2",
        "fault.kill_rank=1",
        "fault.at_step=2",
        f"fault.mode={mode}",
        f"run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert r.returncode != 0
    assert "training failed" in r.stderr and "rank 1" in r.stderr and expect in r.stderr, r.stderr
    assert len(read_metrics(run_dir)) == 1  # step 1 finished before the fault
    assert (run_dir / "logs" / "rank_1.log").exists()
    # the processes are gone by now or shortly (a loaded machine reaps slowly): wait, then assert
    deadline = time.monotonic() + 60
    while leftover_processes(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftover_processes(str(run_dir)) == []


def port_taken(output: str) -> bool:
    """A lost race for a port found free: someone else bound it first (EADDRINUSE)."""
    return "Address already in use" in output or "EADDRINUSE" in output or "[Errno 98]" in output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(cmds, cwd, env, timeout=300.0, after_failure=30.0):
    """Run one launcher per node until all end: (exit codes, [(stdout, stderr)]). A node that fails
    (its port taken, a crash) leaves its peers waiting for a rendezvous that never completes: they
    are stopped `after_failure` seconds later, as is every node still running at `timeout`, with their
    whole process group -- the test then fails (or retries) on both nodes' output, not on a timeout."""
    files = [(cwd / f"node{i}.out", cwd / f"node{i}.err") for i in range(len(cmds))]
    procs = []
    for cmd, (out, err) in zip(cmds, files, strict=True):
        with out.open("w") as o, err.open("w") as e:
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=o, stderr=e, start_new_session=True))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + after_failure)
        time.sleep(0.5)
    stopped = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in stopped:
        os.killpg(procs[i].pid, signal.SIGKILL)
    codes = [p.wait() for p in procs]
    killed = "\n[test: still running at its deadline (a peer failed, or the timeout); killed]"
    return codes, [
        (out.read_text(errors="replace"), err.read_text(errors="replace") + (killed if i in stopped else ""))
        for i, (out, err) in enumerate(files)
    ]


@pytest.mark.usefixtures("cold_agents")  # node 1 samples only once node 0's MLflow run exists
def test_two_nodes_on_loopback_match_one_node(tmp_path):
    """Also: both nodes report their system metrics into the job's one MLflow run (a sqlite store
    in tmp_path), and node 0 logs the model consolidated from the 4 ranks' shards."""
    single = tmp_path / "single"
    r = run_cli("train", *TINY, "hardware.devices_per_node=4", f"run.dir={single}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    exe = Path(sys.executable).parent / "fleetwise"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"] = "0.5"
    for attempt in range(3):  # the port was free when found; another process may take it first
        port = _free_port()
        work = tmp_path / f"attempt{attempt}"  # a fresh run directory and MLflow store per attempt
        work.mkdir()
        multi = work / "multi"
        nodes = [
            [
                str(exe),
                "train",
                *(a for a in TINY if not a.startswith("tracking.")),
                "hardware.nodes=2",
                "hardware.devices_per_node=2",
                f"launch.node_rank={rank}",
                f"launch.rdzv_endpoint=127.0.0.1:{port}",
                f"run.dir={multi}",
            ]
            for rank in (0, 1)
        ]
        codes, outs = run_nodes(nodes, work, env)
        logs = "".join(f.read_text(errors="replace") for f in multi.glob("logs/*.log"))
        if not any(port_taken(out + err) for out, err in outs) and not port_taken(logs):
            break
    assert codes == [0, 0], outs
    assert sorted(f.name for f in (multi / "logs").glob("rank_*.log")) == [f"rank_{i}.log" for i in range(4)]
    a, b = read_metrics(single), read_metrics(multi)
    assert [m["train/loss"] for m in a] == pytest.approx([m["train/loss"] for m in b], abs=2e-6)

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fleetwise").experiment_id])
    keys = set(run.data.metrics)
    for node in ("node_0", "node_1"):
        assert f"system/{node}/cpu_utilization_percentage" in keys, (sorted(keys), outs[1][1][-2000:])
    assert not any(k.startswith("system/cpu") for k in keys)  # every sample says which node it is from
    assert "eval/loss" in keys  # the model, consolidated from both nodes' shards


def test_multirun_sweep_runs_every_point(tmp_path):
    sweep = tmp_path / "sweep"
    r = run_cli(
        "train",
        "-m",
        *TINY,
        "strategy=dp,sharding",
        "hardware.devices_per_node=2",
        f"run.dir={sweep}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    for job, name in [("0", "dp"), ("1", "sharding")]:
        assert len(read_metrics(sweep / job)) == 3
        assert f"name: {name}" in (sweep / job / "config.yaml").read_text()


def test_invalid_sweep_point_exits_2_before_any_job(tmp_path):
    r = run_cli("train", "-m", *TINY, "strategy.dp_degree=8,3", f"run.dir={tmp_path / 's'}", cwd=tmp_path)
    assert r.returncode == 2
    assert "strategy.dp_degree=3" in r.stderr
    assert not (tmp_path / "s").exists()


def test_submitit_local_launcher_runs_the_job(tmp_path):
    sweep = tmp_path / "sub"
    r = run_cli(
        "train",
        "-m",
        "hydra/launcher=submitit_local",
        *TINY,
        "hardware.devices_per_node=2",
        f"run.dir={sweep}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert len(read_metrics(sweep / "0")) == 3


def test_cluster_launch_spans_the_slurm_allocation():
    from fleetwise.config.validate import load_config
    from fleetwise.launcher.sweeps import cluster_launch

    cfg = load_config(["recipe=gpt/tiny", "hardware.nodes=2", "hardware.devices_per_node=2"])
    env = SimpleNamespace(num_nodes=2, node=1, hostnames=["gpu-a", "gpu-b"], job_id="42")
    out = cluster_launch(cfg, env)
    assert (out.launch.nnodes, out.launch.node_rank, out.launch.rdzv_endpoint) == ("2", 1, "gpu-a:29500")
    assert cluster_launch(cfg, None) is cfg


def _start_train(tmp_path, run_dir, *extra, env=None):
    exe = Path(sys.executable).parent / "fleetwise"
    return subprocess.Popen(
        [str(exe), "train", "recipe=gpt/tiny", "train.steps=100000", "hardware.devices_per_node=2", *extra]
        + [f"run.dir={run_dir}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_a_step(proc, run_dir, timeout_s=240, tracked=False):
    """Until a rank wrote a step (and, with `tracked`, the launcher created the MLflow run: on a
    loaded machine ranks can train before the launcher has finished importing mlflow)."""
    deadline = time.monotonic() + timeout_s
    metrics = run_dir / "metrics.jsonl"

    def ready() -> bool:
        if not (metrics.exists() and metrics.read_text().strip()):
            return False
        state = run_dir / "tracking.json"
        return not tracked or (state.exists() and '"run_id": "' in state.read_text())

    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no step within the time limit"
        time.sleep(0.5)


def _gone(marker: str, timeout_s: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while leftover_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    return leftover_processes(marker)


@pytest.mark.usefixtures("cold_agents")  # (leftover_processes: a job's processes by their command line)
def test_sigterm_stops_every_rank_and_marks_the_run_killed(tmp_path):
    """What SLURM, systemd and `kill` send: the job stops like on Ctrl-C, and its MLflow run ends
    KILLED (before: every rank kept running and the run stayed RUNNING)."""
    import os
    import signal
    import sqlite3

    run_dir = tmp_path / "run"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    proc = _start_train(tmp_path, run_dir, "tracking.system_metrics=false", env=env)
    try:
        _wait_for_a_step(proc, run_dir, tracked=True)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    assert _gone(str(run_dir)) == []
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert db.execute("select status from runs").fetchall() == [("KILLED",)]


@pytest.mark.usefixtures("cold_agents")  # (leftover_processes: a job's processes by their command line)
def test_ranks_die_with_a_sigkilled_launcher(tmp_path):
    import signal

    run_dir = tmp_path / "run"
    proc = _start_train(tmp_path, run_dir, "tracking.enabled=false")
    try:
        _wait_for_a_step(proc, run_dir)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        left = _gone(str(run_dir))
    finally:
        for line in leftover_processes(str(run_dir)):  # never leave them running for other tests
            subprocess.run(["kill", "-9", line.split()[0]], check=False)
    assert left == [], left


def test_a_second_job_in_a_used_run_dir_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000009").mkdir(parents=True)  # an earlier job's files
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/loss": 9.0}\n{"step": 2, "train/lo')
    before = (run_dir / "metrics.jsonl").read_text()
    one = ("hardware.devices_per_node=1",)
    r = run_cli("train", *TINY, *one, f"run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2 and "run.dir" in r.stderr and "not empty" in r.stderr, r.stderr
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing mixed in
    r = run_cli("train", *TINY, *one, f"run.dir={run_dir}", "run.overwrite=true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]  # the old job's lines are gone
    assert not (run_dir / "checkpoints").exists()
