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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
