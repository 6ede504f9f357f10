"""Checkpoints on disk, without torch (runtime/checkpoint_files.py): keep-N follows the written
timeline, steps past 10^8 and old checkpoints without a sequence number sort by time, stale
temporary checkpoints are swept."""

from __future__ import annotations

import json
import time
from pathlib import Path

from helpers.config import compose

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
