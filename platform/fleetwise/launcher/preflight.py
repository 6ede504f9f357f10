"""Everything `validate`, `plan`, `train` and `dryrun` check before a process starts: compose,
validate, plan, and the memory fit (with remedies); and for `train`, what this machine and its run
directory say (`machine_problems`).

The config's own rules live in config/rules/ and hold for a config anywhere; the checks here need
the machine that launches (its GPUs, cores and free memory, the route to node 0, the files in
run.dir and the checkpoint to resume) or the plan (the memory fit), so they are not config rules.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fleetwise.calibrate.registry import note_defaults
from fleetwise.config.problems import ConfigError, Problem
from fleetwise.config.run import RunConfig
from fleetwise.plan.records import Plan
from fleetwise.plan.remedies import Remedy

if TYPE_CHECKING:
    from fleetwise.launcher.auto import AutoOutcome


@dataclass
class Preflight:
    """A composed, validated, resolved config and its plan; or the problems found on the way."""

    cfg: RunConfig | None = None
    plan: Plan | None = None
    problems: list[Problem] = field(default_factory=list)
    remedies: list[Remedy] = field(default_factory=list)
    auto: AutoOutcome | None = None  # strategy=auto: the search that chose the layout
    held_back: tuple[str, ...] = ()  # `validate`: targets of a recipe from elsewhere, not imported


def preflight(
    overrides: list[str], *, launching: bool = False, dryrun: bool = False, enforce_memory: bool = True
) -> Preflight:
    """`launching`: the rules about starting processes too (train, dryrun); `dryrun`: the dry run's
    rules instead of the launch section's (config/rules/dryrun.py)."""
    from fleetwise.config.compose import composing_once

    with composing_once():
        return _checked(overrides, launching=launching, dryrun=dryrun, enforce_memory=enforce_memory)


def _checked(overrides: list[str], *, launching: bool, dryrun: bool, enforce_memory: bool) -> Preflight:
    from fleetwise.launcher import auto

    if auto.requested(overrides):  # search, then check the winner like a typed-in layout
        outcome = auto.resolve_auto(overrides)
        if outcome.problems:
            return Preflight(problems=outcome.problems, auto=outcome)
        pf = _preflight(outcome.command, launching=launching, dryrun=dryrun, enforce_memory=enforce_memory)
        pf.auto = outcome
        return pf
    return _preflight(overrides, launching=launching, dryrun=dryrun, enforce_memory=enforce_memory)


def _preflight(overrides: list[str], *, launching: bool, dryrun: bool, enforce_memory: bool) -> Preflight:
    from fleetwise.config.recipes import mark_recipe_values
    from fleetwise.config.validate import load_config
    from fleetwise.plan import make_plan
    from fleetwise.plan.remedies import remedies

    problems: list[Problem] = []
    try:
        cfg = load_config(overrides, launching=launching, dryrun=dryrun)
    except ConfigError as err:
        found = mark_recipe_values(err.problems, overrides)
        if not (launching or dryrun):
            return Preflight(problems=found + _memory_as_given(overrides, err.problems, enforce_memory))
        # only rules about starting processes (or a dry run's) failed? Then plan it too, list everything
        try:
            cfg = load_config(overrides)
        except ConfigError as plain:
            return Preflight(problems=found + _memory_as_given(overrides, plain.problems, enforce_memory))
        problems += found
    note_defaults(cfg.hardware)
    from fleetwise.families.custom.targets import holding_any

    if holding_any():  # `validate` of a recipe from elsewhere: its model is not imported, so not planned
        return Preflight(cfg=cfg, problems=problems)
    plan = make_plan(cfg)
    fixes = [] if plan.fits else remedies(cfg)
    if not plan.fits and enforce_memory and cfg.plan.memory_check == "error":
        problems.append(memory_problem(plan, fixes))
    return Preflight(cfg=cfg, plan=plan, problems=problems, remedies=fixes)


