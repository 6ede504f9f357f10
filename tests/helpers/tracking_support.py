"""Helpers for the tracking tests: a fake training job that writes metrics.jsonl like rank 0 does."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

METRICS = [
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "perf/step_time_s",
    "perf/samples_per_s",
    "perf/tokens_per_s",
    "perf/tflops_per_device",
    "perf/mfu",
    "memory/peak_bytes_max",
    "memory/peak_bytes_mean",
    "memory/predicted_bytes",
    "train/tokens_seen",
]


def value(name: str, step: int) -> float:
    """A distinct, checkable value per metric and step."""
    return float(step * 1000 + METRICS.index(name))


def record(step: int, t0: float = 1.7e9) -> dict:
    return {"step": step, "time": t0 + step, **{name: value(name, step) for name in METRICS}}


def write_steps(run_dir: Path, steps: range, *, torn_tail: str = "") -> None:
    """Append one line per step, as rank 0 does; `torn_tail` leaves an unfinished last line."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step in steps:
            f.write(json.dumps(record(step)) + "\n")
        f.write(torn_tail)


def make_run_dir(root: Path, name: str) -> Path:
    """A run dir as the launcher leaves it before training: config, plan, command, a rank log."""
    run_dir = root / name
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("strategy:\n  name: dp\n")
    (run_dir / "plan.json").write_text('{"world_size": 2}\n')
    (run_dir / "command.txt").write_text("fleetwise train recipe=gpt/tiny\n")
    (run_dir / "logs" / "rank_0.log").write_text("step 1 loss 3.2\n")
    return run_dir


def free_port() -> int:
    """A port that was free a moment ago, for a server the test starts: another process may take
    it before the server binds, so starters retry with a new one (`in_use`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_HELD: list[socket.socket] = []


def refused_port() -> int:
    """A port where nothing answers for the rest of the session: bound here and never listening, so
    a connection is refused and no other process can take it (a port found free and released could
    be taken by a real server before the test connects)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return s.getsockname()[1]


def in_use(log_text: str) -> bool:
    """Whether a server's log says its port was taken (a bind race lost to another process)."""
    return "Address already in use" in log_text or "EADDRINUSE" in log_text or "[Errno 98]" in log_text


class Messages(list):
    """A RunTracker `notify` that keeps what the user was told."""

    def __call__(self, message: str) -> None:
        self.append(message)

    def about(self, word: str) -> list[str]:
        return [m for m in self if word in m]


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def answers(url: str) -> bool:
    """Whether an HTTP server answers `url` with 200 (a server still starting does not)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
