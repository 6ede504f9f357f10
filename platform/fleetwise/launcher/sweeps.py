"""`fleetwise train`'s sweeps: validate every sweep point, then run the job(s) through Hydra.

Hydra's own app (`hydra.main`) runs the jobs, so its multirun sweeps, launcher plugins
(`hydra/launcher=submitit_slurm` turns a sweep into SLURM jobs) and callbacks work as Hydra users
expect. Validation happens first, in this process, for every point of the sweep: a bad config
exits 2 before any process starts or any directory is written. Each point then runs as one job
(launcher/job.py), from the config and plan checked here.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from fleetwise.config.problems import Problem
from fleetwise.config.run import RunConfig
from fleetwise.launcher.auto import AutoOutcome
from fleetwise.launcher.job import run_job
from fleetwise.launcher.preflight import machine_problems, preflight
from fleetwise.plan.records import Plan

EXIT_OK, EXIT_FAIL, EXIT_INVALID = 0, 1, 2
MULTIRUN_FLAGS = ("-m", "--multirun")


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """Expand Hydra sweep syntax (a=1,2 b=x,y) into the Cartesian product of plain override lists."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = []
    for ov in parsed:
        if ov.is_sweep_override():
            key = ov.get_key_element()
            choices.append([f"{key}={v}" for v in ov.sweep_string_iterator()])
        else:
            choices.append([ov.input_line])
    return [list(p) for p in itertools.product(*choices)]


@dataclass(frozen=True)
class Checked:
    """A sweep point validated and planned before launch (both done once, here)."""

    cfg: RunConfig
    plan: Plan
    auto: AutoOutcome | None = None  # strategy=auto: the search that chose the layout


def check_points(points: list[list[str]]) -> tuple[list[Problem], dict[tuple[str, ...], Checked]]:
    """Every problem of every point (exit 2 before anything starts), and each valid point's config
    and plan, keyed by its overrides, for the job to run without validating or planning again."""
    problems: list[Problem] = []
    checked: dict[tuple[str, ...], Checked] = {}
    tracked: set[str] = set()  # experiments the points log to
    for point in points:
        pf = preflight(point, launching=True)
        if pf.cfg is not None and pf.cfg.tracking.enabled and pf.cfg.launch.node_rank == 0:
            tracked.add(pf.cfg.tracking.experiment)
        prefix = f"[{' '.join(point)}] " if len(points) > 1 else ""
        found = list(pf.problems)
        if pf.cfg is not None:  # the config parsed: what this machine and run directory say too
            here, warning = machine_problems(pf)
            if warning:
                Console(stderr=True).print(f"[yellow]warning[/]: {prefix}{warning}")
            found += here
            if not found:
                checked[tuple(point)] = Checked(pf.cfg, pf.plan, pf.auto)
        problems += [Problem(p.loc, prefix + p.msg, p.hint) for p in found]
    if tracked and not problems:
        from fleetwise.tracking.store import credentials_problem, tracking_uri

        refused = credentials_problem(tracking_uri(), sorted(tracked)[0])
        if refused:
            problems.append(Problem("tracking", *refused))
    return problems, checked


class JobFailed(RuntimeError):
    """Raised by a sweep job that failed, so that Hydra's launchers (possibly in other processes,
    e.g. submitit) report the failure and `fleetwise train -m` exits non-zero."""


def run_hydra(overrides: list[str], multirun: bool, checked: dict[tuple[str, ...], Checked]) -> int:
    import hydra

    from fleetwise.config.compose import kept_app_compositions, search_path_overrides
    from fleetwise.config.paths import config_dir

    jobs = Jobs(checked)
    run_dir = next(iter(checked.values())).cfg.run.dir if checked else None
    extra = []
    if run_dir and not any(o.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for o in overrides):
        extra.append(f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}")
    app = hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")(jobs)
    saved = sys.argv
    extra += search_path_overrides(overrides)
    sys.argv = ["fleetwise train", *overrides, *extra, *(["--multirun"] if multirun else [])]
    try:
        with kept_app_compositions():
            app()
    except SystemExit as exc:  # Hydra reports a job's exception itself, then exits non-zero
        if exc.code not in (0, None):
            return max(jobs.codes, default=EXIT_FAIL) or EXIT_FAIL
    finally:
        sys.argv = saved
    return max(jobs.codes, default=EXIT_OK)


