"""The launcher's CPU per 1,000 training steps: what `fleetwise train` itself costs beside its ranks.

    .venv/bin/python scripts/bench_launcher_cpu.py [--steps 1000] [--ranks 2] [--reps 1] [OVERRIDE ...]

Runs `fleetwise train` (gpt/tiny by default) with tracking on and, beside it, off, each against a
fresh sqlite MLflow store, and samples /proc every 0.25 s: the launcher process's CPU time (user +
system, all its threads; its children, torchrun and the ranks, are not in it), its main thread's
alone, and the steps in metrics.jsonl. Only the samples taken while the ranks train count (from step
250 to the last step before the end), so MLflow's start-up and the end-of-run delivery are left out.
CPU time, not wall time: a loaded machine slows both alike, so the numbers hold under load. Also
prints the metric points the run left in MLflow per step.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleetwise import rundir

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TICK = os.sysconf("SC_CLK_TCK")
# steps before this one are start-up: MLflow's import, run and params (~4 s of CPU at nice 10) run
# on while the ranks train their first steps; on a loaded machine for a hundred steps and more
FIRST_STEP = 250


def cpu_s(stat_path: str) -> float | None:
    """utime + stime of a /proc/<pid>[/task/<tid>]/stat, in seconds (None once it is gone)."""
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of stat(5)


def threads(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of a process, by thread id."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        if (c := cpu_s(f"/proc/{pid}/task/{tid}/stat")) is not None:
            out[int(tid)] = c
    return out


def count_lines(path: Path, state: dict) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(state.get("offset", 0))
            data = f.read()
    except FileNotFoundError:
        return 0
    state["offset"] = state.get("offset", 0) + len(data)
    state["lines"] = state.get("lines", 0) + data.count(b"\n")
    return state["lines"]


def run(tmp: Path, name: str, overrides: list[str], steps: int, tracking: bool) -> dict:
    run_dir = tmp / name
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "platform"), env.get("PYTHONPATH", "")])
    env["FLEETWISE_CONFIG_DIR"] = str(tmp / "config")
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/{name}.db"
    env.pop("OMP_NUM_THREADS", None)
    cmd = [
        PY, "-m", "fleetwise.cli", "train", "hardware=cpu", *overrides, f"train.steps={steps}",
        f"tracking.enabled={str(tracking).lower()}", f"run.dir={run_dir}",
    ]  # fmt: skip
    log = tmp / f"{name}.out"  # a file, not a pipe: a full pipe would stop the launcher's console
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    pid = proc.pid
    lines: dict = {}
    samples = []  # (steps, process cpu, main thread cpu)
    while proc.poll() is None:
        total, main = cpu_s(f"/proc/{pid}/stat"), cpu_s(f"/proc/{pid}/task/{pid}/stat")
        n = count_lines(rundir.metrics_path(run_dir), lines)
        if total is not None and main is not None:
            samples.append((n, total, main, threads(pid)))
        time.sleep(0.25)
    out = log.read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{out[-3000:]}")
    inside = [s for s in samples if FIRST_STEP <= s[0] < steps]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < steps // 4:
        raise RuntimeError(f"{name}: too few samples while the ranks trained: {inside[:3]}…")
    (n0, c0, m0, t0), (n1, c1, m1, t1) = inside[0], inside[-1]
    per_k = 1000 / (n1 - n0)
    each = sorted(((t1[tid] - t0.get(tid, 0.0)) * per_k for tid in t1 if tid != pid), reverse=True)
    result = {
        "steps_seen": n1 - n0,
        "cpu_per_1k": (c1 - c0) * per_k,
        "main_per_1k": (m1 - m0) * per_k,
        "threads_per_1k": ((c1 - c0) - (m1 - m0)) * per_k,
        "whole_job_cpu": samples[-1][1],
        "each_thread_per_1k": [round(x, 2) for x in each if x > 0],
    }
    db = tmp / f"{name}.db"
    if tracking and db.exists():
        with sqlite3.connect(db) as con:
            points = con.execute("select count(*) from metrics where key not like 'system/%'").fetchone()[0]
        result["points_per_step"] = points / steps
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=1, help="pairs (tracking on, off), alternating who runs first")
    p.add_argument("--on-only", action="store_true", help="only tracking on (no baseline without MLflow)")
    p.add_argument("overrides", nargs="*", default=["recipe=gpt/tiny"])
    args = p.parse_args()
    overrides = [*args.overrides, f"hardware.devices_per_node={args.ranks}"]
    tmp = Path(tempfile.mkdtemp(prefix="fleetwise-launcher-cpu-"))
    print(f"load average before: {os.getloadavg()}", flush=True)
    for rep in range(args.reps):
        order = [True] if args.on_only else [True, False] if rep % 2 == 0 else [False, True]
        for tracking in order:
            name = f"{'on' if tracking else 'off'}{rep}"
            r = run(tmp, name, overrides, args.steps, tracking)
            extra = f", {r['points_per_step']:.1f} MLflow points/step" if "points_per_step" in r else ""
            print(
                f"tracking {'on ' if tracking else 'off'}: launcher {r['cpu_per_1k']:.2f} CPU-s per 1,000 steps "
                f"(main thread {r['main_per_1k']:.2f}, other threads {r['threads_per_1k']:.2f} = "
                f"{r['each_thread_per_1k']}; "
                f"{r['steps_seen']} steps sampled; whole job {r['whole_job_cpu']:.1f} CPU-s{extra}); "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    print(f"(run dirs and stores in {tmp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
