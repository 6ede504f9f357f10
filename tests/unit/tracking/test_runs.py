"""RunTracker and sync against a real MLflow sqlite store in a temp dir (no server)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.tracking_support import (
    METRICS,
    Messages,
    make_run_dir,
    refused_port,
    value,
    wait_until,
    write_steps,
)

from fleetwise.tracking import run_tracker
from fleetwise.tracking.run_tracker import RunTracker, flatten_config, read_records, summarize, sync_run_dir
from fleetwise.tracking.spool import is_behind, load_state

CFG = {"strategy": {"name": "dp", "dp_degree": 2}, "model": {"num_layers": 2, "layer_split": [0, 1]}}
TAGS = {
    "fleetwise.recipe": "gpt/tiny",
    "fleetwise.strategy": "dp",
    "fleetwise.hardware": "cpu",
    "fleetwise.world_size": "2",
    "fleetwise.git_commit": "0123456789abcdef0123456789abcdef01234567",
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module: creating its tables takes ~2 s."""
    root = tmp_path_factory.mktemp("store")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
        mp.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.1")
        from mlflow import MlflowClient

        yield MlflowClient(f"sqlite:///{root}/mlflow.db")


def tracker(run_dir: Path, messages: Messages | None = None, **kw) -> RunTracker:
    args = dict(
        experiment="unit",
        run_name=run_dir.name,
        params=CFG,
        tags=TAGS,
        artifacts=[Path("config.yaml"), run_dir / "plan.json", run_dir / "command.txt"],
        system_metrics=False,
        notify=messages if messages is not None else Messages(),
    )
    return RunTracker(run_dir, **(args | kw))


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def crash(t: RunTracker) -> None:
    """What a killed launcher leaves behind: no finish(), its lock gone with the process."""
    t._stop_system_metrics()
    t._lock.release()


def test_a_run_gets_params_tags_artifacts_every_step_and_its_summary(store, tmp_path):
    run_dir = make_run_dir(tmp_path, "run-a")
    t = tracker(run_dir, system_metrics=True)
    run_id = t.start()
    assert run_id and load_state(run_dir).run_id == run_id

    write_steps(run_dir, range(1, 26), torn_tail='{"step": 26, "train/lo')
    assert t.poll() == 25
    assert t.poll() == 0  # nothing new; the torn line waits for its newline
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('ss": 0.5}\n')
    assert t.poll() == 1
    # the system-metrics sampler (0.1 s here) has logged a sample; on a loaded machine that may take
    # seconds, so wait for it rather than sleep a fixed time
    assert wait_until(lambda: any(k.startswith("system/cpu") for k in store.get_run(run_id).data.metrics), 60)
    t.add_artifacts([run_dir / "logs" / "rank_0.log"])
    summary = summarize(read_records(run_dir), warmup_steps=2)
    t.finish("FINISHED", summary=summary)

    run = store.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-a"
    assert run.data.params == flatten_config(CFG)
    assert {k: run.data.tags[k] for k in TAGS} == TAGS
    assert run.data.tags["mlflow.source.git.commit"] == TAGS["fleetwise.git_commit"]
    for name in METRICS:
        assert history(store, run_id, name)[:25] == [(s, value(name, s)) for s in range(1, 26)], name
    assert history(store, run_id, "train/loss")[-1:] == [(26, 0.5)]
    # timestamps are when the step happened ("time" in the record), not when it was shipped
    first = min(store.get_metric_history(run_id, "train/lr"), key=lambda m: m.step)
    assert first.timestamp == int((1.7e9 + 1) * 1000)
    for key, val in summary.items():
        assert run.data.metrics[key] == pytest.approx(val), key
    assert run.data.metrics["summary/final_loss"] == 0.5
    assert any(k.startswith("system/cpu") for k in run.data.metrics), sorted(run.data.metrics)
    paths = {a.path for a in store.list_artifacts(run_id)} | {
        a.path for a in store.list_artifacts(run_id, "logs")
    }
    assert paths >= {"config.yaml", "plan.json", "command.txt", "logs/rank_0.log"}
    state = load_state(run_dir)
    assert state.closed and state.delivered_lines == 26 and not is_behind(run_dir)
    assert t.poll() == 0  # a finished tracker is inert


