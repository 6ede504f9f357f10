"""The multirun callback and the `fleetwise compare | sync | ui` commands, on a sqlite store."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from helpers.tracking_support import Messages, make_run_dir, refused_port, value, write_steps
from omegaconf import OmegaConf

from fleetwise.cli import main
from fleetwise.tracking.commands import ui_command
from fleetwise.tracking.run_tracker import RunTracker, read_records, summarize
from fleetwise.tracking.spool import load_state
from fleetwise.tracking.sweep import MlflowSweepCallback, parent_run_id_for


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root}/mlflow.db")
        from mlflow import MlflowClient

        yield MlflowClient(f"sqlite:///{root}/mlflow.db")


def hydra_like(sweep_dir: Path, experiment: str) -> object:
    """The parts of Hydra's multirun config the callback reads."""
    return OmegaConf.create(
        {
            "tracking": {"enabled": True, "experiment": experiment, "system_metrics": False},
            "hydra": {
                "sweep": {"dir": str(sweep_dir), "subdir": "${hydra.job.num}"},
                "job": {"num": 0},
                "overrides": {"task": ["strategy=dp,sharding", "train.steps=5"]},
            },
        }
    )


def child(sweep_dir: Path, num: int, strategy: str, experiment: str, *, status: str = "FINISHED") -> str:
    """One sweep job as the launcher would track it."""
    run_dir = make_run_dir(sweep_dir, str(num))
    t = RunTracker(
        run_dir,
        experiment=experiment,
        run_name=f"gpt-tiny-{strategy}",
        params={"strategy": {"name": strategy}},
        tags={"fleetwise.strategy": strategy, "fleetwise.world_size": "2"},
        artifacts=[],
        parent_run_id=parent_run_id_for(sweep_dir),
        system_metrics=False,
        notify=Messages(),
    )
    run_id = t.start()
    write_steps(run_dir, range(1, 6))
    t.poll()
    t.finish(status, summary=summarize(read_records(run_dir), warmup_steps=1))
    return run_id


class JobReturn:  # what Hydra hands to on_job_end
    def __init__(self, failed: bool) -> None:
        self.status = type("Status", (), {"name": "FAILED" if failed else "COMPLETED"})()


