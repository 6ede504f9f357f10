"""Test fleetwise on another torch version: `make test-torch TORCH_SPEC=torch==2.11.0`.

fleetwise states a torch range (pyproject.toml) and keeps every private or version-dependent torch
name behind fleetwise/compat.py and fleetwise/dryrun/patches.py, each entry saying the versions it
was checked on. This script is how an entry gets checked on a version: in a virtual environment of
its own (never the repository's `.venv`, which holds the CI pin), with that torch installed first
and fleetwise (editable, with its test extras) on top, it runs

- `make check`'s pytest selection (unit tests + the one real 2-rank job),
- one real job of each engine, a few steps of the tiny recipes (gloo, one CPU process per rank):
  dp (DDP), ZeRO-1 (sharding stage 1), ZeRO-3 (FSDP), mp (tensor parallel), pp (interleaved
  1F1B, 2 chunks a rank), hybrid (pp 2 x sharding 2 x mp 2, 8 ranks), ps (parameter server, rpc),
- `fleetwise dryrun` of a pipelined hybrid layout (interleaved 1F1B, pp 2 x sharding 2 x mp 2), of
  DDP, and of a GPU job's ZeRO-3 with host offload (between them, every patch of the dry run),

and prints a pass/fail table (exit 1 if anything failed). Usage:

    python3 scripts/test_torch.py --torch-spec 'torch==2.11.0'            # .venv-torch-2.11.0, made here
    python3 scripts/test_torch.py --venv /path/to/venv                      # an existing venv, its torch
    python3 scripts/test_torch.py --torch-spec 'torch==2.12.*' --only jobs  # skip the pytest selection

A job passes when it exits 0 and its metrics.jsonl has one row per step with a finite loss; the dry
runs when they exit 0 and every simulated rank counted FLOPs. Only the standard library is used here
(the venv under test has everything else).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPT = ("recipe=gpt/tiny", "train.steps=3", "tracking.enabled=false")
HYBRID = (
    "strategy=hybrid",
    "strategy.pp_degree=2",
    "strategy.sharding_degree=2",
    "strategy.sharding_stage=2",
    "strategy.mp_degree=2",
    "strategy.dp_degree=1",
    "hardware.devices_per_node=8",
)
# name -> (overrides, steps): one real job per engine
JOBS: dict[str, tuple[tuple[str, ...], int]] = {
    "dp": ((*GPT, "strategy=dp", "hardware.devices_per_node=2"), 3),
    "zero1": ((*GPT, "strategy=sharding", "strategy.sharding_stage=1", "hardware.devices_per_node=2"), 3),
    "zero3": ((*GPT, "strategy=sharding", "strategy.sharding_stage=3", "hardware.devices_per_node=2"), 3),
    "mp": ((*GPT, "strategy=mp", "strategy.mp_degree=2", "hardware.devices_per_node=2"), 3),
    "pp_interleaved": (
        (*GPT, "strategy=pp", "strategy.schedule=interleaved_1F1B", "strategy.virtual_stages=2",
         "hardware.devices_per_node=2"),
        3,
    ),
    "hybrid_pp2_sh2_mp2": ((*GPT, *HYBRID), 3),
    "ps": (("recipe=ctr/tiny", "strategy=ps", "train.steps=4", "tracking.enabled=false"), 4),
}  # fmt: skip
# name -> (overrides, ranks): the dry run patches torch's internals (fleetwise/dryrun/patches.py);
# these three reach every patch: pipelining's metadata relay and schedules (the first), DDP's
# bucket rebuild and all-reduce future (the second), FSDP's host offload copies (the third, a GPU
# job, simulated on the CPU)
DRYRUNS: dict[str, tuple[tuple[str, ...], str]] = {
    "hybrid_pp2_sh2_mp2_interleaved": (
        ("recipe=gpt/tiny", "train.steps=2", *HYBRID, "strategy.schedule=interleaved_1F1B", "strategy.virtual_stages=2"),
        "0,7",  # the first stage's first rank and the last stage's last: both ends of the pipeline
    ),
    "dp2_ddp": (("recipe=gpt/tiny", "train.steps=2", "strategy=dp", "hardware.devices_per_node=2"), "0"),
    "zero3_offload_a100_bf16": (
        ("recipe=gpt/tiny", "train.steps=2", "strategy=sharding", "strategy.sharding_stage=3", "strategy.offload=true",
         "hardware=a100", "hardware.devices_per_node=2", "train.precision=bf16"),
        "0",
    ),
}  # fmt: skip
# the loss of each metrics row of a run directory, as JSON (run in the venv under test)
LOSSES = (
    "import json, sys; from fleetwise import rundir; p = rundir.metrics_path(sys.argv[1]); "
    "rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()] if p.exists() else []; "
    "print(json.dumps([r.get(rundir.Metric.LOSS) for r in rows]))"
)
PARTS = ("pytest", "jobs", "dryrun")


def _spec_version(spec: str) -> str:
    """'torch==2.11.0' -> '2.11.0'; 'torch==2.12.*' -> '2.12'."""
    m = re.search(r"==\s*([0-9][0-9.]*[0-9])", spec)
    if not m:
        raise SystemExit(
            f"--torch-spec {spec!r}: give an exact version, e.g. torch==2.11.0 or 'torch==2.12.*'"
        )
    return m.group(1)


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd: list[str], log: Path, timeout: float, cwd: Path | None = None) -> tuple[int, str]:
    """Run `cmd`, its output into `log`; (exit code, last lines). A timeout reads as exit 124."""
    with log.open("w") as out:
        try:
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, "\n".join(log.read_text(errors="replace").splitlines()[-15:])


def _torch_version(venv: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('torch'))"
    out = subprocess.run([str(_python(venv)), "-c", code], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def _fleetwise_here(venv: Path) -> bool:
    """Whether `import fleetwise` in the venv is this checkout's."""
    code = "import fleetwise, pathlib; print(pathlib.Path(fleetwise.__file__).resolve())"
    out = subprocess.run([str(_python(venv)), "-c", code], capture_output=True, text=True, cwd="/")
    return out.returncode == 0 and out.stdout.strip().startswith(str(REPO / "platform"))


