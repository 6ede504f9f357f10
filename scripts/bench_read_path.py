"""Rank 0's per-step metric read path: `Trainer._read_records` (one all-gather of every rank's row)
and `Trainer._append` (the metrics.jsonl line), timed inside a real 2-rank gpt/tiny job.

    .venv/bin/python scripts/bench_read_path.py [--steps 300] [--ranks 2] [OVERRIDE ...]

A short `fleetwise train` writes the run dir (config, plan); then torchrun starts this file's
worker mode on it, which wraps the two methods with timers (wall and the thread's CPU time) and
runs the usual rank entry point. Prints medians per step on rank 0 (the first 20 steps left out).
The all-gather's wall time includes waiting for the slower rank; its CPU time does not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from fleetwise import rundir

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SKIP = 20


def worker(run_dir: str) -> int:
    from fleetwise.runtime import worker as entry
    from fleetwise.runtime.trainer import Trainer

    timings: dict[str, list[tuple[float, float]]] = {"read": [], "append": []}

    def timed(name, fn):
        def wrapper(self, *args, **kwargs):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(self, *args, **kwargs)
            finally:
                timings[name].append((time.perf_counter() - w, time.thread_time() - c))

        return wrapper

    Trainer._read_records = timed("read", Trainer._read_records)
    Trainer._append = timed("append", Trainer._append)
    code = entry.main([run_dir])
    if os.environ.get("RANK", "0") == "0":
        (Path(run_dir) / "read_path.json").write_text(json.dumps(timings))
    return code


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", default=["recipe=gpt/tiny"])
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    tmp = Path(tempfile.mkdtemp(prefix="fleetwise-read-path-"))
    run_dir = tmp / "run"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "platform"), env.get("PYTHONPATH", "")])
    env["FLEETWISE_CONFIG_DIR"] = str(tmp / "config")
    overrides = [*args.overrides, f"hardware.devices_per_node={args.ranks}"]
    subprocess.run(
        [PY, "-m", "fleetwise.cli", "train", "hardware=cpu", *overrides, "train.steps=3",
         "tracking.enabled=false", f"run.dir={run_dir}"],
        env=env, cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    config_file = run_dir / rundir.CONFIG_FILE
    config = yaml.safe_load(config_file.read_text())
    config["train"]["steps"] = args.steps
    config["tracking"]["enabled"] = False
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    rundir.metrics_path(run_dir).unlink()
    load = os.getloadavg()[0]
    env |= {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.ranks)), "GLOO_SOCKET_IFNAME": "lo"}
    subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
         __file__, "--worker", str(run_dir)],
        env=env, cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    timings = json.loads((run_dir / "read_path.json").read_text())
    for name, rows in timings.items():
        rows = rows[SKIP:]
        wall = statistics.median(w for w, _ in rows) * 1e3
        cpu = statistics.median(c for _, c in rows) * 1e3
        print(f"rank 0 {name:6s}: {wall:.3f} ms wall, {cpu:.3f} ms CPU per step (median of {len(rows)})")
    print(f"load average {load:.1f} → {os.getloadavg()[0]:.1f}; run dir {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
