"""Processes that stop together: a stop signal becomes an exception, and a child dies with its parent.

Torch-free: the launcher (parent side) and the ranks both use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """A stop signal arrived (Ctrl-C, SIGTERM from kill/SLURM/systemd, SIGHUP from a closed terminal).

    A KeyboardInterrupt, so every `except KeyboardInterrupt` clean-up path handles all three alike."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def reason(self) -> str:
        if self.signum == signal.SIGINT:
            return "interrupted by the user (Ctrl-C)"
        return f"stopped by {signal.Signals(self.signum).name}"


@contextlib.contextmanager
def stop_signals():
    """Within the block, SIGINT/SIGTERM/SIGHUP raise `Stopped`; the first one wins: a repeated
    SIGTERM/SIGHUP is ignored while the clean-up runs (a second Ctrl-C still interrupts it).

    SIGINT is installed explicitly: a process started in the background by a non-interactive
    shell (`make test &`, CI runners) inherits SIGINT *ignored*, and Python then installs no
    KeyboardInterrupt handler at all, so Ctrl-C (or a test's SIGINT) would do nothing."""

    def handler(signum, frame):
        for s in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Ask Linux to send `sig` to this process when its parent exits (PR_SET_PDEATHSIG), so no
    rank outlives a launcher that was SIGKILLed. `parent`: the pid expected as parent; if it is
    already gone (the race between fork and prctl), exit now. A no-op off Linux."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() == 1 or (parent is not None and os.getppid() != parent):
        os.kill(os.getpid(), sig)


def stop_fork_server() -> None:
    """End this process's multiprocessing fork server (the agent's ranks', the dry run's) once it
    is no longer needed. Left to notice its client's end, a server exits through a whole interpreter
    teardown with torch imported: 1-2 s of CPU after the job (4 s under load), reparented to init,
    competing with whatever runs next."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)  # the stdlib's, no public accessor
    if pid:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
