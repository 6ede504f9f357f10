"""Stop signals become `Stopped` (even when SIGINT was inherited ignored), and a child dies with its
parent. Small Python child processes, no torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

CHILD = textwrap.dedent(
    """
    import sys, time
    from fleetwise.runtime.lifeline import Stopped, stop_signals
    with stop_signals():
        try:
            print("ready", flush=True)
            time.sleep(120)
        except Stopped as exc:
            print(exc.reason, flush=True)
            sys.exit(128 + exc.signum)
    """
)


def _ignore_sigint() -> None:
    # What `cmd &` in a non-interactive shell (make, CI scripts) does to its children.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "sig,reason",
    [
        (signal.SIGINT, "interrupted by the user (Ctrl-C)"),
        (signal.SIGTERM, "stopped by SIGTERM"),
        (signal.SIGHUP, "stopped by SIGHUP"),
    ],
)
def test_each_stop_signal_stops_even_when_sigint_was_inherited_ignored(sig, reason):
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, preexec_fn=_ignore_sigint
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(sig)
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + sig and out.strip() == reason


PARENT = textwrap.dedent(
    """
    import os, subprocess, sys
    code = "import os, time; from fleetwise.runtime.lifeline import die_with_parent; " \\
           "die_with_parent(parent=%d); print('child', flush=True); time.sleep(120)" % os.getpid()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "child"
    print(child.pid, flush=True)
    import time; time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has died
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_child_dies_when_its_parent_is_sigkilled():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 60
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the child outlived its SIGKILLed parent"