class Jobs:
    """Hydra's task function: runs one job per call (once per sweep point, possibly in another
    process), from the config and plan checked before launch, and keeps the exit codes.

    A job in another process (a submitit launcher on a cluster) has no checked result to reuse
    and validates and plans its point itself."""

    def __init__(self, checked: dict[tuple[str, ...], Checked]):
        self.checked = checked
        self.codes: list[int] = []

    def __call__(self, dcfg) -> int:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        task = list(hc.overrides.task)
        known = self.checked.get(tuple(task))
        if known is None:
            known = self._check(dcfg, hc)
            if known is None:
                self.codes.append(EXIT_INVALID)
                return EXIT_INVALID
        cfg = cluster_launch(known.cfg, _submitit_env())
        multirun = hc.mode is not None and hc.mode.name == "MULTIRUN"
        run_dir = Path(hc.runtime.output_dir) if (multirun or not cfg.run.dir) else Path(cfg.run.dir)
        code = run_job(
            cfg,
            known.plan,
            run_dir.resolve(),
            task,
            Console(soft_wrap=True),
            env_interpolated(dcfg),
            auto=known.auto,
        )
        self.codes.append(code)
        if code != EXIT_OK and multirun:
            raise JobFailed(f"job {hc.job.num} ({' '.join(task)}) failed with exit code {code}")
        return code

    @staticmethod
    def _check(dcfg, hc) -> Checked | None:
        from omegaconf import OmegaConf

        from fleetwise.config.problems import ConfigError
        from fleetwise.config.recipes import apply_strategy_choice
        from fleetwise.config.validate import validate
        from fleetwise.plan import make_plan

        data = OmegaConf.to_container(dcfg, resolve=True)
        data["recipe"] = hc.runtime.choices.get("recipe", "")
        data = apply_strategy_choice(data, list(hc.overrides.task))  # as validate and plan did
        try:
            cfg = validate(data, launching=True)
        except ConfigError as err:
            from fleetwise.plan.render import print_problems

            print_problems(Console(stderr=True), err.problems)
            return None
        return Checked(cfg, make_plan(cfg))


def _submitit_env():
    """submitit's view of the allocation when this job runs under a submitit launcher, else None."""
    try:
        import submitit

        return submitit.JobEnvironment()
    except Exception:  # noqa: BLE001 - not a submitit job (RuntimeError), or submitit missing
        return None


def cluster_launch(cfg, job_env):
    """On a multi-node SLURM allocation (hydra/launcher=submitit_slurm, one task per node), each
    node's task runs this job: torchrun then spans the nodes, rendezvousing on the first host."""
    if job_env is None or job_env.num_nodes <= 1 or cfg.launch.nnodes != str(cfg.hardware.nodes):
        return cfg
    launch = cfg.launch.model_copy(
        update={
            "nnodes": str(job_env.num_nodes),
            "node_rank": job_env.node,
            "rdzv_endpoint": f"{job_env.hostnames[0]}:29500",
            "rdzv_id": str(job_env.job_id),
        }
    )
    return cfg.model_copy(update={"launch": launch})


def env_interpolated(dcfg, prefix: str = "") -> set[str]:
    """Dotted paths of the config values that come from the environment (${oc.env:…})."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    out: set[str] = set()
    node = dcfg
    items = node.items_ex(resolve=False) if isinstance(node, DictConfig) else enumerate(node)
    for key, _ in items:
        if prefix == "" and key == "hydra":
            continue
        path = f"{prefix}{key}"
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)):
            out |= env_interpolated(child, path + ".")
        elif OmegaConf.is_interpolation(node, key) and "oc.env" in str(child._value()):
            out.add(path)
    return out
