"""Entry point of one rank: `python -m fleetwise.runtime.worker RUN_DIR` (started by torchrun).

A worker never runs Hydra: it reads the resolved, validated config the launcher wrote to
RUN_DIR/config.yaml, so every rank sees exactly the same config.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from fleetwise import rundir
from fleetwise.runtime.lifeline import die_with_parent

log = logging.getLogger("fleetwise")


def redirect_output(log_file: Path) -> None:
    """Send this process's stdout/stderr (C++ and Python alike) to its own log file, appended so a
    restarted worker keeps the history of its earlier attempts."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s rank%(rank)s %(message)s", force=True, stream=sys.stderr
    )
    rank = os.environ.get("RANK", "0")
    old = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = old(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)


# which process the fork server is, set by the agent before it starts one (launcher/agent.py): "the
# agent" (forked from it, nothing imported twice) or "a new interpreter" (multiprocessing's own)
FORK_SERVER_VAR = "FLEETWISE_FORK_SERVER"


def main(argv: list[str] | None = None, started_as: str = "a new interpreter") -> int:
    """One rank's job; `started_as` (how this process started) goes into its start-up log line."""
    started = time.perf_counter()
    # torchrun stops its ranks when it is told to; this covers torchrun itself being killed.
    die_with_parent(signal.SIGKILL)
    run_dir = Path((argv or sys.argv[1:])[0]).resolve()
    rank = int(os.environ.get("RANK", "0"))
    redirect_output(rundir.rank_log(run_dir, rank))
    cfg, plan = rundir.read_config(run_dir), rundir.read_plan(run_dir)
    if cfg.strategy.name == "ps":
        from fleetwise.runtime.ps import run as run_ps

        run_ps(cfg, plan, run_dir)
        return 0

    import torch
    import torch.distributed as dist

    from fleetwise.compat import quiet_redistribute_logs
    from fleetwise.runtime.checkpoint_files import find_resume
    from fleetwise.runtime.hostmalloc import STEADY_MMAP_THRESHOLD, steady_malloc
    from fleetwise.runtime.mesh import init_distributed
    from fleetwise.runtime.trainer import Trainer

    imported = time.perf_counter()
    # DTensor warns on every gradient-norm reduction over two mesh dims (2 small all-reduces instead
    # of 1); it is expected here and would drown the training log.
    quiet_redistribute_logs()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != cfg.hardware.world_size:  # an elastic job started with fewer (or more) nodes
        from fleetwise.config.validate import elastic_config
        from fleetwise.plan import make_plan

        # the plan follows the layout: predicted memory and MFU of the layout that really runs
        cfg = elastic_config(cfg, world)
        plan = make_plan(cfg)
        if rank == 0:
            rundir.write_plan(run_dir, plan)
        log.info("elastic: %d ranks; data parallel degree is now %d", world, cfg.strategy.dp_degree)
    env = init_distributed(cfg)
    joined = time.perf_counter()
    trainer = Trainer(cfg, plan, env, run_dir)
    built = time.perf_counter()
    log.info(
        "rank %d/%d on %s, attempt %d, %s, %d threads (OpenMP waits: %s); start-up: imports %.2f s, "
        "process group %.2f s, "
        "mesh+model+optimizer %.2f s",
        env.rank,
        env.world_size,
        env.device,
        env.restart,
        started_as,
        torch.get_num_threads(),
        os.environ.get("OMP_WAIT_POLICY", "default").lower(),  # launcher/torchrun.py rank_thread_env
        imported - started,
        joined - imported,
        built - joined,
    )
    resume = find_resume(cfg, run_dir, restarting=env.regrouped)
    if resume is not None:
        trainer.resume(resume)
    # built (and resumed): from here on, blocks up to 32 MiB are reused from the heap, not mapped anew
    if steady_malloc(trainer.model.engine):
        log.info("malloc: mmap threshold %d MiB for the steps", STEADY_MMAP_THRESHOLD >> 20)
    trainer.fit()
    dist.barrier()
    dist.destroy_process_group()
    log.info("done")
    return 0


def forked(run_dir: str, group_env: dict[str, str]) -> None:
    """Entry point of one rank forked from the agent's fork server (launcher/agent.py), run by
    torch's multiprocessing start, which records an exception in torchrun's error file (@record)
    and ends the process without the interpreter's teardown (os._exit), as `exit_finished` does
    for a rank started as `python -m fleetwise.runtime.worker`.
    `group_env`: what the server's environment lacks of the agent's (agent.GROUP_ENV)."""
    os.environ.update(group_env)
    try:
        server = os.environ.get(FORK_SERVER_VAR, "unknown")
        main([run_dir], started_as=f"forked from the fork server ({server})")
    except Exception:
        # into the rank's log, as an interpreter prints an uncaught exception (torch's start of a
        # function hands it to the agent only; the launcher shows rank 0's log and folds it)
        traceback.print_exc()
        sys.stderr.flush()
        raise
    logging.shutdown()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    from fleetwise.runtime.mesh import exit_finished

    # @record writes the exception to torchrun's error file, so the launcher can name the root
    # cause; an exception leaves through it, as usual. A rank that trained to the end must not
    # turn into a failed job in the interpreter's teardown.
    exit_finished(record(main)())
