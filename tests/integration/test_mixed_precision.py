"""16-bit training paths that only GPUs used to take, run for real on CPU/gloo (tiny models).

fp16 is refused on CPU by validation (no fp16 peak there), so those jobs are written to a run
directory and started with torchrun directly, as `fleetwise train` would start them on a GPU node.
"""

from __future__ import annotations

import math
import subprocess

import pytest
from conftest import compose, read_metrics, run_cli

pytestmark = pytest.mark.slow

SGD = ("optim=sgd", "optim.lr=0.1", "optim.momentum=0.0", "optim.warmup_steps=1", "optim.grad_clip=0.5")
STEPS = 3


def train_unvalidated(run_dir, *overrides, precision: str) -> list[dict]:
    """Compose a valid config, switch its precision, and run it the way the launcher does."""
    from fleetwise.launcher.launch import torchrun_command
    from fleetwise.plan import make_plan
    from fleetwise.rundir import write_run_dir

    cfg, problems = compose(
        *overrides, f"train.steps={STEPS}", "checkpoint.enabled=false", "tracking.enabled=false"
    )
    assert cfg is not None, problems
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"precision": precision})})
    write_run_dir(run_dir, cfg, make_plan(cfg), [])
    r = subprocess.run(torchrun_command(cfg, run_dir), capture_output=True, text=True, timeout=600)
    logs = "".join(p.read_text()[-3000:] for p in sorted((run_dir / "logs").glob("rank_*.log")))
    assert r.returncode == 0, logs
    return read_metrics(run_dir)


def test_fp16_pipeline_gradient_norms_equal_one_stage(tmp_path):
    """fp16 + pp: the pipeline's loss goes through the GradScaler like every other engine's, so
    the unscaled gradient norm equals a one-process run's (before: unscale_ met a scaler that never
    scaled -- a crash here, ~2^16 too small gradients where a scale had been set). A NaN gradient on
    the first stage at step 2 makes every stage skip that step and halve its scale together (before:
    the other stage stepped and kept its scale, and step 3 differed)."""
    nan = ("fault.kill_rank=0", "fault.at_step=2", "fault.mode=nan_grad")
    base = ("recipe=gpt/tiny", *SGD, *nan, "train.global_batch_size=8", "train.micro_batch_size=2")
    ref = train_unvalidated(
        tmp_path / "pp1", *base, "strategy=dp", "hardware.devices_per_node=1", precision="fp16"
    )
    got = train_unvalidated(
        tmp_path / "pp2", *base, "strategy=pp", "hardware.devices_per_node=2", precision="fp16"
    )
    ref_norms = [m["train/grad_norm"] for m in ref]
    norms = [m["train/grad_norm"] for m in got]
    print("pp=1", ref_norms, "pp=2", norms)
    assert math.isnan(ref_norms[1]) and math.isnan(norms[1])  # the poisoned step
    for step in (0, 2):
        assert math.isfinite(ref_norms[step]) and ref_norms[step] > 0.1, ref_norms
        assert norms[step] == pytest.approx(ref_norms[step], rel=2e-3)
        assert got[step]["train/loss"] == pytest.approx(ref[step]["train/loss"], rel=1e-3)


def test_resnet_batchnorm_under_fsdp_bf16(tmp_path):
    """FSDP's mixed precision casts parameters to bf16 but not BatchNorm's running statistics
    ("expected scalar type BFloat16 but found Float"; on CUDA "Expected running_mean to have type
    BFloat16", cf. torchtitan#674): BatchNorm keeps fp32 parameters in units of their own. The
    FSDP run's losses equal DDP's under autocast (which runs BatchNorm the same way)."""
    runs = {}
    for name, layout in {
        "fsdp": ("strategy=sharding", "strategy.sharding_stage=2"),
        "ddp": ("strategy=dp",),
    }.items():
        run_dir = tmp_path / name
        r = run_cli(
            "train", "recipe=resnet/tiny", "data=synthetic", *layout, "hardware.devices_per_node=2",
            "train.precision=bf16",
            "hardware.has_bf16=true", "train.steps=2", "checkpoint.enabled=false", "tracking.enabled=false",
            f"run.dir={run_dir}", cwd=tmp_path,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        runs[name] = [m["train/loss"] for m in read_metrics(run_dir)]
    print(runs)
    assert runs["fsdp"] == pytest.approx(runs["ddp"], rel=1e-3)