def test_a_multirun_gets_a_parent_run_with_its_children_and_their_comparison(store, tmp_path, capsys):
    sweep_dir = tmp_path / "multirun" / "2026-01-02" / "03-04-05"
    config = hydra_like(sweep_dir, "sweeps")
    callback = MlflowSweepCallback()
    callback.on_multirun_start(config)
    parent_id = parent_run_id_for(sweep_dir)
    assert parent_id and json.loads((sweep_dir / "parent_run.json").read_text())["run_id"] == parent_id

    kids = [child(sweep_dir, i, s, "sweeps") for i, s in enumerate(["dp", "sharding"])]
    for _ in kids:
        callback.on_job_end(config, job_return=JobReturn(failed=False))
    callback.on_multirun_end(config)
    said = capsys.readouterr().out  # the sweep names its parent run and where the comparison went
    assert f"sweep FINISHED: 2 runs under the MLflow parent run {parent_id}" in said
    assert str(sweep_dir / "compare.md") in said

    parent = store.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.info.run_name == "sweep-2026-01-02-03-04-05"
    assert parent.data.params == {"sweep.strategy": "dp,sharding", "sweep.train.steps": "5"}
    assert (
        parent.data.tags["fleetwise.sweep"] == "parent"
        and parent.data.tags["fleetwise.sweep_children"] == "2"
    )
    for run_id in kids:
        assert store.get_run(run_id).data.tags["mlflow.parentRunId"] == parent_id
    assert {a.path for a in store.list_artifacts(parent_id)} == {"compare.png", "compare.md"}
    table = (sweep_dir / "compare.md").read_text()
    assert "gpt-tiny-dp" in table and "gpt-tiny-sharding" in table
    assert (sweep_dir / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # `fleetwise compare PARENT` compares the children
    assert main(["compare", parent_id, "--out", str(tmp_path / "c.png")]) == 0


def test_a_sweep_stopped_by_a_failing_job_still_ends_its_parent(store, tmp_path):
    sweep_dir = tmp_path / "multirun" / "d" / "t"
    config = hydra_like(sweep_dir, "sweeps-failed")
    callback = MlflowSweepCallback()
    callback.on_multirun_start(config)
    parent_id = parent_run_id_for(sweep_dir)
    child(sweep_dir, 0, "dp", "sweeps-failed", status="FAILED")
    callback.on_job_end(config, job_return=JobReturn(failed=True))
    # Hydra's basic sweeper re-raises the job's error: on_multirun_end never comes; atexit does.
    callback._end_at_exit()
    parent = store.get_run(parent_id)
    assert parent.info.status == "FAILED" and parent.data.tags["fleetwise.sweep_failed"] == "1"
    callback._end_at_exit()  # idempotent


def test_an_unreachable_server_does_not_break_a_sweep(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{refused_port()}")
    sweep_dir = tmp_path / "multirun" / "x" / "y"
    callback = MlflowSweepCallback()
    callback.on_multirun_start(hydra_like(sweep_dir, "e"))
    callback.on_multirun_end(hydra_like(sweep_dir, "e"))
    assert parent_run_id_for(sweep_dir) is None
    assert "unreachable" in capsys.readouterr().err


def test_compare_prints_a_table_and_writes_a_png(store, tmp_path, capsys):
    for i, strategy in enumerate(["dp", "hybrid"]):
        child(tmp_path / "runs", i, strategy, "cmp")
    out = tmp_path / "charts" / "cmp.png"
    assert main(["compare", "--experiment", "cmp", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out.resolve()) in printed
    for word in ("gpt-tiny-dp", "gpt-tiny-hybrid", "hybrid", "tokens/s", "final loss", "KiB"):
        assert word in printed, word
    # tokens/s of the summary: mean over steps 2..5 of the fake job's perf/tokens_per_s
    mean = sum(value("perf/tokens_per_s", s) for s in range(2, 6)) / 4
    assert f"{mean / 1000:.3g}k tokens/s" in printed


def test_compare_names_run_ids_the_differing_param_newest_first_and_takes_id_prefixes(
    store, tmp_path, capsys
):
    ids = []
    for i, strategy in enumerate(["dp", "sharding"]):
        ids.append(child(tmp_path / "runs", i, strategy, "cmp2"))
        time.sleep(0.01)  # distinct start times (milliseconds) to order by
    assert main(["compare", "--experiment", "cmp2", "--out", str(tmp_path / "c.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "run id" in line)
    assert "strategy.name" in header  # the param the two runs differ in has a column
    rows = [line for line in lines if ids[0][:8] in line or ids[1][:8] in line]
    assert [ids[1][:8] in rows[0], ids[0][:8] in rows[1]] == [True, True]  # newest first
    # the 8 characters the table shows are enough to name a run
    assert main(["compare", ids[0][:8], ids[1][:8], "--out", str(tmp_path / "d.png")]) == 0
    assert "2 runs" in capsys.readouterr().out


def test_compare_with_nothing_to_compare_says_what_to_do(store, capsys):
    assert main(["compare", "--experiment", "no-such-experiment"]) == 1
    err = capsys.readouterr().err
    assert "no runs" in err and "fix:" in err


def test_sync_finds_run_dirs_that_are_behind_and_delivers_them(store, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_dir = make_run_dir(tmp_path / "outputs" / "2026-01-01", "10-00-00")
    t = RunTracker(
        run_dir, experiment="sync", run_name="r", params={}, tags={}, artifacts=[], system_metrics=False
    )
    run_id = t.start()
    t._lock.release()  # the launcher died
    write_steps(run_dir, range(1, 8))
    assert main(["sync"]) == 0
    assert "7 steps delivered" in capsys.readouterr().out
    assert len(store.get_metric_history(run_id, "train/loss")) == 7
    assert main(["sync"]) == 0 and "nothing to sync" in capsys.readouterr().out
    assert main(["sync", str(tmp_path / "nope")]) == 2
    assert load_state(run_dir).delivered_lines == 7


def test_ui_serves_the_same_store_on_localhost_and_refuses_a_busy_port(store, capsys):
    from fleetwise.tracking.store import tracking_uri

    cmd = ui_command(tracking_uri(), "127.0.0.1", 5123)
    assert cmd[cmd.index("--backend-store-uri") + 1] == tracking_uri()
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "5123"
    assert Path(cmd[cmd.index("--artifacts-destination") + 1]).name == "mlartifacts"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["ui", "--port", str(port)]) == 1
    assert f"--port {port + 1}" in capsys.readouterr().err


def test_ui_with_a_tracking_server_points_at_it(monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert main(["ui"]) == 0
    assert "http://mlflow.example:5000" in capsys.readouterr().out
