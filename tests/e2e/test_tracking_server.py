"""Tracking against a REAL `mlflow server` (subprocess, sqlite backend, artifacts in a temp dir).

One server for the module (it takes 10-30 s to answer here); the outage test stops and restarts it
on the same port and store, so it runs last. A "training job" is simulated by appending lines to
metrics.jsonl, exactly as rank 0 does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.tracking_support import (
    METRICS,
    Messages,
    answers,
    free_port,
    in_use,
    make_run_dir,
    value,
    wait_until,
    write_steps,
)
from omegaconf import OmegaConf

from fleetwise.cli import main
from fleetwise.tracking import run_tracker
from fleetwise.tracking.commands import ui_env
from fleetwise.tracking.run_tracker import RunTracker, read_records, summarize
from fleetwise.tracking.spool import is_behind, load_state
from fleetwise.tracking.sweep import MlflowSweepCallback, parent_run_id_for

STARTUP_TIMEOUT_S = 180


class MlflowServer:
    """`mlflow server` in its own process group, so that stopping it stops all of its workers."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts: list[float] = []  # seconds until /health answered, per start

    def start(self) -> None:
        """Start and wait for /health. The first start takes a new port if the one found free was
        taken meanwhile (EADDRINUSE); a restart keeps its port (the tests' URI names it) and tries
        again after a moment."""
        for attempt in range(3):
            if self._start_once():
                return
            if not self.starts:
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
            time.sleep(1.0 * (attempt + 1))
        pytest.fail(f"mlflow server could not bind {self.url}: the port stayed in use")

    def _start_once(self) -> bool:
        """False when the port was in use; fails the test on any other start-up failure."""
        logfile = self.root / "server.log"
        seen = logfile.stat().st_size if logfile.exists() else 0
        log = open(logfile, "ab")  # noqa: SIM115 (the server holds it)
        cmd = [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root}/mlflow.db",
        ]
        cmd += ["--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), "--workers", "1"]
        began = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=ui_env(), start_new_session=True
        )
        log.close()
        while not answers(self.url + "/health"):
            if self.proc.poll() is not None or time.monotonic() - began > STARTUP_TIMEOUT_S:
                self.stop()
                tail = logfile.read_bytes()[seen:].decode(errors="replace")
                if in_use(tail):
                    return False
                pytest.fail(f"mlflow server did not come up on {self.url}:\n{tail[-3000:]}")
            time.sleep(0.25)
        self.starts.append(time.monotonic() - began)
        return True

    def stop(self, *, crash: bool = False) -> None:
        """SIGTERM (SIGKILL after 10 s) to the whole group; `crash`: SIGKILL at once."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL if crash else signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow-server"), free_port())
    try:
        srv.start()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MLFLOW_TRACKING_URI", srv.url)
            mp.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
            # Retry quickly so the outage test does not wait out production back-offs (2 s .. 60 s).
            mp.setattr(run_tracker, "BACKOFF_FIRST_S", 0.2)
            mp.setattr(run_tracker, "BACKOFF_MAX_S", 0.5)
            yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    from mlflow import MlflowClient

    return MlflowClient(server.url)


def job(run_dir: Path, messages: Messages | None = None, **kw) -> RunTracker:
    args = dict(
        experiment="e2e",
        run_name=run_dir.name,
        params={"strategy": {"name": "dp", "dp_degree": 2}, "model": {"num_layers": 2}},
        tags={"fleetwise.recipe": "gpt/tiny", "fleetwise.strategy": "dp", "fleetwise.world_size": "2"},
        artifacts=[Path("config.yaml"), Path("plan.json"), Path("command.txt")],
        system_metrics=False,
        notify=messages if messages is not None else Messages(),
    )
    return RunTracker(run_dir, **(args | kw))


def steps_of(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def drain(t: RunTracker, expected: int, timeout: float = 60) -> int:
    """Poll like the launcher's loop until `expected` steps went out (or time runs out)."""
    got = 0

    def more() -> bool:
        nonlocal got
        got += t.poll()
        return got >= expected

    wait_until(more, timeout, interval=0.2)
    return got


