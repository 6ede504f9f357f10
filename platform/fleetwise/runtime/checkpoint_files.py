"""Checkpoint directories on disk, checked without torch (the launcher verifies before it starts ranks).

Layout: <run_dir>/checkpoints/step_<8 digits>/ holding DCP's files, config.yaml, plan.json and
fleetwise.json (step, layout, model config, and a manifest of file sizes and hashes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from fleetwise.config.problems import Problem
from fleetwise.config.run import RunConfig
from fleetwise.rundir import MODEL_DIR, checkpoints_dir

STEP_PREFIX = "step_"
META = "fleetwise.json"
HASH_LIMIT_BYTES = 1 << 30  # checksum every file of checkpoints up to 1 GiB; sizes only above
# <run_dir>/model: the final weights alone (a DCP directory), written at the end of a job whose model
# is logged to MLflow when no checkpoint holds them (checkpoint.enabled=false)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"{STEP_PREFIX}{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run in the order they were written, oldest first (in-progress
    `.tmp` directories are ignored).

    Written order, not step order: after resuming from an older checkpoint, the abandoned
    timeline's higher steps are *older* than what the resumed job writes, so keep-N and
    resume=auto follow the job that runs now. Folder names are not compared either (they stop
    sorting by step at 10^8 steps)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(STEP_PREFIX)
        and not p.name.endswith(".tmp")
        and (p / META).exists()
    ]
    return sorted(found, key=_written_order)


def _written_order(path: Path) -> tuple[int, float, int]:
    """(seq, saved_at, step): seq counts the saves of a run directory (clock changes do not
    matter); checkpoints from before seq existed fall back to their save time."""
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError):
        meta = {}
    if not isinstance(meta, dict):
        meta = {}
    step = path.name[len(STEP_PREFIX) :]
    seq, saved = meta.get("seq", -1), meta.get("saved_at", 0.0)
    return (
        seq if isinstance(seq, int) else -1,
        saved if isinstance(saved, (int, float)) else 0.0,
        int(step) if step.isdigit() else -1,
    )


def next_seq(run_dir: Path) -> int:
    """The seq of the next checkpoint written in run_dir."""
    found = complete_checkpoints(run_dir)
    return max((_written_order(p)[0] for p in found), default=-1) + 1


def write_durably(path: Path, text: str) -> None:
    """Write and fsync a file and its directory: after a crash it is there, whole, or absent."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sweep_stale(run_dir: Path) -> list[Path]:
    """Remove `.tmp` checkpoint folders a crashed or killed job left behind (the job that writes
    now holds the run-dir lock, so no other job is writing one)."""
    root = run_dir / "checkpoints"
    stale = sorted(p for p in root.glob(f"{STEP_PREFIX}*.tmp") if p.is_dir()) if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def prune(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the `keep` most recently written complete checkpoints; returns the deleted.
    The caller fsyncs the new checkpoint and its rename first, so a crash here never leaves
    fewer than `keep` good checkpoints on disk."""
    old = complete_checkpoints(run_dir)[:-keep]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


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
    written = complete_checkpoints(path.parent.parent)
    older = written[: written.index(path)] if path in written else []
    fallback = (
        f"resume from an earlier one: checkpoint.resume={older[-1]}" if older else "start a new run.dir"
    )
    try:
        meta = json.loads((path / META).read_text())
        files = meta["files"]
    except (FileNotFoundError, NotADirectoryError):
        return [Problem(loc, f"{path} is not a complete fleetwise checkpoint (no {META})", fallback)]
    except (OSError, ValueError, KeyError, TypeError) as exc:
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
