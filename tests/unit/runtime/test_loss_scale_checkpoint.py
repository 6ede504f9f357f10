"""fp16's loss scale survives a resume (runtime/checkpoint.py, the trainer's state): GradScaler's
scale and growth tracker are in the DCP checkpoint. Before, a resumed fp16 job restarted at 2^16
and skipped steps backing off to where it was, and its growth interval started over. GradScaler
runs on CPU tensors, and CPU autocast runs fp16: one process, a gloo world of one, the real
Trainer on the CPU under a GPU profile (validation refuses fp16 on hardware=cpu)."""

from __future__ import annotations

import json

from helpers.config import compose

from fleetwise.plan import make_plan
from fleetwise.rundir import write_config, write_plan
from fleetwise.runtime.checkpoint_files import META, complete_checkpoints


def trainer(cfg, run_dir):
    import torch

    from fleetwise.runtime.mesh import DistEnv
    from fleetwise.runtime.trainer import Trainer

    return Trainer(cfg, make_plan(cfg), DistEnv(0, 1, 0, torch.device("cpu"), 0), run_dir)


def test_a_resumed_fp16_job_keeps_its_loss_scale(gloo_world_of_one, tmp_path):
    cfg, problems = compose(
        "recipe=gpt/tiny", "hardware=a100", "hardware.devices_per_node=1", "train.precision=fp16",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=3",
    )  # fmt: skip
    assert problems == []
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, cfg)
    write_plan(run_dir, make_plan(cfg))
    first = trainer(cfg, run_dir)
    for step in (1, 2):  # two steps without overflow: the growth tracker counts 2
        first.train_step(step)
        first.step = step
    first.scaler.update(new_scale=1024.0)  # where a run that backed off stands
    saved = first.scaler.state_dict()
    assert (saved["scale"], saved["_growth_tracker"]) == (1024.0, 2)
    first.save()
    (path,) = complete_checkpoints(run_dir)
    assert json.loads((path / META).read_text())["loss_scale"] is True

    resumed = trainer(cfg, run_dir)
    assert resumed.scaler.get_scale() == 2.0**16  # a fresh scaler
    resumed.resume(path)
    assert resumed.step == 2
    state = resumed.scaler.state_dict()
    assert (state["scale"], state["_growth_tracker"]) == (1024.0, 2)
    records = resumed.train_step(3)  # a reading step: it logs the scale it trained with
    assert records[-1]["train/loss_scale"] == 1024.0
    assert resumed.scaler.state_dict()["_growth_tracker"] == 3


def test_a_checkpoint_without_a_loss_scale_resumes_with_a_fresh_one(gloo_world_of_one, tmp_path):
    """An fp32 checkpoint (or one written before the scale was kept) resumed in fp16."""
    base = (
        "recipe=gpt/tiny", "hardware=a100", "hardware.devices_per_node=1",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=4",
    )  # fmt: skip
    fp32, _ = compose(*base, "train.precision=fp32")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_config(run_dir, fp32)
    write_plan(run_dir, make_plan(fp32))
    first = trainer(fp32, run_dir)
    first.train_step(1)
    first.step = 1
    first.save()
    (path,) = complete_checkpoints(run_dir)
    fp16, _ = compose(*base, "train.precision=fp16")
    resumed = trainer(fp16, run_dir)
    resumed.resume(path)
    assert resumed.step == 1 and resumed.scaler.get_scale() == 2.0**16