def test_a_run_reaches_the_server_whole(server, client, tmp_path):
    run_dir = make_run_dir(tmp_path, "whole")
    t = job(run_dir, system_metrics=True)
    run_id = t.start()
    assert run_id
    write_steps(run_dir, range(1, 41))
    assert drain(t, 40) == 40
    # a system-metric sample (0.2 s interval here) has reached the server: waited for, not slept
    # for, since a loaded machine may take seconds
    assert wait_until(
        lambda: any(k.startswith("system/") for k in client.get_run(run_id).data.metrics), 60, 0.25
    )
    t.add_artifacts([run_dir / "logs" / "rank_0.log"])
    summary = summarize(read_records(run_dir), warmup_steps=2)
    t.finish("FINISHED", summary=summary)

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"strategy.name": "dp", "strategy.dp_degree": "2", "model.num_layers": "2"}
    assert run.data.tags["fleetwise.recipe"] == "gpt/tiny" and run.data.tags["fleetwise.world_size"] == "2"
    for name in METRICS:
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
        assert hist == [(s, value(name, s)) for s in range(1, 41)], name
    for key, val in summary.items():
        assert run.data.metrics[key] == pytest.approx(val), key
    assert run.data.metrics["summary/tokens_per_s_mean"] == pytest.approx(
        sum(value("perf/tokens_per_s", s) for s in range(3, 41)) / 38
    )
    assert any(k.startswith("system/") for k in run.data.metrics), sorted(run.data.metrics)
    root = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "plan.json", "command.txt", "logs"} <= root
    assert [a.path for a in client.list_artifacts(run_id, "logs")] == ["logs/rank_0.log"]
    plan = Path(client.download_artifacts(run_id, "plan.json", str(tmp_path)))
    assert plan.read_text() == (run_dir / "plan.json").read_text()


def test_a_failed_run_carries_its_error(server, client, tmp_path):
    run_dir = make_run_dir(tmp_path, "failed")
    t = job(run_dir)
    run_id = t.start()
    write_steps(run_dir, range(1, 6))
    error = "rank 1 died at step 5 (exit code -9)\n" + "x" * 9000 + "\nMemoryError\n"
    t.finish("FAILED", error=error)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    tag = run.data.tags["fleetwise.error"]
    assert tag.startswith("rank 1 died at step 5") and tag.endswith("MemoryError") and "cut" in tag
    assert Path(client.download_artifacts(run_id, "error.txt", str(tmp_path))).read_text() == error
    assert steps_of(client, run_id, "train/loss") == [1, 2, 3, 4, 5]


def test_a_sweep_makes_a_parent_with_children(server, client, tmp_path):
    sweep_dir = tmp_path / "multirun" / "2026-02-03" / "04-05-06"
    config = OmegaConf.create(
        {
            "tracking": {"enabled": True, "experiment": "e2e-sweep"},
            "hydra": {
                "sweep": {"dir": str(sweep_dir)},
                "overrides": {"task": ["strategy=dp,sharding,hybrid"]},
            },
        }
    )
    callback = MlflowSweepCallback()
    callback.on_multirun_start(config)
    parent_id = parent_run_id_for(sweep_dir)
    assert parent_id
    children = []
    for num, strategy in enumerate(["dp", "sharding", "hybrid"]):
        run_dir = make_run_dir(sweep_dir, str(num))
        t = job(
            run_dir,
            experiment="e2e-sweep",
            run_name=f"tiny-{strategy}",
            tags={"fleetwise.strategy": strategy, "fleetwise.world_size": "4"},
            parent_run_id=parent_run_id_for(sweep_dir),
        )
        children.append(t.start())
        write_steps(run_dir, range(1, 11))
        drain(t, 10)
        t.finish("FINISHED", summary=summarize(read_records(run_dir), 2))
    callback.on_multirun_end(config)

    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.params == {"sweep.strategy": "dp,sharding,hybrid"}
    found = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'"
    )
    assert sorted(r.info.run_id for r in found) == sorted(children)
    assert {a.path for a in client.list_artifacts(parent_id)} == {"compare.png", "compare.md"}
    table = Path(client.download_artifacts(parent_id, "compare.md", str(tmp_path))).read_text()
    assert all(f"tiny-{s}" in table for s in ("dp", "sharding", "hybrid"))


def _train(tmp_path, *args, experiment="e2e-train"):
    """A real `fleetwise train` job (2 ranks) logging to the module's server."""
    from helpers.cli import run_cli

    return run_cli(
        "train",
        "recipe=gpt/tiny",
        "train.steps=4",
        "hardware.devices_per_node=2",
        f"tracking.experiment={experiment}",
        *args,
        cwd=tmp_path,
    )


