"""Run directories on disk, without torch (launcher/run_dir_guard.py): a non-empty run dir is
refused unless resumed or overwritten, the nodes of one job share it (a later node accepts what
node 0 is still writing), one job holds it at a time, jobs started in the same second get their own
default run dir, a resume from something that is no checkpoint is refused before launch."""

from __future__ import annotations

import os

import pytest
from helpers.config import compose

from fleetwise.launcher import run_dir_guard


def _cfg(*overrides):
    cfg, problems = compose("recipe=gpt/tiny", *overrides)
    assert cfg is not None, problems
    return cfg


def test_a_non_empty_run_dir_is_refused_unless_resumed_or_overwritten(tmp_path):
    run = tmp_path / "run"
    assert run_dir_guard.run_dir_problems(_cfg(f"run.dir={run}")) == []  # new
    run.mkdir()
    (run / run_dir_guard.LOCK_NAME).write_text("pid 1\n")
    assert run_dir_guard.run_dir_problems(_cfg(f"run.dir={run}")) == []  # only a lock file: empty
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (p,) = run_dir_guard.run_dir_problems(_cfg(f"run.dir={run}"))
    assert p.loc == "run.dir" and "metrics.jsonl" in p.msg
    assert "checkpoint.resume=auto" in p.hint and "run.overwrite=true" in p.hint
    assert run_dir_guard.run_dir_problems(_cfg(f"run.dir={run}", "run.overwrite=true")) == []
    assert run_dir_guard.run_dir_problems(_cfg(f"run.dir={run}", "checkpoint.resume=auto")) == []


def test_the_nodes_of_one_multi_node_job_may_share_the_run_dir(tmp_path):
    run = tmp_path / "run"
    node = ("hardware.nodes=2", "hardware.devices_per_node=2", "launch.rdzv_endpoint=127.0.0.1:29999")
    cfg0 = _cfg(f"run.dir={run}", *node, "launch.node_rank=0")
    cfg1 = _cfg(f"run.dir={run}", *node, "launch.node_rank=1")
    run.mkdir()
    import yaml

    (run / "config.yaml").write_text(yaml.safe_dump(cfg1.model_dump(mode="json")))
    assert run_dir_guard.run_dir_problems(cfg0) == []  # node 1 of the same job wrote it
    other = _cfg(f"run.dir={run}", *node, "launch.node_rank=0", "train.steps=7")
    assert [p.loc for p in run_dir_guard.run_dir_problems(other)] == ["run.dir"]  # another job did


def test_overwrite_clears_the_old_jobs_files_only(tmp_path):
    for name in ("metrics.jsonl", "config.yaml", "notes.txt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "checkpoints" / "step_00000001").mkdir(parents=True)
    run_dir_guard.clear_run_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_one_job_holds_the_run_dir_at_a_time(tmp_path):
    import subprocess
    import sys

    held = run_dir_guard.lock_run_dir(tmp_path)
    code = (
        "import sys; from pathlib import Path; from fleetwise.launcher import run_dir_guard\n"
        "try:\n    run_dir_guard.lock_run_dir(Path(sys.argv[1]))\nexcept run_dir_guard.RunDirBusy as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 3 and f"pid {os.getpid()}" in r.stdout, r
    held.close()
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r  # released with the job
    assert run_dir_guard.lock_run_dir(tmp_path, node_rank=1)  # another node's lock is its own


def test_default_run_dirs_of_jobs_started_in_the_same_second_differ():
    from fleetwise.config.compose import _compose

    dirs = {str(_compose([], hydra_cfg=True).hydra.run.dir) for _ in range(3)}
    assert len(dirs) == 3


@pytest.mark.parametrize("resume", ["/etc/passwd", "/etc"])
def test_resume_from_something_that_is_no_checkpoint_is_refused_before_launch(resume):
    from fleetwise.launcher.sweeps import check_points

    problems, checked = check_points([["recipe=gpt/tiny", f"checkpoint.resume={resume}"]])
    assert checked == {}  # nothing to launch
    assert [p.loc for p in problems] == ["checkpoint.resume"], problems


def test_a_later_node_accepts_the_run_dir_node_0_is_still_writing(tmp_path):
    """Node 0 checks the directory before it writes into it; node 1, starting a moment later, can
    find node 0's .hydra/ and plan.json before its config.yaml (CI saw node 1 exit 2 there and node
    0 wait for it): only a config of another job refuses the directory on a later node."""
    run = tmp_path / "run"
    node = ("hardware.nodes=2", "hardware.devices_per_node=2", "launch.rdzv_endpoint=127.0.0.1:29999")
    run.mkdir()
    (run / ".hydra").mkdir()
    (run / "plan.json").write_text("{}")
    assert run_dir_guard.run_dir_problems(_cfg(f"run.dir={run}", *node, "launch.node_rank=1")) == []
    # node 0 (or a single-node job) still refuses what it did not write itself
    assert [
        p.loc for p in run_dir_guard.run_dir_problems(_cfg(f"run.dir={run}", *node, "launch.node_rank=0"))
    ] == ["run.dir"]
    import yaml

    other = _cfg(f"run.dir={run}", *node, "launch.node_rank=0", "train.steps=7")
    (run / "config.yaml").write_text(yaml.safe_dump(other.model_dump(mode="json")))
    assert [
        p.loc for p in run_dir_guard.run_dir_problems(_cfg(f"run.dir={run}", *node, "launch.node_rank=1"))
    ] == ["run.dir"]


def test_node_0_accepts_the_run_dir_another_node_is_starting_in(tmp_path):
    """Node 1 may start first: before its config.yaml it has made Hydra's .hydra/ and an empty logs/
    (its lock file is no entry). Node 0 checking then is not refused (it exited 2 and left node 1
    waiting for its store); anything a job writes later still refuses it."""
    run = tmp_path / "run"
    node = ("hardware.nodes=2", "hardware.devices_per_node=2", "launch.rdzv_endpoint=127.0.0.1:29999")
    node0 = _cfg(f"run.dir={run}", *node, "launch.node_rank=0")
    run.mkdir()
    (run / ".hydra").mkdir()
    (run / ".fleetwise.lock.node1").write_text("pid 1\n")
    (run / "logs").mkdir()
    assert run_dir_guard.run_dir_problems(node0) == []
    (run / "logs" / "launcher.log").write_text("")  # a node past its config.yaml, or an old job's
    assert [p.loc for p in run_dir_guard.run_dir_problems(node0)] == ["run.dir"]
    (run / "logs" / "launcher.log").unlink()
    (run / "logs").rmdir()
    (run / "logs").write_text("")  # no directory a node makes
    assert [p.loc for p in run_dir_guard.run_dir_problems(node0)] == ["run.dir"]
    (run / "logs").unlink()
    (run / "metrics.jsonl").write_text("{}\n")
    assert [p.loc for p in run_dir_guard.run_dir_problems(node0)] == ["run.dir"]
    # a single-node job still refuses even the directory a node is starting in
    single = _cfg(f"run.dir={run}")
    (run / "metrics.jsonl").unlink()
    assert [p.loc for p in run_dir_guard.run_dir_problems(single)] == ["run.dir"]