def test_a_resumed_job_continues_its_run_and_keeps_the_original_params(store, tmp_path):
    run_dir = make_run_dir(tmp_path, "run-resume")
    first = tracker(run_dir)
    run_id = first.start()
    write_steps(run_dir, range(1, 11))
    assert first.poll() == 10
    crash(first)

    messages = Messages()
    changed = {"strategy": {"name": "dp", "dp_degree": 4}, "model": CFG["model"], "train": {"steps": 40}}
    second = tracker(run_dir, messages, params=changed)
    assert second.start() == run_id  # same run, not a new one
    assert store.get_run(run_id).info.status == "RUNNING"
    write_steps(run_dir, range(8, 21))  # resumed from a checkpoint at step 7: steps 8-10 run again
    assert second.poll() == 10
    second.finish("FINISHED")

    run = store.get_run(run_id)
    assert run.data.params["strategy.dp_degree"] == "2"  # MLflow params are immutable
    assert run.data.params["train.steps"] == "40"  # a new key is added
    assert len(messages.about("changed param")) == 1 and "strategy.dp_degree" in messages[0]
    assert history(store, run_id, "train/loss") == [(s, value("train/loss", s)) for s in range(1, 21)]
    assert load_state(run_dir).rerun_lines == 3  # each step logged once


def test_a_failed_run_carries_its_error_as_tag_and_error_txt(store, tmp_path):
    run_dir = make_run_dir(tmp_path, "run-failed")
    t = tracker(run_dir)
    run_id = t.start()
    write_steps(run_dir, range(1, 4))
    error = "rank 1 failed at step 3: RuntimeError: boom\n" + "  frame\n" * 2000 + "RuntimeError: boom\n"
    t.finish("FAILED", error=error)

    run = store.get_run(run_id)
    assert run.info.status == "FAILED"
    tag = run.data.tags["fleetwise.error"]
    assert (
        tag.startswith("rank 1 failed at step 3") and tag.endswith("RuntimeError: boom") and len(tag) <= 5000
    )
    local = Path(store.download_artifacts(run_id, "error.txt", str(tmp_path)))
    assert local.read_text() == error == (run_dir / "error.txt").read_text()
    assert len(store.get_metric_history(run_id, "train/loss")) == 3  # finish() shipped what was left


def test_a_failed_run_resumed_to_the_end_loses_its_error_tag(store, tmp_path):
    run_dir = make_run_dir(tmp_path, "run-failed-resumed")
    first = tracker(run_dir)
    run_id = first.start()
    write_steps(run_dir, range(1, 4))
    first.finish("FAILED", error="rank 1 failed at step 3: RuntimeError: boom")
    assert "fleetwise.error" in store.get_run(run_id).data.tags

    second = tracker(run_dir)
    assert second.start() == run_id  # the resume continues the same run
    write_steps(run_dir, range(4, 8))
    second.finish("FINISHED")
    run = store.get_run(run_id)
    assert run.info.status == "FINISHED" and "fleetwise.error" not in run.data.tags


def test_malformed_lines_are_skipped_and_a_refused_line_never_blocks_the_spool(store, tmp_path, monkeypatch):
    run_dir = make_run_dir(tmp_path, "run-bad-lines")
    messages = Messages()
    t = tracker(run_dir, messages)
    run_id = t.start()
    write_steps(run_dir, range(1, 3))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write("this is not json\n\n")
    write_steps(run_dir, range(3, 6))

    # Fault injection: MLflow refuses (HTTP 400) any batch holding step 4.
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    real = t._client.log_batch

    def picky(run_id, metrics=(), **kw):
        if any(m.step == 4 for m in metrics):
            raise MlflowException("step 4 refused", INVALID_PARAMETER_VALUE)
        return real(run_id, metrics=metrics, **kw)

    monkeypatch.setattr(t._client, "log_batch", picky)
    assert t.poll() == 4  # steps 1, 2, 3, 5
    assert [s for s, _ in history(store, run_id, "train/loss")] == [1, 2, 3, 5]
    state = load_state(run_dir)
    assert (
        state.skipped_lines == 2 and state.delivered_lines == 7
    )  # garbage + refused; the blank line is neither
    assert len(messages.about("refused")) == 1
    t.finish("FINISHED")


def test_records_without_step_or_time_are_numbered_by_line_across_batches(store, tmp_path):
    run_dir = make_run_dir(tmp_path, "run-no-step")
    t = tracker(run_dir)
    run_id = t.start()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i in range(200):  # 200 x 12 metrics: three log_batch calls
            f.write(json.dumps({f"m{k}": float(i) for k in range(12)}) + "\n")
    began = int(time.time() * 1000)
    assert t.poll() == 200
    hist = store.get_metric_history(run_id, "m7")
    assert sorted((m.step, m.value) for m in hist) == [(i, float(i)) for i in range(200)]
    assert all(m.timestamp >= began for m in hist)  # no "time" in the record: when it was shipped
    t.finish("FINISHED")


