"""`fleetwise train`: validate every sweep point, then run the job(s) through Hydra.

Hydra's own app (`hydra.main`) runs the jobs, so its multirun sweeps, launcher plugins
(`hydra/launcher=submitit_slurm` turns a sweep into SLURM jobs) and callbacks work as Hydra users
expect. Validation happens first, in this process, for every point of the sweep: a bad config
exits 2 before any process starts or any directory is written.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from rich.console import Console

from fleetwise.config.problems import Problem
from fleetwise.plan.preflight import preflight

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


def check_points(points: list[list[str]]) -> list[Problem]:
    from fleetwise.runtime.launch import gpu_problem

    problems: list[Problem] = []
    tracked: set[str] = set()  # experiments the points log to
    for point in points:
        pf = preflight(point, launching=True)
        if pf.cfg is not None and pf.cfg.tracking.enabled and pf.cfg.launch.node_rank == 0:
            tracked.add(pf.cfg.tracking.experiment)
        prefix = f"[{' '.join(point)}] " if len(points) > 1 else ""
        problems += [Problem(p.loc, prefix + p.msg, p.hint) for p in pf.problems]
        if pf.cfg is not None:  # the config parsed: what this machine and run directory say too
            if not pf.problems:
                problems += [Problem(p.loc, prefix + p.msg, p.hint) for p in resume_problems(pf.cfg)]
            gpu = gpu_problem(pf.cfg)
            if gpu:
                problems.append(
                    Problem(
                        "hardware",
                        prefix + gpu.split(". ")[0],
                        "use hardware=cpu here; validate and plan work for any profile",
                    )
                )
    if tracked and not problems:
        from fleetwise.tracking.store import credentials_problem, tracking_uri

        refused = credentials_problem(tracking_uri(), sorted(tracked)[0])
        if refused:
            problems.append(Problem("tracking", *refused))
    return problems


def resume_problems(cfg) -> list[Problem]:
    """The checkpoint a job would resume from must be complete, intact and of the same model."""
    from fleetwise.runtime.checkpoint_files import find_resume, verify

    if cfg.checkpoint.resume == "none" or not cfg.run.dir:
        return []
    path = find_resume(cfg, Path(cfg.run.dir))
    return verify(path, cfg) if path is not None else []


_CODES: list[int] = []  # exit codes of jobs Hydra ran in this process


class JobFailed(RuntimeError):
    """Raised by a sweep job that failed, so that Hydra's launchers (possibly in other processes,
    e.g. submitit) report the failure and `fleetwise train -m` exits non-zero."""


def run_hydra(overrides: list[str], multirun: bool) -> int:
    import hydra

    from fleetwise.config.compose import config_dir, search_path_overrides

    run_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("run.dir=")), None)
    extra = []
    if run_dir and not any(o.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for o in overrides):
        extra.append(f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}")
    _CODES.clear()
    app = hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")(hydra_task)
    saved = sys.argv
    extra += search_path_overrides(overrides)
    sys.argv = ["fleetwise train", *overrides, *extra, *(["--multirun"] if multirun else [])]
    try:
        app()
    except SystemExit as exc:  # Hydra reports a job's exception itself, then exits non-zero
        if exc.code not in (0, None):
            return max(_CODES, default=EXIT_FAIL) or EXIT_FAIL
    finally:
        sys.argv = saved
    return max(_CODES, default=EXIT_OK)


def hydra_task(dcfg) -> int:
    """One job (Hydra calls it once per sweep point, possibly in another process)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from fleetwise.config.problems import ConfigError
    from fleetwise.config.validate import validate
    from fleetwise.plan import make_plan

    hc = HydraConfig.get()
    data = OmegaConf.to_container(dcfg, resolve=True)
    data["recipe"] = hc.runtime.choices.get("recipe", "")
    console = Console(soft_wrap=True)
    try:
        cfg = validate(data, launching=True)
    except ConfigError as err:
        from fleetwise.plan.render import print_problems

        print_problems(Console(stderr=True), err.problems)
        _CODES.append(EXIT_INVALID)
        return EXIT_INVALID
    cfg = cluster_launch(cfg, _submitit_env())
    multirun = hc.mode is not None and hc.mode.name == "MULTIRUN"
    run_dir = Path(hc.runtime.output_dir) if (multirun or not cfg.run.dir) else Path(cfg.run.dir)
    code = run_job(cfg, make_plan(cfg), run_dir.resolve(), list(hc.overrides.task), console)
    _CODES.append(code)
    if code != EXIT_OK and multirun:
        raise JobFailed(f"job {hc.job.num} ({' '.join(hc.overrides.task)}) failed with exit code {code}")
    return code


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