@pytest.mark.slow
def test_a_training_job_logs_one_complete_run(server, client, tmp_path):
    r = _train(tmp_path, f"run.dir={tmp_path / 'job'}", "run.name=tiny-dp")
    assert r.returncode == 0, r.stderr
    (run,) = client.search_runs(
        [client.get_experiment_by_name("e2e-train").experiment_id],
        filter_string="tags.mlflow.runName = 'tiny-dp'",
    )
    assert run.info.status == "FINISHED"
    assert run.data.params["strategy.dp_degree"] == "2" and run.data.params["model.num_layers"] == "4"
    tags = run.data.tags
    assert (tags["fleetwise.recipe"], tags["fleetwise.strategy"], tags["fleetwise.world_size"]) == (
        "gpt/tiny",
        "dp",
        "2",
    )
    for key in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/step_time_s",
        "perf/tokens_per_s",
        "perf/mfu",
    ):
        assert steps_of(client, run.info.run_id, key) == [1, 2, 3, 4], key
    # values that repeat are sent as their runs' ends (README: "Tracking runs in MLflow"): every
    # step's value is the point at that step or, equal, the points on either side of it
    records = read_records(tmp_path / "job")
    for key in ("memory/peak_bytes_max", "memory/peak_bytes_mean", "memory/predicted_bytes"):
        hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert {1, 4} <= set(hist), key
        for record in records:
            step = record["step"]
            if step in hist:
                assert hist[step] == record[key], (key, step)
            else:
                before, after = max(s for s in hist if s < step), min(s for s in hist if s > step)
                assert hist[before] == record[key] == hist[after], (key, step)
    assert {"summary/step_time_median_s", "summary/memory_ratio", "summary/final_loss"} <= set(
        run.data.metrics
    )
    paths = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "plan.json", "command.txt", "logs"} <= paths
    logs = {a.path for a in client.list_artifacts(run.info.run_id, "logs")}
    assert {"logs/rank_0.log", "logs/rank_1.log"} <= logs
    assert run.info.run_id in r.stdout and "fleetwise ui" in r.stdout


@pytest.mark.slow
def test_a_training_job_whose_rank_dies_ends_failed_with_the_error(server, client, tmp_path):
    r = _train(
        tmp_path, f"run.dir={tmp_path / 'dies'}", "run.name=tiny-dies", "fault.kill_rank=1", "fault.at_step=2"
    )
    assert r.returncode != 0
    (run,) = client.search_runs(
        [client.get_experiment_by_name("e2e-train").experiment_id],
        filter_string="tags.mlflow.runName = 'tiny-dies'",
    )
    assert run.info.status == "FAILED"
    assert "injected fault on rank 1 at step 2" in run.data.tags["fleetwise.error"]
    assert steps_of(client, run.info.run_id, "train/loss") == [1]


@pytest.mark.slow
def test_a_training_sweep_logs_a_parent_with_a_child_per_point(server, client, tmp_path):
    r = _train(
        tmp_path, "-m", "strategy=dp,sharding", f"run.dir={tmp_path / 'sweep'}", experiment="e2e-sweep2"
    )
    assert r.returncode == 0, r.stderr
    parent_id = parent_run_id_for(tmp_path / "sweep")
    experiment = client.get_experiment_by_name("e2e-sweep2").experiment_id
    children = client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    assert sorted(c.data.tags["fleetwise.strategy"] for c in children) == ["dp", "sharding"]
    assert {"compare.png", "compare.md"} <= {a.path for a in client.list_artifacts(parent_id)}


def test_batched_delivery_of_300_steps_x_12_metrics(server, client, tmp_path):
    run_dir = make_run_dir(tmp_path, "bench")
    t = job(run_dir, artifacts=[])
    run_id = t.start()
    write_steps(run_dir, range(1, 301))
    began = time.perf_counter()
    delivered = 0
    while n := t.poll(max_batches=100):
        delivered += n
    took = time.perf_counter() - began
    t.finish("FINISHED")
    assert delivered == 300
    assert all(len(client.get_metric_history(run_id, name)) == 300 for name in METRICS)
    # A measurement, not a target (targets live in scripts/bench_tracking.py): printed for the log.
    print(f"\n[bench] poll() delivered 300 steps x {len(METRICS)} metrics over HTTP in {took:.2f} s")


