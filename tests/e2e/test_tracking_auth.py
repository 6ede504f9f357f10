"""Tracking against a real authenticated server: `mlflow server --app-name basic-auth` on 127.0.0.1
(one per module; it needs Flask-WTF, from the test extras), credentials from
MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD.

- right credentials, given in the URI (http://user:password@host): the job's run lands (metrics,
  artifacts, model), and the password appears nowhere: not in params, tags, artifacts, any file of
  the run directory (tracking.json, logs), the console, nor in the environment or command line of
  torchrun or any rank (read from /proc while the job runs);
- wrong or missing credentials: exit 2 before anything starts, one clear line, no traceback.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.tracking_support import answers, free_port, in_use

from fleetwise.tracking.commands import ui_env

pytestmark = pytest.mark.slow

USER, PASSWORD = "fleetwise-ci", "Pw-only-in-the-launcher-7351"
SECRETS = (PASSWORD, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode())
JOB = ("recipe=gpt/tiny", "train.steps=3", "hardware.devices_per_node=2", "tracking.experiment=auth")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth-server")
    ini = root / "basic_auth.ini"
    ini.write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{root / 'users.db'}\n"
        f"admin_username = {USER}\nadmin_password = {PASSWORD}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    env = {**ui_env(), "MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_FLASK_SERVER_SECRET_KEY": "ci-only"}
    proc = None
    try:
        for _ in range(3):  # a port found free may be taken before the server binds it: take another
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--app-name",
                "basic-auth",
                "--host",
                "127.0.0.1",
            ]
            cmd += [
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{root / 'mlflow.db'}",
            ]
            cmd += ["--artifacts-destination", str(root / "artifacts")]
            log_path = root / f"server-{port}.log"
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            began = time.monotonic()
            while not answers(url + "/health"):  # /health is open; everything else needs credentials
                if proc.poll() is not None or time.monotonic() - began > 180:
                    break
                time.sleep(0.25)
            else:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(20)
            if not in_use(log_path.read_text(errors="replace")):
                pytest.fail("basic-auth server did not start:\n" + log_path.read_text()[-3000:])
        else:
            pytest.fail("basic-auth server: every port tried was taken")
        yield url
    finally:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(20)


def train(tmp_path: Path, url: str, user: str | None, password: str | None, *extra: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["MLFLOW_TRACKING_URI"] = url
    if user is not None:
        env |= {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}
    cmd = [str(Path(sys.executable).parent / "fleetwise"), "train", *JOB, *extra]
    return subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.parametrize(
    "user,password,expect",
    [
        (USER, "wrong-password", f"refused user '{USER}': HTTP 401"),
        (None, None, "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD are not set"),
    ],
)
def test_refused_credentials_exit_2_before_launch(tmp_path, server, user, password, expect):
    run_dir = tmp_path / "run"
    proc = train(tmp_path, server, user, password, f"run.dir={run_dir}")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert expect in err and "tracking.enabled=false" in err and "Traceback" not in err + out
    assert "wrong-password" not in err + out
    assert not run_dir.exists()  # nothing started, nothing spooled


def _environments(marker: str) -> dict[int, tuple[bool, dict[str, str]]]:
    """pid -> (is a rank, environment and, as "cmdline", the command line) of torchrun's agent (a
    live process whose command line mentions `marker`) and every process under it: the fork server
    (the agent forked), the ranks forked from it (their command line is the server's), multiprocessing's resource
    tracker. The launcher itself, `fleetwise train`, holds the credentials and is not one of them."""
    procs = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            status = (proc / "status").read_text()
            raw = (proc / "environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        env = dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)
        procs[int(proc.name)] = (ppid, cmdline, env | {"cmdline": cmdline})
    agents = {p for p, (_, cmd, _) in procs.items() if marker in cmd and "fleetwise.launcher.agent" in cmd}
    # the fork server is the agent forked (its command line), or multiprocessing's own server
    servers = {p for p, (ppid, cmd, _) in procs.items() if ppid in agents and ("fleetwise.launcher.agent" in cmd
               or "multiprocessing.forkserver" in cmd)}  # fmt: skip
    found, frontier = {}, set(agents)
    while frontier:
        for pid in frontier:
            ppid, cmd, env = procs[pid]
            found[pid] = (ppid in servers, env)
        frontier = {p for p, (ppid, _, _) in procs.items() if ppid in frontier and p not in found}
    return found


# (a new agent: its processes are found by command line, and /proc/PID/environ is what a process
# was started with -- a pooled agent's is its pool process's)
@pytest.mark.usefixtures("cold_agents")
def test_run_lands_and_credentials_stay_in_the_launcher(tmp_path, server):
    run_dir = tmp_path / "run"
    in_uri = server.replace("http://", f"http://{USER}:{PASSWORD}@")
    proc = train(tmp_path, in_uri, None, None, f"run.dir={run_dir}")
    seen: dict[int, tuple[bool, dict[str, str]]] = {}
    while proc.poll() is None:  # sample the ranks' and torchrun's environments while they live
        seen |= _environments(str(run_dir))
        time.sleep(0.5)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert sum(rank for rank, _ in seen.values()) == 2, "did not catch both ranks alive"
    envs = {pid: env for pid, (_, env) in seen.items()}
    assert all("PATH" in e for e in envs.values())  # the rest of the environment passes
    assert all(
        "MLFLOW_TRACKING_USERNAME" not in e and "MLFLOW_TRACKING_PASSWORD" not in e for e in envs.values()
    )
    assert not [v for e in envs.values() for v in e.values() if PASSWORD in v]  # nor the URI, nor argv

    os.environ.update(MLFLOW_TRACKING_USERNAME=USER, MLFLOW_TRACKING_PASSWORD=PASSWORD)
    try:
        from mlflow import MlflowClient

        client = MlflowClient(server)
        (run,) = client.search_runs([client.get_experiment_by_name("auth").experiment_id])
        assert run.info.status == "FINISHED"
        assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 3
        assert "eval/loss" in run.data.metrics  # the model was logged through the same credentials
        artifacts = Path(client.download_artifacts(run.info.run_id, "", dst_path=str(tmp_path / "dl")))
    finally:
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(key, None)
    assert {"config.yaml", "plan.json", "command.txt"} <= {p.name for p in artifacts.iterdir()}
    texts = [str(run.data.params), str(run.data.tags), out, err]
    files = [p for root in (artifacts, run_dir) for p in root.rglob("*") if p.is_file()]
    texts += [p.read_bytes().decode(errors="replace") for p in files]
    leaks = [s for s in SECRETS for t in texts if s in t]
    assert not leaks and len(files) > 10