def run_job(cfg, plan, run_dir: Path, argv: list[str], console: Console) -> int:
    """Run one job: launch the ranks, follow them, own its MLflow run, print the summary."""
    from rich.markup import escape

    from fleetwise.plan.render import describe_job
    from fleetwise.runtime.launch import launch_job

    console.print(
        f"[bold]fleetwise train[/] · {describe_job(cfg, plan)} · run dir {run_dir}", highlight=False
    )
    tracker = _Tracking(cfg, plan, run_dir)
    # A multi-node job's run exists before its ranks start, so that node 0 can hand the id to the
    # other nodes through the rendezvous store as soon as it is up (their samplers cover the job).
    early = tracker.multi_node and cfg.launch.node_rank == 0
    if early:
        from fleetwise.runtime.launch import write_run_dir

        write_run_dir(run_dir, cfg, plan, argv)  # the run's artifacts (launch_job writes them again)
        tracker.start()
    try:
        result = launch_job(
            cfg,
            plan,
            run_dir,
            argv,
            console,
            on_started=None if early else tracker.start,
            on_poll=tracker.poll,
        )
    except KeyboardInterrupt:
        tracker.finish("KILLED", "interrupted by the user (Ctrl-C)", {})
        raise
    summary = print_summary(console, cfg, plan, result)
    status = "FINISHED" if result.returncode == 0 else "FAILED"
    run_id = tracker.finish(status, result.error, summary)
    if run_id:
        console.print(
            f"MLflow run [bold]{run_id}[/] (experiment {cfg.tracking.experiment}) · browse with "
            "[bold]fleetwise ui[/] · compare runs with [bold]fleetwise compare[/]",
            highlight=False,
        )
    if result.returncode != 0:
        err = escape(result.error or "")
        Console(stderr=True).print(f"[bold red]✗ training failed[/]: {err}", highlight=False, soft_wrap=True)
        return result.returncode if result.returncode > 0 else EXIT_FAIL
    return EXIT_OK


