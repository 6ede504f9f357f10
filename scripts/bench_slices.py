"""Two jobs that take turns on the machine: an A/B comparison that machine drift cannot bias.

On this machine the same 2-thread step runs ~30 ms for a while and ~47 ms for a while after (the
host's other tenants; no steal time is reported), so two runs a few seconds apart differ by up to
40 % and a 2 % overhead cannot be resolved by running A then B, however often. Here A and B start
together and only one runs at a time: the other's whole process tree is stopped (SIGSTOP), and they
swap every `slice_s` seconds (a fraction of a second). Each job times its own steps as usual; a step counts only if it began
and ended inside one of its own job's windows, so both sides' steps come from the same minutes.

    windows = take_turns([(cmd_a, env_a), (cmd_b, env_b)], slice_s=0.5, cwd=root)
    times = steps_inside(records_a, windows[0], "step_time", first=3)  # records: {"time": step end, ...}
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time

import psutil

Window = tuple[float, float]  # wall-clock (time.time()) start and end of a job's turn


def signal_tree(pid: int, sig: int) -> None:
    """Send `sig` to a process and every descendant (ranks run in their own sessions, so a
    process-group signal would miss them). Parents first, and again until no new child appears:
    a child forked while its parent was being stopped is caught by the next pass."""
    seen: set[int] = set()
    while True:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        new = [p for p in procs if p.pid not in seen]
        if not new:
            return
        for p in new:
            seen.add(p.pid)
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)


def wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Return once a process and its descendants have all stopped. SIGSTOP is delivered
    asynchronously: a process running on another core goes on until the kernel interrupts it, so
    a turn's end read right after sending it can precede the job's last work of the turn (seen on
    a loaded 2-core machine: a stamp after its window's end)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
            if all(p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE) for p in procs):
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.0005)


def take_turns(jobs: list[tuple[list[str], dict]], slice_s: float, cwd=None) -> list[list[Window]]:
    """Run the jobs (command, environment) together, one at a time for `slice_s` each, in turn,
    until all have ended. Returns each job's windows (when it was allowed to run); raises with its
    output if a job fails."""
    cmds = [cmd for cmd, _ in jobs]
    procs = []
    for cmd, env in jobs:
        # Nobody runs until its turn: each job starts as a shell that stops itself and, once
        # continued in its first window, becomes the job (exec). A SIGSTOP sent after Popen came
        # too late on a loaded machine: the job had started and done work before any window.
        p = subprocess.Popen(
            ["sh", "-c", 'kill -STOP $$ && exec "$@"', "sh", *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=cwd,
        )
        wait_stopped(p.pid)
        procs.append(p)
    windows: list[list[Window]] = [[] for _ in cmds]
    outputs: list[bytes] = [b""] * len(cmds)
    turn = 0
    try:
        while any(p.returncode is None for p in procs):
            i = turn % len(procs)
            turn += 1
            p = procs[i]
            if p.returncode is not None:
                continue
            start = time.time()  # before it can run, and the end after it stopped: its window holds all it did
            signal_tree(p.pid, signal.SIGCONT)
            try:  # reading its output is the wait: a chatty job must not block on a full pipe
                out, _ = p.communicate(timeout=slice_s)
                outputs[i] = out
            except subprocess.TimeoutExpired:
                signal_tree(p.pid, signal.SIGSTOP)
                wait_stopped(p.pid)
            windows[i].append((start, time.time()))
    finally:
        for p in procs:
            if p.returncode is None:
                signal_tree(p.pid, signal.SIGKILL)
                signal_tree(p.pid, signal.SIGCONT)
                p.wait()
    for cmd, p, out in zip(cmds, procs, outputs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd[:6])}… failed ({p.returncode}):\n{out.decode(errors='replace')[-3000:]}"
            )
    return windows


def inside(t0: float, t1: float, windows: list[Window]) -> bool:
    return any(a <= t0 and t1 <= b for a, b in windows)


def steps_inside(records: list[dict], windows: list[Window], key: str, first: int) -> list[float]:
    """Step times (records[key], seconds, ending at records["time"]) of steps > `first` that ran
    wholly inside one window."""
    return [r[key] for r in records if r["step"] > first and inside(r["time"] - r[key], r["time"], windows)]


def intervals_inside(records: list[dict], windows: list[Window], first: int) -> list[float]:
    """Wall time between consecutive step ends (steps >= `first`) where both ends lie in one window:
    everything the loop does per step, the metrics and logging between steps included."""
    ends = [r["time"] for r in records if r["step"] >= first]
    return [b - a for a, b in zip(ends, ends[1:], strict=False) if inside(a, b, windows)]