def test_server_outage_spools_then_delivers_everything_after_restart(server, client, tmp_path):
    """A: running across the outage; B: finishes during it (fleetwise sync completes it);
    C: starts during it (its run is created when the server is back)."""
    msgs = {k: Messages() for k in "ABC"}
    a_dir, b_dir, c_dir = (make_run_dir(tmp_path, k) for k in "ABC")
    # with MLflow's system-metrics sampler running, whose thread must not hold up a finish()
    a, b = job(a_dir, msgs["A"], system_metrics=True), job(b_dir, msgs["B"], system_metrics=True)
    a_id, b_id = a.start(), b.start()
    write_steps(a_dir, range(1, 21))
    write_steps(b_dir, range(1, 11))
    assert drain(a, 20) == 20 and drain(b, 10) == 10

    server.stop(crash=True)
    write_steps(a_dir, range(21, 51))  # the job goes on while MLflow is down
    assert [a.poll() for _ in range(5)] == [0] * 5
    write_steps(b_dir, range(11, 26))
    began = time.monotonic()
    b.finish("FINISHED", summary=summarize(read_records(b_dir), 2))
    # shutdown never hangs (MLflow's own retries against a dead server take minutes); the margin
    # over the sampler's stop limit is for a loaded machine
    assert time.monotonic() - began < run_tracker.SYSTEM_METRICS_STOP_S + 30
    c = job(c_dir, msgs["C"])
    assert c.start() is None
    write_steps(c_dir, range(1, 16))
    assert c.poll() == 0
    for k in "ABC":
        assert len(msgs[k].about("unreachable")) == 1, (k, msgs[k])  # told once, not per step
    assert load_state(a_dir).delivered_lines == 20 and is_behind(a_dir) and is_behind(b_dir)

    server.start()  # same port, same backend store
    assert drain(a, 30) == 30
    a.finish("FINISHED")
    assert drain(c, 15) == 15
    c.finish("FINISHED")
    assert main(["sync", str(b_dir)]) == 0  # B's launcher is gone: sync delivers its leftovers

    c_id = load_state(c_dir).run_id
    for run_id, n in ((a_id, 50), (b_id, 25), (c_id, 15)):
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        for name in METRICS:
            assert steps_of(client, run_id, name) == list(range(1, n + 1)), (run_id, name)
    assert client.get_run(b_id).data.metrics["summary/steps"] == 25
    assert {a.path for a in client.list_artifacts(c_id)} >= {"config.yaml", "plan.json", "command.txt"}
    assert len(msgs["A"].about("answers again; delivering")) == 1
    assert not any(is_behind(d) for d in (a_dir, b_dir, c_dir))
    print(f"\n[server] start-up to /health: {', '.join(f'{s:.1f} s' for s in server.starts)}")


def test_fleetwise_ui_serves_the_local_store_and_stops_on_ctrl_c(fleetwise_bin, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    run_dir = make_run_dir(tmp_path / "outputs", "local")
    t = job(run_dir, experiment="fleetwise")
    run_id = t.start()
    write_steps(run_dir, range(1, 4))
    t.finish("FINISHED")
    assert (tmp_path / "mlflow.db").exists() and (tmp_path / "mlartifacts").is_dir()

    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    log = tmp_path / "ui.log"
    for _ in range(3):  # a port found free may be taken before `ui` checks it: it says so, take another
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(log, "w") as sink:
            # Started with SIGINT ignored, as `make test &` or a CI runner's shell starts it: that is
            # why this test failed in full suite runs only (Python then installs no Ctrl-C handler).
            ui = subprocess.Popen(
                [fleetwise_bin, "ui", "--port", str(port)],
                cwd=tmp_path,
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
            )
        wait_until(
            lambda ui=ui, url=url: ui.poll() is not None or f"MLflow UI: {url}" in log.read_text(),
            STARTUP_TIMEOUT_S,
            0.25,
        )
        if ui.poll() is None or "is in use" not in log.read_text():
            break
    try:
        # Ready when it says so (it prints the URL once /health answers), not merely when /health does.
        assert wait_until(lambda: f"MLflow UI: {url}" in log.read_text(), STARTUP_TIMEOUT_S, interval=0.25)
        with urllib.request.urlopen(f"{url}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=10) as r:
            assert r.status == 200 and run_id.encode() in r.read()
        listing = f"{url}/ajax-api/2.0/mlflow/artifacts/list?run_uuid={run_id}"
        with urllib.request.urlopen(listing, timeout=10) as r:
            assert b"config.yaml" in r.read()  # artifacts of the local store are served too
        ui.send_signal(signal.SIGINT)
        ui.wait(timeout=30)
    finally:
        if ui.poll() is None:
            ui.kill()
            ui.wait()
    assert ui.returncode == 0, log.read_text()
    assert not answers(url + "/health")  # the server went with it