def test_repeated_values_are_sent_as_their_runs_ends_and_every_step_is_recoverable(store, tmp_path):
    """A run-length delivery (README: "Tracking runs in MLflow"): of a metric that keeps its value
    only each run's first and last step, and every delivery's last step, reach MLflow; the charts
    (lines between points) and the values of every step are exactly what metrics.jsonl says."""
    run_dir = make_run_dir(tmp_path, "run-elided")
    t = tracker(run_dir)
    run_id = t.start()
    calls = []
    real = t._client.log_batch

    def counting(run_id, metrics=(), **kw):
        calls.append(len(metrics))
        return real(run_id, metrics=metrics, **kw)

    t._client.log_batch = counting

    def step_record(step: int) -> dict:  # as rank 0 writes them: 8 metrics change every step, 7 rarely
        varying = {f"perf/v{k}": step * 10.0 + k for k in range(8)}
        rare = {
            "job/world_size": 2.0,
            "job/attempt": 0.0 if step <= 150 else 1.0,  # a restart
            "memory/predicted_bytes": 1e9,
            "memory/peak_bytes_max": 5e8 if step == 1 else 6e8,
            "memory/peak_bytes_mean": 3e8 if step in (40, 41) else 4e8,
            "memory/rss_peak_bytes_max": 7e8 + (step // 100),
            "train/skipped_steps": float("nan") if step == 77 else 0.0,
        }
        return {"step": step, "time": 1.7e9 + step, **varying, **rare}

    steps = range(1, 301)
    for chunk in range(10):  # ten deliveries, as the launcher's thread makes them
        with open(run_dir / "metrics.jsonl", "a") as f:
            for step in steps[chunk * 30 : (chunk + 1) * 30]:
                f.write(json.dumps(step_record(step)) + "\n")
        assert t.poll() == 30
    t.finish("FINISHED")

    points = 0
    for key in step_record(1):
        if key in ("step", "time"):
            continue
        hist = dict(history(store, run_id, key))
        points += len(hist)
        logged = sorted(hist)
        assert logged[-1] == 300, key  # MLflow's latest value is the last step's
        for step in steps:  # each step: its own point, or equal points on either side of it
            want = step_record(step)[key]
            if step in hist:
                got = hist[step]
            else:
                before = max(s for s in logged if s < step)
                after = min(s for s in logged if s > step)
                assert repr(hist[before]) == repr(hist[after]), (key, step)
                got = hist[before]
            assert repr(got) == repr(want), (key, step, got, want)
    assert len(dict(history(store, run_id, "job/world_size"))) == 11  # step 1 and each delivery's last
    assert 8 * 300 < points <= 8 * 300 + 100  # not 15 x 300 = 4500: one point per metric and step
    assert sum(calls) == points and len(calls) == 10  # one log_batch per delivery of < 1000 points


def test_a_dead_server_costs_seconds_is_reported_once_and_keeps_the_spool(tmp_path, monkeypatch):
    # credentials in the URI: they leave it for MLflow's own variables, never written or said
    port = refused_port()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://fw-user:S3cret%40in-uri@127.0.0.1:{port}")
    for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(key, "restored-after-the-test")
        monkeypatch.delenv(key)
    run_dir = make_run_dir(tmp_path, "run-dead")
    messages = Messages()
    t = tracker(run_dir, messages)
    began = time.monotonic()
    assert t.start() is None
    write_steps(run_dir, range(1, 6))
    assert [t.poll() for _ in range(5)] == [0] * 5  # never raises; backs off
    t.finish("FINISHED", summary={"summary/final_loss": 1.0})
    # seconds, not MLflow's own retries (minutes per call): generous for a loaded machine
    assert time.monotonic() - began < 60
    assert len(messages.about("unreachable")) == 1, messages
    assert "fleetwise sync" in messages[-1] and t.warning == messages[-1]
    state = load_state(run_dir)
    assert state.run_id is None and state.final["status"] == "FINISHED" and is_behind(run_dir)
    import os

    assert state.tracking_uri == os.environ["MLFLOW_TRACKING_URI"] == f"http://127.0.0.1:{port}"
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == (
        "fw-user",
        "S3cret@in-uri",
    )
    written = [p.read_text() for p in run_dir.rglob("*") if p.is_file()]
    assert not [t for t in written + list(messages) if "S3cret" in t]


def test_sync_delivers_what_a_crashed_launcher_left_and_skips_a_live_one(store, tmp_path):
    run_dir = make_run_dir(tmp_path, "run-crashed")
    t = tracker(run_dir)
    run_id = t.start()
    write_steps(run_dir, range(1, 6))
    assert t.poll() == 5

    messages = Messages()
    write_steps(run_dir, range(6, 9))
    assert sync_run_dir(run_dir, notify=messages) == 0  # the launcher still holds the run dir
    assert messages.about("running job")

    crash(t)
    write_steps(run_dir, range(9, 13), torn_tail='{"step": 13, "tra')
    assert sync_run_dir(run_dir) == 7
    assert [s for s, _ in history(store, run_id, "perf/mfu")] == list(range(1, 13))
    assert store.get_run(run_id).info.status == "RUNNING"  # nobody said how it ended
    assert not is_behind(run_dir)  # the torn line of a dead writer is dropped, not waited for


def test_sync_finishes_a_run_whose_end_did_not_reach_mlflow(store, tmp_path):
    run_dir = make_run_dir(tmp_path, "run-late-end")
    t = tracker(run_dir)
    run_id = t.start()
    write_steps(run_dir, range(1, 4))
    crash(t)
    # As finish() leaves it when the server is down: final recorded, not delivered.
    state = load_state(run_dir)
    state.final = {
        "status": "KILLED",
        "error": None,
        "summary": {"summary/final_loss": 2.0},
        "end_time_ms": 1,
    }
    from fleetwise.tracking.spool import save_state

    save_state(run_dir, state)
    assert sync_run_dir(run_dir) == 3
    run = store.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.metrics["summary/final_loss"] == 2.0
    assert not is_behind(run_dir) and sync_run_dir(run_dir) == 0


def test_a_disabled_tracker_does_nothing(tmp_path):
    run_dir = make_run_dir(tmp_path, "run-off")
    t = tracker(run_dir, enabled=False)
    assert t.start() is None and t.poll() == 0
    t.add_artifacts([run_dir / "plan.json"])
    t.finish("FINISHED")
    assert not (run_dir / "tracking.json").exists()


def test_backoff_doubles_and_caps(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{refused_port()}")
    t = tracker(make_run_dir(tmp_path, "run-backoff"))
    t.start()
    expected = [4, 8, 16, 32, 60, 60, 60, 60]  # start() was failure 1 (2 s)
    for delay in expected:
        # the delay lies between the clock read before and after the call, however long a loaded
        # machine makes it (a rounded difference to one later read could be off by one)
        before = time.monotonic()
        t._failed(RuntimeError("down"))
        after = time.monotonic()
        assert before + delay <= t._retry_at <= after + delay
    assert run_tracker.BACKOFF_MAX_S == 60


@pytest.mark.slow  # starts processes
def test_tracking_never_imports_torch_and_the_cli_never_imports_mlflow_until_used(store, tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        import fleetwise.cli
        import fleetwise.tracking.run_tracker, fleetwise.tracking.sweep, fleetwise.tracking.compare
        heavy = sorted(m for m in ("mlflow", "torch", "matplotlib") if m in sys.modules)
        assert not heavy, heavy
        import pathlib
        from fleetwise.tracking.run_tracker import RunTracker
        d = pathlib.Path({str(tmp_path)!r}) / "run"
        t = RunTracker(d, experiment="x", run_name="r", params={{}}, tags={{}}, artifacts=[], system_metrics=False)
        assert t.start()
        t.finish("FINISHED")
        assert "mlflow" in sys.modules and "torch" not in sys.modules
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _nvml_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_gpu(), reason="no NVIDIA GPU visible to NVML")
def test_system_metrics_include_the_gpus_of_the_launchers_node(store, tmp_path):
    t = tracker(make_run_dir(tmp_path, "run-gpu"), system_metrics=True)
    run_id = t.start()
    time.sleep(0.5)
    t.finish("FINISHED")
    metrics = store.get_run(run_id).data.metrics
    assert (
        "system/gpu_0_utilization_percentage" in metrics and "system/gpu_0_memory_usage_megabytes" in metrics
    )


def _orphan(run_dir: Path, *, pid: int, host: str | None = None, seen_ms: int) -> None:
    """tracking.json as a launcher leaves it when killed: its pid, host and last heartbeat."""
    import socket

    from fleetwise.tracking.spool import save_state

    state = load_state(run_dir)
    state.launcher_pid, state.heartbeat_ms = pid, seen_ms
    state.launcher_host = host or socket.gethostname()
    save_state(run_dir, state)


def test_a_killed_launchers_run_is_marked_killed_by_the_next_command_at_its_last_heartbeat(
    store, tmp_path, monkeypatch
):
    from fleetwise.tracking.commands import cmd_compare

    monkeypatch.setattr(run_tracker, "HEARTBEAT_EVERY_S", 0.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid is free now (reaped)
    now_ms = int(time.time() * 1000)
    hour_ago = now_ms - 3_600_000

    # A live launcher stamps tracking.json: its pid, this host, a heartbeat at every poll.
    live_dir = make_run_dir(tmp_path, "live")
    live = tracker(live_dir, experiment="reap")
    live_id = live.start()
    first = load_state(live_dir).heartbeat_ms
    time.sleep(0.01)
    live.poll()
    state = load_state(live_dir)
    assert state.launcher_pid > 0 and state.heartbeat_ms > first >= now_ms

    runs = {}
    for name, pid, host, seen in [
        ("killed-here", dead.pid, None, hour_ago),  # this host, pid gone
        ("lost-node", 1, "elsewhere", hour_ago + 1000),  # another host, silent for an hour
        ("other-host-alive", 1, "elsewhere", now_ms),  # another host, a fresh heartbeat
    ]:
        run_dir = make_run_dir(tmp_path, name)
        t = tracker(run_dir, experiment="reap")
        runs[name] = (t.start(), run_dir, seen)
        write_steps(run_dir, range(1, 4))
        t.poll()
        crash(t)
        write_steps(run_dir, range(4, 6))  # written after the last delivery: delivered by the reaper
        _orphan(run_dir, pid=pid, host=host, seen_ms=seen)

    assert cmd_compare(["-e", "reap", "--out", str(tmp_path / "c.png")]) == 0
    for name in ("killed-here", "lost-node"):
        run_id, run_dir, seen = runs[name]
        run = store.get_run(run_id)
        assert run.info.status == "KILLED" and run.info.end_time == seen
        assert run.data.tags["fleetwise.last_seen"] == time.strftime(
            "%Y-%m-%d %H:%M:%S UTC", time.gmtime(seen / 1000)
        )
        assert "died without ending the run" in run.data.tags["fleetwise.error"]
        assert [s for s, _ in history(store, run_id, "perf/mfu")] == [1, 2, 3, 4, 5]
        assert load_state(run_dir).closed
    assert store.get_run(runs["other-host-alive"][0]).info.status == "RUNNING"
    assert store.get_run(live_id).info.status == "RUNNING"  # its launcher (this process) lives

    # `fleetwise ui` does the same before it serves the store
    from rich.console import Console

    from fleetwise.tracking.commands import _reap_local
    from fleetwise.tracking.store import tracking_uri

    other_id, other_dir, _ = runs["other-host-alive"]
    _orphan(other_dir, pid=1, host="elsewhere", seen_ms=hour_ago)
    with open(tmp_path / "ui.txt", "w") as said:
        _reap_local(tracking_uri(), Console(file=said))
    assert "marked KILLED" in (tmp_path / "ui.txt").read_text()
    assert store.get_run(other_id).info.status == "KILLED"
    live.finish("FINISHED")


def test_a_later_node_finds_the_jobs_run_by_its_tag_when_the_store_is_gone(store, monkeypatch):
    """A short job on a busy node 0 can end (its rendezvous store with it) before node 1 read the
    run id there (seen under `make test-under-load`: "Failed to recv ... Connection was likely
    closed", no system/node_1 metrics): node 1 then finds the run in MLflow by the job's tag."""
    from fleetwise.tracking import nodes
    from fleetwise.tracking.nodes import JOB_TAG, NodeSystemMetrics

    def gone(*args, **kwargs):
        raise ConnectionError("Failed to recv, got 0 bytes. Connection was likely closed.")

    monkeypatch.setattr(nodes, "_store", gone)

    exp = store.get_experiment_by_name("nodes") or store.get_experiment(store.create_experiment("nodes"))
    other = store.create_run(exp.experiment_id, tags={JOB_TAG: "fw-other"}).info.run_id
    mine = store.create_run(exp.experiment_id, tags={JOB_TAG: "fw-mine"}).info.run_id
    endpoint = "127.0.0.1:29400"
    node = NodeSystemMetrics(endpoint, 1, store.tracking_uri, "fw-mine", "nodes")
    node.start()
    node.stop()
    assert node.run_id == mine, node.error
    assert any(k.startswith("system/node_1/") for k in store.get_run(mine).data.metrics)
    assert not store.get_run(other).data.metrics
    # a run of the same job id from before this node started is an earlier job's, not this one's
    # (it searches every 0.5 s through the grace period, shortened here, and must find nothing)
    monkeypatch.setattr(nodes, "START_GRACE_S", 1.5)
    late = NodeSystemMetrics(endpoint, 1, store.tracking_uri, "fw-other", "nodes")
    late._since_ms = store.get_run(other).info.start_time + 1
    late.start()
    late.stop()
    assert late.run_id is None and not store.get_run(other).data.metrics
