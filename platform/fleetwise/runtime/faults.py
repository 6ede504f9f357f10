"""Failure injection for tests of fault tolerance (`fault.kill_rank`, `fault.at_step`, `fault.mode`)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from fleetwise.config.run import FaultConfig

log = logging.getLogger("fleetwise")


def inject_fault(f: FaultConfig, rank: int, step: int, restart: int, named_params=()) -> None:
    """Fail `fault.kill_rank` in the middle of step `fault.at_step` (gradients computed, optimizer not
    yet stepped, peers waiting in a collective), on the first attempt only.

    raise: a Python exception; exit: os._exit (no exception, no cleanup); sigkill: killed by the
    kernel; hang: stop answering (peers time out in their collective); nan: poison one gradient."""
    if f.kill_rank != rank or f.at_step != step or restart > 0:
        return
    log.error("fault injection: rank %d fails at step %d (%s)", rank, step, f.mode)
    if f.mode == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if f.mode == "nan":
        name, p = next((n, p) for n, p in named_params if p.grad is not None)
        p.grad.mul_(float("nan"))
        log.error("fault injection: gradient of %s set to NaN", name)
        return
    if f.mode == "hang":
        while True:
            time.sleep(3600)
    sys.stdout.flush()
    sys.stderr.flush()
    if f.mode == "exit":
        os._exit(13)
    os.kill(os.getpid(), signal.SIGKILL)