class _Tracking:
    """The job's MLflow run, owned by this launcher on node 0 (it outlives crashed ranks and torchrun
    restarts). It ships rank 0's metrics.jsonl in batches; metrics.jsonl doubles as the spool when
    the tracking server is away (`fleetwise sync` delivers what is left)."""

    POLL_EVERY_S = 1.0

    def __init__(self, cfg, plan, run_dir: Path):
        self.cfg, self.plan, self.run_dir = cfg, plan, run_dir
        self.tracker = None
        self.enabled = cfg.tracking.enabled and cfg.launch.node_rank == 0
        self.last_poll = 0.0
        # a multi-node job: node 0 hands the run id to the other nodes, which log their system metrics
        self.multi_node = cfg.tracking.enabled and cfg.tracking.system_metrics and cfg.hardware.nodes > 1
        self.publisher = None
        self.node_metrics = None

    def start(self) -> None:
        """Called once torchrun runs: importing mlflow (~2.5 s) overlaps the ranks' start-up."""
        if self.multi_node and self.cfg.launch.node_rank > 0:
            from fleetwise.tracking.nodes import NodeSystemMetrics
            from fleetwise.tracking.store import tracking_uri

            launch = self.cfg.launch
            self.node_metrics = NodeSystemMetrics(launch.rdzv_endpoint, launch.node_rank, tracking_uri())
            self.node_metrics.start()
        if not self.enabled:
            return
        from fleetwise.tracking.run_tracker import RunTracker, flatten_config, git_commit
        from fleetwise.tracking.sweep import parent_run_id_from_hydra

        cfg = self.cfg
        tags = {
            "fleetwise.recipe": cfg.recipe,
            "fleetwise.strategy": cfg.strategy.name,
            "fleetwise.hardware": cfg.hardware.name,
            "fleetwise.world_size": str(self.plan.world_size),
        }
        commit = git_commit()
        if commit:
            tags["fleetwise.git_commit"] = commit
        name = cfg.run.name or f"{cfg.recipe.replace('/', '-')}-{cfg.strategy.name}-{cfg.hardware.name}"
        from fleetwise.tracking.datasets import describe_data

        self.tracker = RunTracker(
            self.run_dir,
            experiment=cfg.tracking.experiment,
            run_name=name,
            params=flatten_config(cfg.model_dump(mode="json")),
            tags=tags,
            artifacts=[Path("config.yaml"), Path("plan.json"), Path("command.txt")],
            parent_run_id=parent_run_id_from_hydra(),
            system_metrics=cfg.tracking.system_metrics,
            datasets=[describe_data(cfg)],
            node_id="node_0" if cfg.hardware.nodes > 1 else None,
        )
        self.tracker.start()
        if self.multi_node:
            from fleetwise.tracking.nodes import RunIdPublisher

            self.publisher = RunIdPublisher(cfg.launch.rdzv_endpoint)
            if self.tracker.run_id:
                self.publisher.publish(self.tracker.run_id)

    def poll(self) -> None:
        import time

        if self.tracker is None or time.monotonic() - self.last_poll < self.POLL_EVERY_S:
            return
        self.last_poll = time.monotonic()
        self.tracker.poll()
        if self.publisher is not None and self.tracker.run_id:
            self.publisher.publish(self.tracker.run_id)

    def finish(self, status: str, error: str | None, summary: dict) -> str | None:
        if self.node_metrics is not None:
            self.node_metrics.stop()
            if self.node_metrics.run_id is None:
                why = self.node_metrics.error or "node 0 published no MLflow run id"
                print(f"fleetwise: this node's system metrics were not logged: {why}", file=sys.stderr)
        if self.tracker is None:
            return None
        if self.publisher is not None:
            self.publisher.stop()
            if not self.publisher.done.is_set():
                why = self.publisher.error or "the job ended before the rendezvous store took the run id"
                self.tracker.notify(f"the other nodes' system metrics were not logged: {why}")
        self.tracker.add_artifacts(
            sorted((self.run_dir / "logs").glob("rank_*.log")) + [self.run_dir / "logs" / "launcher.log"]
        )
        if status == "FINISHED":
            self.log_model()
        self.tracker.finish(status, error=error, summary=summary)
        return self.tracker.run_id

    def log_model(self) -> None:
        """The trained model as an MLflow model (tracking/models.py). Training succeeded: a failure
        here is reported, never turned into a failed job."""
        from fleetwise.runtime.checkpoint_files import final_weights
        from fleetwise.tracking.store import describe

        cfg, run_id = self.cfg, self.tracker.run_id
        if not cfg.tracking.log_model or cfg.strategy.name == "ps":  # ps: the shards of RUN_DIR/ps
            return
        weights = final_weights(cfg, self.run_dir)
        later = f"log it later with `fleetwise checkpoint export {self.run_dir} --log-model`"
        if run_id is None or weights is None:
            why = "MLflow is unreachable" if run_id is None else "the job left no final weights"
            self.tracker.notify(f"the model was not logged ({why}); {later}")
            return
        from fleetwise.tracking.models import log_model

        try:
            logged = log_model(
                self.tracker.uri,
                run_id,
                weights,
                cfg=cfg,
                plan=self.plan,
                register_as=cfg.tracking.register_as,
                step=cfg.train.steps,
            )
        except Exception as exc:  # noqa: BLE001 - the job itself succeeded
            self.tracker.notify(f"the model was not logged: {describe(exc)}; {later}")
            return
        what = "weights" if logged["kind"] == "weights" else "a reference to the sharded checkpoint"
        note = f", eval/loss {logged['eval_loss']:.4f}" if "eval_loss" in logged else ""
        reg = (
            f", registered as {cfg.tracking.register_as} v{logged['version']}" if "version" in logged else ""
        )
        self.tracker.notify(f"model logged ({what}{note}{reg}): {logged['model_uri']}")


def print_summary(console: Console, cfg, plan, result) -> dict[str, float]:
    """The numbers of the run, warm-up steps excluded from throughput, beside the plan's."""
    from rich.table import Table

    from fleetwise.tracking.summary import summarize

    s = summarize(result.records, cfg.train.warmup_steps_excluded)
    if "summary/step_time_median_s" not in s:
        return s
    t = Table(
        title=f"summary ({int(s['summary/steps'])} steps, throughput over the last "
        f"{int(s['summary/steps_measured'])})",
        show_header=False,
        box=None,
        title_justify="left",
    )
    t.add_column(style="bold cyan")
    t.add_column()
    t.add_row("final loss", f"{s['summary/final_loss']:.4f}")
    rate = f"{s['summary/samples_per_s_mean']:,.1f} samples/s"
    if "summary/tokens_per_s_mean" in s:
        rate += f" · {s['summary/tokens_per_s_mean']:,.0f} tokens/s"
    t.add_row("throughput", rate)
    t.add_row(
        "step time",
        f"{s['summary/step_time_median_s'] * 1e3:,.1f} ms median (plan {plan.step_time_s * 1e3:,.1f} ms)",
    )
    t.add_row("MFU", f"{s['summary/mfu_mean']:.1%} (plan {plan.mfu:.1%})")
    mib = 2**20
    ratio = s.get("summary/memory_ratio")
    t.add_row(
        "peak memory",
        f"{s['summary/peak_bytes_max'] / mib:,.2f} MiB per device, max over ranks (plan "
        f"{s['summary/predicted_bytes'] / mib:,.2f} MiB" + (f", ratio {ratio:.3f})" if ratio else ")"),
    )
    console.print(t)
    return s
