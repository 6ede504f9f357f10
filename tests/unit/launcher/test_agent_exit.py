"""The agent ends without the interpreter's teardown (launcher/agent.py `exit_now`), but still runs
what an ordinary exit runs that matters: atexit handlers, the streams' flush, the exit status."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, sys
from fleetwise.launcher.agent import exit_now
atexit.register(lambda: open(sys.argv[1], "w").write("ran"))
print("buffered, no newline", end="")
sys.stderr.write("to stderr")
exit_now(3)
print("never")
"""


def test_exit_now_runs_atexit_flushes_and_keeps_the_status(tmp_path):
    marker = tmp_path / "atexit"
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(marker)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 3
    assert r.stdout == "buffered, no newline"
    assert r.stderr == "to stderr"
    assert marker.read_text() == "ran"


def test_torchrun_status_and_traceback(monkeypatch, capsys):
    """torchrun's main: success 0; SystemExit keeps its code; an exception prints its traceback and
    gives 1, as an uncaught one would; the fork server is stopped on every path."""
    import torch.distributed.run

    from fleetwise.launcher import agent

    stopped = []
    monkeypatch.setattr(agent, "stop_fork_server", lambda: stopped.append(1))

    def boom():
        raise RuntimeError("a rank failed")

    for main, code in (
        (lambda: None, 0),
        (lambda: sys.exit(4), 4),
        (lambda: sys.exit("bad args"), 1),
        (boom, 1),
    ):
        monkeypatch.setattr(torch.distributed.run, "main", main)
        assert agent.run_torchrun() == code
    err = capsys.readouterr().err
    assert "bad args" in err and "Traceback" in err and "RuntimeError: a rank failed" in err
    assert len(stopped) == 4
