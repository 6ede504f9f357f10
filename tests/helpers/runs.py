"""What a finished run left in its directory: the metrics lines and the trained weights; and a
one-rank Trainer in the test's own process, for checks that need no launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of run_dir/metrics.jsonl, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def final_params(run_dir: Path) -> dict:
    """The model of the last checkpoint of a run, consolidated into one state dict."""
    import torch

    from fleetwise.runtime.checkpoint import export
    from fleetwise.runtime.checkpoint_files import complete_checkpoints

    last = complete_checkpoints(run_dir)[-1]
    out = run_dir / "final.pt"
    export(last, out)
    return torch.load(out, weights_only=True)


def truncated_copy(src: Path, dst: Path, keep_step: int) -> None:
    """The run as it was right after checkpoint `keep_step`: later checkpoints and metrics gone."""
    shutil.copytree(src, dst)
    for ck in (dst / "checkpoints").iterdir():
        if int(ck.name.split("_")[1]) > keep_step:
            shutil.rmtree(ck)
    lines = (dst / "metrics.jsonl").read_text().splitlines()[:keep_step]
    (dst / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


def one_rank_trainer(run_dir: Path, *overrides: str):
    """fleetwise's Trainer for `overrides` as rank 0 of a world of one, in this process, with its run
    directory (config and plan) written to `run_dir` -- what a rank builds before its first step."""
    import torch

    from fleetwise.plan import make_plan
    from fleetwise.rundir import write_config, write_plan
    from fleetwise.runtime.mesh import DistEnv
    from fleetwise.runtime.trainer import Trainer
    from helpers.config import compose

    cfg, problems = compose(*overrides)
    assert problems == [], problems
    run_dir.mkdir()
    plan = make_plan(cfg)
    write_config(run_dir, cfg)
    write_plan(run_dir, plan)
    return Trainer(cfg, plan, DistEnv(0, 1, 0, torch.device("cpu"), 0), run_dir)