# Where a problem makes the layout or the sizes unknown, so that the config cannot be planned as
# given. Any other problem (a precision the hardware lacks, a data file, tracking, launch, …) leaves
# the memory plan meaningful, and its verdict is listed beside it.
STRUCTURAL = (
    "<overrides>",
    "strategy",
    "model",
    "recipe",
    "hardware.nodes",
    "hardware.devices_per_node",
    "hardware.memory_per_device_gib",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.accumulate_steps",
)


def _memory_as_given(overrides: list[str], problems: list[Problem], enforce: bool) -> list[Problem]:
    """The memory verdict of a config whose only problems leave it plannable ("every problem at
    once": the memory problem is not held back until the others are fixed)."""
    from fleetwise.config.compose import compose_partial
    from fleetwise.config.validate import parse, resolve
    from fleetwise.families.custom.targets import holding_any
    from fleetwise.plan import make_plan
    from fleetwise.plan.remedies import remedies

    if not enforce or not problems or any(p.loc.startswith(STRUCTURAL) for p in problems) or holding_any():
        return []
    data, hydra_problems = compose_partial(overrides)
    cfg, _ = parse(data) if data and not hydra_problems else (None, [])
    if cfg is None or cfg.plan.memory_check != "error":
        return []
    try:
        cfg = resolve(cfg)
        plan = make_plan(cfg)
    except Exception:  # noqa: BLE001 - not plannable as given after all: the other problems say why
        return []
    if plan.fits:
        return []
    problem = memory_problem(plan, remedies(cfg, tolerate={p.loc for p in problems}))
    others = ", ".join(dict.fromkeys(p.loc for p in problems))
    return [Problem(problem.loc, f"{problem.msg} (planned as given, {others} unchanged)", problem.hint)]


def memory_problem(plan: Plan, fixes: list[Remedy]) -> Problem:
    from fleetwise.plan.render import gib, memory_parts

    m = plan.memory_bytes
    cures = "; ".join(r.describe() for r in fixes) or "a larger device, or fewer layers per device"
    return Problem(
        "hardware.memory_per_device_gib",
        f"the worst device needs {gib(m['total'])} ({memory_parts(plan)}) but has "
        f"{gib(plan.device_memory_bytes)}"
        + (
            f" of which {gib(plan.usable_memory_bytes)} are usable (hardware.device_overhead_gib, "
            "hardware.fragmentation)"
            if plan.device_overhead_bytes
            else ""
        ),
        f"cheapest remedies: {cures}; or plan.memory_check=warn to launch anyway",
    )


def machine_problems(pf: Preflight) -> tuple[list[Problem], str | None]:
    """What this machine and run directory say about launching a config that parsed (`train`),
    and a warning to print: the checkpoint to resume and the run directory (once the config is
    valid), room for the ranks (only a warning with launch.oversubscribe=true), the route to node 0
    (multi-node), and the GPUs a GPU profile needs."""
    from fleetwise.hostnet import network_problems
    from fleetwise.launcher.run_dir_guard import run_dir_problems

    cfg, valid = pf.cfg, not pf.problems
    assert cfg is not None
    problems = resume_problems(cfg) + run_dir_problems(cfg) if valid else []
    warning = None
    full = capacity_problem(cfg, pf.plan) if pf.plan is not None else None
    if full and not cfg.launch.oversubscribe:
        problems.append(Problem(*full))
    elif full:
        warning = f"{full[1]} (launch.oversubscribe=true)"
    if valid and cfg.launch.nnodes != "1":  # this node must reach node 0
        problems += network_problems(cfg)
    gpu = gpu_problem(cfg) or device_problem(cfg)
    if gpu:
        problems.append(gpu)
    problems += tracking_problems(cfg)
    return problems, warning


def tracking_problems(cfg: RunConfig) -> list[Problem]:
    """tracking.enabled needs MLflow in this environment. It is imported only once the job runs
    (~2.5 s, off the validate/plan path), so without it a job trained to the end and then failed
    with a traceback; an image with torch but no MLflow (a GPU container) trains with tracking off."""
    import importlib.util

    if not cfg.tracking.enabled or importlib.util.find_spec("mlflow") is not None:
        return []
    return [
        Problem(
            "tracking.enabled",
            "MLflow is not installed in this environment (tracking.enabled=true logs the run to it)",
            "pip install 'mlflow>=3.1,<4', or train with tracking.enabled=false (metrics.jsonl, the "
            "console summary and checkpoints need no MLflow)",
        )
    ]


