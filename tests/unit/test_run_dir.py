"""Run directories and checkpoints on disk, without torch: a non-empty run dir is refused, one job
holds it at a time, keep-N follows the written timeline, a torn metrics line is skipped, the
rendezvous id is random per single-node job and shared by the nodes of a multi-node job."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from helpers.config import compose

from fleetwise.launcher import run_dir_guard, torchrun
from fleetwise.runtime.checkpoint_files import (
    META,
    checkpoint_dir,
    complete_checkpoints,
    find_resume,
    next_seq,
    prune,
    sweep_stale,
)


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


def _ckpt(run: Path, step: int, seq: int | None = None) -> Path:
    d = checkpoint_dir(run, step)
    d.mkdir(parents=True)
    meta = {"step": step, "saved_at": time.time(), "files": {}}
    if seq is not None:
        meta["seq"] = seq
    (d / META).write_text(json.dumps(meta))
    return d


def test_keep_n_follows_the_written_timeline_not_the_folder_names(tmp_path):
    # Trained to 30, resumed from 10 and saved 15: 20 and 30 belong to the abandoned timeline.
    for seq, step in enumerate([10, 20, 30, 15]):
        _ckpt(tmp_path, step, seq)
    assert [p.name for p in complete_checkpoints(tmp_path)][-1] == "step_00000015"
    cfg = _cfg("checkpoint.resume=auto", f"run.dir={tmp_path}")
    assert find_resume(cfg, tmp_path).name == "step_00000015"  # not the abandoned step 30
    assert next_seq(tmp_path) == 4
    prune(tmp_path, keep=1)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000015"]


def test_steps_past_10_to_the_8_and_old_checkpoints_without_seq_sort_by_time(tmp_path):
    a = _ckpt(tmp_path, 99_999_999)
    time.sleep(0.01)
    b = _ckpt(tmp_path, 100_000_000)  # "step_100000000" < "step_99999999" as a string
    assert complete_checkpoints(tmp_path) == [a, b]
    prune(tmp_path, keep=1)
    assert complete_checkpoints(tmp_path) == [b]


def test_stale_tmp_checkpoints_are_swept(tmp_path):
    good = _ckpt(tmp_path, 5, 0)
    for name in ("step_00000006.tmp", "step_00000005.replaced.tmp"):
        (tmp_path / "checkpoints" / name).mkdir()
    assert [p.name for p in sweep_stale(tmp_path)] == ["step_00000005.replaced.tmp", "step_00000006.tmp"]
    assert sorted((tmp_path / "checkpoints").iterdir()) == [good]


def test_a_torn_metrics_line_is_skipped_not_fatal():
    assert torchrun.metrics_record('{"step": 3, "train/loss": 1.5}') == {"step": 3, "train/loss": 1.5}
    for torn in ('{"step": 4, "train/lo', "", "[1, 2]", '{"step": "x"}', "\x00\x00"):
        assert torchrun.metrics_record(torn) is None


def test_rdzv_id_is_random_per_single_node_job_and_shared_by_the_nodes_of_one_job():
    one = _cfg("launch.rdzv_endpoint=127.0.0.1:29999")
    assert torchrun.rdzv_id(one) != torchrun.rdzv_id(one) and len(torchrun.rdzv_id(one)) >= 24
    node = ("hardware.nodes=2", "hardware.devices_per_node=2", "launch.rdzv_endpoint=10.0.0.1:29500")
    ids = {torchrun.rdzv_id(_cfg(*node, f"launch.node_rank={r}")) for r in (0, 1)}
    assert len(ids) == 1
    assert torchrun.rdzv_id(_cfg(*node, "train.steps=9")) not in ids  # another job, another id
    assert torchrun.rdzv_id(_cfg(*node, "launch.rdzv_id=job-42")) == "job-42"
    cmd = torchrun.torchrun_command(one, Path("/tmp/run"))
    assert any(c.startswith("--rdzv-id=fw-") for c in cmd)


@pytest.mark.parametrize("resume", ["/etc/passwd", "/etc"])
def test_resume_from_something_that_is_no_checkpoint_is_refused_before_launch(resume):
    from fleetwise.launcher.sweeps import check_points

    problems, checked = check_points([["recipe=gpt/tiny", f"checkpoint.resume={resume}"]])
    assert checked == {}  # nothing to launch
    assert [p.loc for p in problems] == ["checkpoint.resume"], problems


def _listen_address(port: int) -> str:
    """The local address a TCP port listens on, from /proc/net/tcp (hex, little-endian IPv4)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, p = local.split(":")
        if int(p, 16) == port and state == "0A":  # LISTEN
            return ".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0))
    return ""


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="Linux /proc/net/tcp")
def test_single_node_stores_listen_on_loopback_only():
    """torch's TCPStore server binds every interface; the agent's listens on 127.0.0.1."""
    import datetime

    import torch.distributed as dist

    from fleetwise.launcher.agent import loopback_store_class

    store = loopback_store_class(dist.TCPStore)("localhost", 0, is_master=True, multi_tenant=True)
    assert isinstance(store, dist.TCPStore) and _listen_address(store.port) == "127.0.0.1"
    client = dist.TCPStore("127.0.0.1", store.port, timeout=datetime.timedelta(seconds=30))
    client.set("k", "v")
    assert store.get("k") == b"v"
    cmd = torchrun.torchrun_command(_cfg(), Path("/tmp/run"))
    assert cmd[2] == "fleetwise.launcher.agent" and "--local-addr=127.0.0.1" in cmd
    assert any(c.startswith("--rdzv-endpoint=127.0.0.1:") for c in cmd)


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
