"""Checkpoint directories on disk, checked without torch (the launcher verifies before it starts ranks).

Layout: <run_dir>/checkpoints/step_<8 digits>/ holding DCP's files, config.yaml, plan.json and
fleetwise.json (step, layout, model config, and a manifest of file sizes and hashes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fleetwise.config.problems import Problem
from fleetwise.config.run import RunConfig
from fleetwise.rundir import checkpoints_dir

STEP_PREFIX = "step_"
META = "fleetwise.json"
HASH_LIMIT_BYTES = 1 << 30  # checksum every file of checkpoints up to 1 GiB; sizes only above
# <run_dir>/model: the final weights alone (a DCP directory), written at the end of a job whose model
# is logged to MLflow when no checkpoint holds them (checkpoint.enabled=false)
MODEL_DIR = "model"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"{STEP_PREFIX}{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (in-progress `.tmp` directories are ignored)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(STEP_PREFIX)
        and not p.name.endswith(".tmp")
        and (p / META).exists()
    )


def find_resume(cfg: RunConfig, run_dir: Path, restarting: bool = False) -> Path | None:
    """The checkpoint to start from: checkpoint.resume=auto (or any torchrun restart) -> the newest
    complete checkpoint of run_dir, if there is one; an explicit path -> that path."""
    resume = cfg.checkpoint.resume
    if resume == "none" and not restarting:
        return None
    if resume in ("none", "auto"):
        found = complete_checkpoints(run_dir)
        return found[-1] if found else None
    return Path(resume)


def verify(path: Path, cfg: RunConfig) -> list[Problem]:
    """A checkpoint that is incomplete, truncated, corrupted, or from another model is refused with a
    clear message before anything runs; nothing is deleted, so earlier checkpoints stay usable."""
    loc = "checkpoint.resume"
    older = [p for p in complete_checkpoints(path.parent.parent) if p.name < path.name]
    fallback = (
        f"resume from an earlier one: checkpoint.resume={older[-1]}" if older else "start a new run.dir"
    )
    try:
        meta = json.loads((path / META).read_text())
        files = meta["files"]
    except FileNotFoundError:
        return [Problem(loc, f"{path} is not a complete fleetwise checkpoint (no {META})", fallback)]
    except (ValueError, KeyError, TypeError) as exc:
        return [Problem(loc, f"{path / META} is unreadable ({exc})", fallback)]
    for name, entry in files.items():
        f = path / name
        if not f.is_file():
            return [Problem(loc, f"checkpoint {path.name} is missing {name}", fallback)]
        size = f.stat().st_size
        if size != entry["size"]:
            return [
                Problem(
                    loc,
                    f"checkpoint {path.name}: {name} has {size} bytes, {entry['size']} were written "
                    "(truncated or overwritten)",
                    fallback,
                )
            ]
        if "sha256" in entry and hashlib.sha256(f.read_bytes()).hexdigest() != entry["sha256"]:
            return [
                Problem(loc, f"checkpoint {path.name}: {name} is corrupted (checksum mismatch)", fallback)
            ]
    mine = cfg.model.model_dump(mode="json")
    theirs = meta.get("model", {})
    if mine != theirs:
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        shown = ", ".join(
            f"model.{k}: checkpoint {theirs.get(k)!r} vs config {mine.get(k)!r}" for k in diff[:4]
        )
        return [
            Problem(
                loc,
                f"checkpoint {path.name} holds a different model ({shown})",
                "resume with the recipe/model it was trained with, or start a new run.dir",
            )
        ]
    return []


def final_weights(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The DCP directory holding a finished job's final model: its last checkpoint, or MODEL_DIR."""
    if cfg.checkpoint.enabled:
        done = complete_checkpoints(run_dir)
        return done[-1] if done else None
    path = run_dir / MODEL_DIR
    return path if (path / ".metadata").exists() else None