def resume_problems(cfg: RunConfig) -> list[Problem]:
    """The checkpoint a job would resume from must be complete, intact and of the same model."""
    from fleetwise.runtime.checkpoint_files import find_resume, verify

    if cfg.checkpoint.resume == "none" or (cfg.checkpoint.resume == "auto" and not cfg.run.dir):
        return []
    path = find_resume(cfg, Path(cfg.run.dir or "."))  # an explicit path is checked without run.dir too
    return verify(path, cfg) if path is not None else []


def gpu_count() -> int:
    """The CUDA devices this process may use: the device files, within CUDA_VISIBLE_DEVICES."""
    found = len(glob.glob("/dev/nvidia[0-9]*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        found = min(found, len([d for d in visible.split(",") if d.strip()]))
    return found


def gpu_problem(cfg: RunConfig, found: int | None = None) -> Problem | None:
    """A GPU profile on a machine without (enough) GPUs fails fast, before any process starts,
    with the setting that fits this machine: the CPU where it has no GPU, else its device count."""
    from fleetwise.launcher.torchrun import nproc_per_node

    if cfg.hardware.device_type != "cuda":
        return None
    found = gpu_count() if found is None else found
    need = nproc_per_node(cfg)
    if found >= need:
        return None
    what = f"hardware={cfg.hardware.name} runs {need} CUDA devices per node, but this machine has {found or 'none'}"
    if found == 0:
        return Problem("hardware", what, "use hardware=cpu here; validate and plan work for any profile")
    if cfg.strategy.name == "ps":
        return Problem(
            "strategy.num_trainers",
            what,
            f"at most {found} servers and trainers per node here, or hardware=cpu",
        )
    nodes = cfg.hardware.nodes
    return Problem(
        "hardware.devices_per_node",
        what,
        f"hardware.devices_per_node={found} to train on the {found} here (the strategy's degrees then "
        f"multiply to {found * nodes}); validate and plan work for any device count",
    )


# The GPUs each shipped GPU profile (conf/hardware/) describes, as parts of the names the driver
# reports ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"). h100 is the SXM5 part (989 TF/s
# bf16): an H100 PCIe (756) or NVL (835) is not it. Profiles not listed here -- one `fleetwise
# calibrate` wrote of its machine (hardware=local), or any profile renamed with hardware.name --
# are taken as they say.
PROFILE_GPUS = {
    "v100": ("V100",),
    "a100": ("A100",),
    "h100": ("H100 80GB HBM3", "H100 SXM"),
}
# An H200 is an H100 SXM's compute (the same GH100 die and clocks: 989 TF/s bf16) with 141 GB
# of HBM3e: the h100 profile with its memory.
ALSO_AS = {"H200": "h100"}
MEMORY_TOLERANCE = 0.1  # an "80 GB" device shows 79.6-80 GiB; a 40 GB A100 is not an 80 GB one


def visible_gpus() -> list[tuple[str, float]] | None:
    """(name, memory in GiB) of each GPU this process may use, as the driver reports them, or None
    where it cannot tell. From nvidia-smi: torch would import for seconds and make a CUDA context
    on GPU 0 in the launcher, beside rank 0's."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.count(",") >= 3]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    wanted = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    gpus = []
    for index, uuid, name, mib in rows:
        if (
            wanted is None
            or index in wanted
            or any(uuid.startswith(w) for w in wanted if w.startswith("GPU-"))
        ):
            try:
                gpus.append((name, float(mib) / 1024))
            except ValueError:
                continue
    return gpus


def profile_of(gpu: str) -> str | None:
    """The shipped profile that describes a GPU of this name, or None."""
    for profile, names in PROFILE_GPUS.items():
        if any(n in gpu for n in names):
            return profile
    return next((p for n, p in ALSO_AS.items() if n in gpu), None)


def device_problem(cfg: RunConfig, gpus: list[tuple[str, float]] | None = None) -> Problem | None:
    """A shipped GPU profile must describe the GPUs that train: plans, memory verdicts and MFU
    are computed from its figures, so an H100 trained as hardware=a100 reports an MFU 3.2x too
    high and nothing says so. Compared: the device's name, then its memory."""
    hw = cfg.hardware
    if hw.device_type != "cuda" or hw.name not in PROFILE_GPUS:
        return None
    gpus = visible_gpus() if gpus is None else gpus
    if not gpus:
        return None  # nothing to compare with (no nvidia-smi): gpu_problem counted the devices
    name = next((n for n, _ in gpus if profile_of(n) != hw.name), gpus[0][0])
    gib = min(g for _, g in gpus)  # the plan must fit the smallest
    fits = profile_of(name)
    if fits != hw.name:
        what = (
            f"hardware={hw.name} describes {' / '.join(PROFILE_GPUS[hw.name])} GPUs, but this machine's "
            f"GPU is {name} ({gib:.1f} GiB): the plan, its memory verdict and the MFU reported would be "
            "another device's"
        )
        rename = f"or, to plan against {hw.name} anyway, give the profile another name: hardware.name={hw.name}-as-given"
        if fits is None:
            fix = f"`fleetwise calibrate` measures this machine into a profile of its own (hardware=local); {rename}"
        else:
            fix = f"hardware={fits}"
            if abs(_profile_memory(fits) - gib) > MEMORY_TOLERANCE * gib:
                fix += f" hardware.memory_per_device_gib={gib:.0f}"
            fix += f"; {rename}"
        return Problem("hardware", what, fix)
    if abs(hw.memory_per_device_gib - gib) > MEMORY_TOLERANCE * hw.memory_per_device_gib:
        return Problem(
            "hardware.memory_per_device_gib",
            f"hardware={hw.name} plans {hw.memory_per_device_gib:g} GiB per device, but this machine's "
            f"{name} has {gib:.1f} GiB",
            f"hardware.memory_per_device_gib={gib:.0f}",
        )
    return None


def _profile_memory(profile: str) -> float:
    """memory_per_device_gib of a shipped profile (conf/hardware/<profile>.yaml)."""
    import yaml

    from fleetwise.config.paths import config_dir

    return float(
        yaml.safe_load((config_dir() / "hardware" / f"{profile}.yaml").read_text())["memory_per_device_gib"]
    )


MAX_RANKS_PER_CORE = 8  # the 16-rank 4D mesh trains on 2 cores; far beyond, gloo times out
RANK_BASE_BYTES = 200 << 20  # a CPU rank before its tensors: interpreter, torch, gloo (RSS)


def capacity_problem(cfg: RunConfig, plan: Plan, cores: int | None = None, available: int | None = None):
    """A CPU job whose ranks this machine cannot hold (4096 ranks on 2 cores; processes whose
    memory adds up past what is free) is refused before anything is spawned, unless
    launch.oversubscribe=true. Returns (loc, message, hint) or None."""
    from fleetwise.launcher.torchrun import nproc_per_node

    if cfg.hardware.device_type != "cpu":
        return None
    ranks = nproc_per_node(cfg)
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    available = _mem_available() if available is None else available
    need = ranks * (RANK_BASE_BYTES + int(plan.memory_bytes.get("total", 0)))
    what = None
    if ranks > MAX_RANKS_PER_CORE * cores:
        what = f"{ranks} ranks on this node, but it has {cores} CPU cores (at most {MAX_RANKS_PER_CORE} per core)"
    elif available is not None and need > available:
        what = (
            f"{ranks} ranks need about {need / 2**30:,.1f} GiB here ({RANK_BASE_BYTES >> 20} MiB of "
            f"start-up per rank + the plan's {plan.memory_bytes.get('total', 0) / 2**30:,.2f} GiB), "
            f"but {available / 2**30:,.1f} GiB are available"
        )
    if what is None:
        return None
    return (
        "hardware.devices_per_node" if cfg.strategy.name != "ps" else "strategy.num_trainers",
        what,
        "use fewer ranks, or launch.oversubscribe=true to start them anyway",
    )


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
