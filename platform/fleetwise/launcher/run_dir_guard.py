"""Who may use a run directory: refused before launch when it holds another job's files, locked
for the life of a job, cleared for run.overwrite=true.

What the files in it are is fleetwise.rundir's (the contract with the ranks).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from fleetwise import rundir
from fleetwise.config.problems import Problem
from fleetwise.config.run import RunConfig
from fleetwise.launcher.torchrun import node_count, per_job

# What a job writes into its run directory (run.overwrite=true clears exactly these).
JOB_FILES = (
    rundir.CONFIG_FILE,
    rundir.PLAN_FILE,
    rundir.COMMAND_FILE,
    rundir.METRICS_FILE,
    rundir.TRACKING_FILE,
    rundir.ERROR_FILE,
    rundir.PS_SUMMARY_FILE,
)
JOB_DIRS = (rundir.LOGS_DIR, rundir.CHECKPOINTS_DIR)
LOCK_NAME = ".fleetwise.lock"
HYDRA_SUBDIR = ".hydra"  # Hydra's record of the composition in a job's directory (hydra.output_subdir)


def run_dir_problems(cfg: RunConfig) -> list[Problem]:
    """A run directory that already holds something is refused unless the job resumes it or
    run.overwrite=true: reusing it would continue the old MLflow run, drop steps as re-runs, mix
    the summary and let keep-N delete what was just written. The other nodes of the same
    multi-node job (same config but node_rank, on a shared filesystem) are not "something"."""
    if not cfg.run.dir or cfg.checkpoint.resume != "none" or cfg.run.overwrite:
        return []
    path = Path(cfg.run.dir)
    if not path.is_dir():
        return [] if not path.exists() else [Problem("run.dir", f"{path} is a file", "choose a directory")]
    entries = sorted(p.name for p in path.iterdir() if not p.name.startswith(LOCK_NAME))
    if not entries:
        return []
    if node_count(cfg) > 1:
        written = path / rundir.CONFIG_FILE
        if _same_job(cfg, written):
            return []
        if not written.exists() and (cfg.launch.node_rank > 0 or _a_node_starting(path, entries)):
            # another node of a job is writing the directory now, before its config.yaml (its
            # .hydra/ and logs/ come first): only a different job's config refuses it. A later node
            # may find node 0 at any point of that (node 1 starting a moment late exited 2); node 0
            # accepts only what every node makes before its config -- Hydra's .hydra/ and an empty
            # logs/, its lock being no entry (node 0 starting a moment late exited 2: test_launch's
            # two nodes on loopback, once in a full suite run)
            return []
    shown = ", ".join(entries[:5]) + (", …" if len(entries) > 5 else "")
    return [
        Problem(
            "run.dir",
            f"{path} is not empty ({shown}): a new job there would mix with the one that wrote it",
            "resume it with checkpoint.resume=auto, choose a new run.dir, or run.overwrite=true to "
            "replace the old job's files",
        )
    ]


def _a_node_starting(path: Path, entries: list[str]) -> bool:
    """Whether the directory holds only what a node of a multi-node job makes before it writes its
    config.yaml (launcher/job.py: Hydra's output subdirectory when the job starts, then its lock,
    then rundir.write_run_dir: logs/ first)."""
    logs = rundir.logs_dir(path)
    empty_logs = not logs.exists() or (logs.is_dir() and not any(logs.iterdir()))
    return set(entries) <= {HYDRA_SUBDIR, rundir.LOGS_DIR} and empty_logs


def _same_job(cfg: RunConfig, written: Path) -> bool:
    try:
        theirs = yaml.safe_load(written.read_text())
    except (OSError, yaml.YAMLError):
        return False
    if not isinstance(theirs, dict) or not isinstance(theirs.get("launch"), dict):
        return False
    return per_job(cfg.model_dump(mode="json")) == per_job(theirs)


class RunDirBusy(RuntimeError):
    """Another live job holds the run directory."""


def lock_run_dir(run_dir: Path, node_rank: int = 0):
    """Hold an exclusive lock on the run directory for the life of this job (released when the
    returned file is closed, or when the process dies). Each node of a multi-node job locks its
    own file, so the nodes can share one directory on a shared filesystem."""
    import fcntl

    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / (LOCK_NAME if node_rank == 0 else f"{LOCK_NAME}.node{node_rank}")
    f = path.open("a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RunDirBusy(
            f"run directory {run_dir} is in use by a running job ({holder}): "
            "wait for it, or choose another run.dir"
        ) from None
    f.truncate(0)
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f


def clear_run_dir(run_dir: Path) -> None:
    """run.overwrite=true: remove the previous job's files (and nothing else of the directory)."""
    import shutil

    for name in JOB_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in JOB_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