def prepare(venv: Path, spec: str | None, python: str, logs: Path) -> str:
    """The venv with `spec`'s torch (installed first, if the venv is new) and this checkout's
    fleetwise[test]; returns its torch version. Never the repository's own .venv (the CI pin)."""
    if venv.resolve() == (REPO / ".venv").resolve():
        raise SystemExit(f"{venv} is the repository's CI venv (the pinned torch): give another --venv")
    pip = [str(_python(venv)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if not _python(venv).exists():
        if spec is None:
            raise SystemExit(f"{venv} does not exist: give --torch-spec to create it")
        print(f"test-torch: creating {venv} with {spec} (a PyPI build of torch is several GB: minutes)")
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        rc, tail = _run([*pip, *spec.split()], logs / "install_torch.log", 3600)
        if rc:
            raise SystemExit(f"installing {spec} into {venv} failed (exit {rc}):\n{tail}")
    installed = _torch_version(venv)
    wanted = _spec_version(spec) if spec is not None else ""
    if wanted and installed and not f"{installed.split('+')[0]}.".startswith(f"{wanted}."):
        raise SystemExit(
            f"{venv} has torch {installed}, not {spec}: give another --venv, or remove this one to rebuild it"
        )
    if not _fleetwise_here(venv):
        print(f"test-torch: installing fleetwise[test] from {REPO} into {venv}")
        rc, tail = _run([*pip, "-e", f"{REPO}[test]"], logs / "install_fleetwise.log", 1800)
        if rc:
            raise SystemExit(f"installing fleetwise into {venv} failed (exit {rc}):\n{tail}")
    after = _torch_version(venv)
    if installed and after != installed:
        raise SystemExit(f"installing fleetwise changed {venv}'s torch from {installed} to {after}")
    return after


def run_pytest(venv: Path, logs: Path, workers: int) -> tuple[bool, str]:
    """`make check`'s selection, in the venv under test."""
    xdist = [] if workers == 0 else ["-n", str(workers), "--dist", "loadfile"]
    cmd = [str(venv / "bin" / "pytest"), *xdist, "-m", "not slow or smoke", "-q", "-p", "no:cacheprovider"]
    rc, tail = _run(cmd, logs / "pytest.log", 5400, cwd=REPO)
    summary = next(
        (line for line in reversed(tail.splitlines()) if " passed" in line or " failed" in line), tail
    )
    return rc == 0, summary.strip("= ")


def run_job(venv: Path, name: str, overrides: tuple[str, ...], steps: int, work: Path) -> tuple[bool, str]:
    """One real `fleetwise train`: exit 0, and one metrics row per step with a finite loss."""
    run_dir = work / name
    rc, tail = _run(
        [str(venv / "bin" / "fleetwise"), "train", *overrides, f"run.dir={run_dir}"],
        work / f"{name}.log",
        900,
        work,
    )
    if rc:
        return False, f"exit {rc}: {_last_error(tail)}"
    # read by the venv's own fleetwise: the run directory's file and metric names live in rundir.py
    read = subprocess.run([str(_python(venv)), "-c", LOSSES, str(run_dir)], capture_output=True, text=True)
    losses = json.loads(read.stdout) if read.returncode == 0 else []
    if len(losses) != steps or not all(isinstance(x, float) and math.isfinite(x) for x in losses):
        return False, f"{len(losses)} metrics rows of {steps}, losses {losses} {read.stderr[-300:]}"
    return True, f"{steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def run_dryrun(venv: Path, name: str, overrides: tuple[str, ...], ranks: str, work: Path) -> tuple[bool, str]:
    """`fleetwise dryrun`: exit 0, FLOPs counted on every rank simulated (and, with offload, the
    host memory reported apart)."""
    out, log = work / f"dryrun_{name}.json", work / f"dryrun_{name}.log"
    cmd = [str(venv / "bin" / "fleetwise"), "dryrun", *overrides, "--ranks", ranks, "--json"]
    with out.open("w") as stdout, log.open("w") as stderr:
        try:
            rc = subprocess.run(cmd, stdout=stdout, stderr=stderr, cwd=work, timeout=900).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    if rc:
        return False, f"exit {rc}: {_last_error(log.read_text(errors='replace'))}"
    reports = json.loads(out.read_text())["ranks"]
    wanted = [int(r) for r in ranks.split(",")]
    if [r["rank"] for r in reports] != wanted or not all(r["flops_per_step"] > 0 for r in reports):
        return False, f"ranks {[r['rank'] for r in reports]}, flops {[r['flops_per_step'] for r in reports]}"
    if "strategy.offload=true" in overrides and not all(r["host_memory_bytes"] for r in reports):
        return False, "no host memory reported for an offloaded job"
    return True, ", ".join(f"rank {r['rank']} peak {r['memory_bytes']['peak']:,} B" for r in reports)


def _last_error(text: str) -> str:
    """The most telling line of a failure's output (an exception or a ✗ line), shortened."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"(Error|Exception|Unsupported|✗)", line):
            return line[:300]
    return (lines[-1] if lines else "")[:300]


def table(version: str, results: list[tuple[str, bool, str]]) -> str:
    width = max(len(n) for n, _, _ in results)
    rows = [f"torch {version}", f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    rows += [f"{n:<{width}}  {'pass' if ok else 'FAIL':<6}  {detail}" for n, ok, detail in results]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--torch-spec", help="the torch to install, e.g. torch==2.11.0 (pip requirement syntax)")
    ap.add_argument(
        "--venv", type=Path, help="the venv to test in (default: .venv-torch-<version>, made if absent)"
    )
    ap.add_argument("--python", default=shutil.which("python3.11") or sys.executable, help="makes a new venv")
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="run only these parts")
    ap.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS), help="run only these jobs")
    ap.add_argument("--workers", type=int, default=int(os.environ.get("TEST_WORKERS", "2")),
                    help="pytest-xdist workers (0: one process), as `make check`")  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.venv is None and args.torch_spec is None:
        ap.error("give --torch-spec (a new venv) or --venv (an existing one)")
    venv = (args.venv or REPO / f".venv-torch-{_spec_version(args.torch_spec)}").absolute()
    work = Path(tempfile.mkdtemp(prefix="fleetwise-test-torch-"))
    version = prepare(venv, args.torch_spec, args.python, work)
    print(f"test-torch: torch {version} in {venv}; logs and run directories in {work}", flush=True)
    results: list[tuple[str, bool, str]] = []

    def record(name: str, outcome: tuple[bool, str]) -> None:
        results.append((name, *outcome))
        print(f"test-torch: {name}: {'pass' if outcome[0] else 'FAIL'} ({outcome[1]})", flush=True)

    if "pytest" in args.only:
        record("make check (pytest)", run_pytest(venv, work, args.workers))
    if "jobs" in args.only:
        for name in args.jobs:
            overrides, steps = JOBS[name]
            record(f"train {name}", run_job(venv, name, overrides, steps, work))
    if "dryrun" in args.only:
        for name, (overrides, ranks) in DRYRUNS.items():
            record(f"dryrun {name}", run_dryrun(venv, name, overrides, ranks, work))
    print()
    print(table(version, results))
    if args.json:
        args.json.write_text(
            json.dumps({"torch": version, "venv": str(venv), "logs": str(work),
                        "results": [{"check": n, "pass": ok, "detail": d} for n, ok, d in results]}, indent=1)
        )  # fmt: skip
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
