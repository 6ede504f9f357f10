"""`fleetwise train`: validate every sweep point, then run the job(s) through Hydra.

Hydra's own app (`hydra.main`) runs the jobs, so its multirun sweeps, launcher plugins
(`hydra/launcher=submitit_slurm` turns a sweep into SLURM jobs) and callbacks work as Hydra users
expect. Validation happens first, in this process, for every point of the sweep: a bad config
exits 2 before any process starts or any directory is written.
"""

from __future__ import annotations

import itertools
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from fleetwise import rundir
from fleetwise.config.problems import Problem
from fleetwise.config.run import RunConfig
from fleetwise.launcher.auto import AutoOutcome
from fleetwise.launcher.preflight import preflight
from fleetwise.plan.records import Plan
from fleetwise.rundir import Metric, Summary

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
    from fleetwise.launcher.hostnet import network_problems
    from fleetwise.launcher.launch import capacity_problem, gpu_problem, run_dir_problems

    problems: list[Problem] = []
    checked: dict[tuple[str, ...], Checked] = {}
    tracked: set[str] = set()  # experiments the points log to
    for point in points:
        pf = preflight(point, launching=True)
        if pf.cfg is not None and pf.cfg.tracking.enabled and pf.cfg.launch.node_rank == 0:
            tracked.add(pf.cfg.tracking.experiment)
        prefix = f"[{' '.join(point)}] " if len(points) > 1 else ""
        problems += [Problem(p.loc, prefix + p.msg, p.hint) for p in pf.problems]
        if pf.cfg is not None:  # the config parsed: what this machine and run directory say too
            point_problems = [] if pf.problems else resume_problems(pf.cfg) + run_dir_problems(pf.cfg)
            problems += [Problem(p.loc, prefix + p.msg, p.hint) for p in point_problems]
            full = capacity_problem(pf.cfg, pf.plan) if pf.plan is not None else None
            if full and not pf.cfg.launch.oversubscribe:
                problems.append(Problem(full[0], prefix + full[1], full[2]))
                point_problems.append(problems[-1])
            elif full:
                Console(stderr=True).print(
                    f"[yellow]warning[/]: {prefix}{full[1]} (launch.oversubscribe=true)"
                )
            if not pf.problems and pf.cfg.launch.nnodes != "1":  # this node must reach node 0
                unreachable = [Problem(p.loc, prefix + p.msg, p.hint) for p in network_problems(pf.cfg)]
                problems += unreachable
                point_problems += unreachable
            gpu = gpu_problem(pf.cfg)
            if gpu:
                problems.append(
                    Problem(
                        "hardware",
                        prefix + gpu.split(". ")[0],
                        "use hardware=cpu here; validate and plan work for any profile",
                    )
                )
            if not pf.problems and not point_problems and not gpu:
                checked[tuple(point)] = Checked(pf.cfg, pf.plan, pf.auto)
    if tracked and not problems:
        from fleetwise.tracking.store import credentials_problem, tracking_uri

        refused = credentials_problem(tracking_uri(), sorted(tracked)[0])
        if refused:
            problems.append(Problem("tracking", *refused))
    return problems, checked


def resume_problems(cfg) -> list[Problem]:
    """The checkpoint a job would resume from must be complete, intact and of the same model."""
    from fleetwise.runtime.checkpoint_files import find_resume, verify

    if cfg.checkpoint.resume == "none" or (cfg.checkpoint.resume == "auto" and not cfg.run.dir):
        return []
    path = find_resume(cfg, Path(cfg.run.dir or "."))  # an explicit path is checked without run.dir too
    return verify(path, cfg) if path is not None else []


class JobFailed(RuntimeError):
    """Raised by a sweep job that failed, so that Hydra's launchers (possibly in other processes,
    e.g. submitit) report the failure and `fleetwise train -m` exits non-zero."""


def run_hydra(overrides: list[str], multirun: bool, checked: dict[tuple[str, ...], Checked]) -> int:
    import hydra

    from fleetwise.config.compose import config_dir, search_path_overrides

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


def run_job(
    cfg,
    plan,
    run_dir: Path,
    argv: list[str],
    console: Console,
    env_paths=frozenset(),
    auto: AutoOutcome | None = None,
) -> int:
    """Run one job: launch the ranks, follow them, own its MLflow run, print the summary.
    `auto`: the strategy=auto search that chose the layout (shown, saved and logged with the run)."""
    from rich.markup import escape

    from fleetwise.launcher.launch import RunDirBusy, clear_run_dir, lock_run_dir
    from fleetwise.plan.render import describe_job, print_search

    if auto is not None and auto.result is not None:
        print_search(console, auto.result, cfg.auto.top_k, auto.override_text)

    console.print(
        f"[bold]fleetwise train[/] · {describe_job(cfg, plan)} · run dir {run_dir}", highlight=False
    )
    if not plan.fits and cfg.plan.memory_check == "warn":
        from fleetwise.launcher.preflight import memory_problem
        from fleetwise.plan.remedies import remedies

        problem = memory_problem(plan, remedies(cfg))
        console.print(
            f"[bold yellow]⚠ the plan does not fit in memory[/] (plan.memory_check=warn: launching anyway): "
            f"{escape(problem.msg)}",
            highlight=False,
        )
    try:  # one job per run directory at a time, for the whole life of the job
        lock = lock_run_dir(run_dir, cfg.launch.node_rank)
    except RunDirBusy as exc:
        Console(stderr=True).print(f"[bold red]✗ run.dir[/]: {escape(str(exc))}", highlight=False)
        return EXIT_INVALID
    with lock:
        if cfg.run.overwrite and cfg.launch.node_rank == 0:
            clear_run_dir(run_dir)
        return _run_locked(cfg, plan, run_dir, argv, console, env_paths, auto)


def _run_locked(cfg, plan, run_dir: Path, argv: list[str], console: Console, env_paths, auto=None) -> int:
    from rich.markup import escape

    from fleetwise.launcher.launch import launch_job
    from fleetwise.runtime.lifeline import Stopped, stop_signals

    if auto is not None and cfg.launch.node_rank == 0:
        rundir.write_auto_search(run_dir, auto.to_dict())
    tracker = _Tracking(cfg, plan, run_dir, env_paths, auto)
    # Ctrl-C, SIGTERM (kill, SLURM, systemd) and SIGHUP (a closed terminal) all stop the ranks'
    # process group (launch_job) and mark the run KILLED; without this a SIGTERM'd launcher left
    # every rank running and the MLflow run RUNNING forever.
    with stop_signals():
        # A multi-node job's run exists before its ranks start, so that node 0 can hand the id to
        # the other nodes through the rendezvous store as soon as it is up (their samplers cover
        # the job).
        early = tracker.multi_node and cfg.launch.node_rank == 0
        if early:
            rundir.write_run_dir(
                run_dir, cfg, plan, argv
            )  # the run's artifacts (launch_job writes them again)
            tracker.start()
        try:
            result = launch_job(
                cfg,
                plan,
                run_dir,
                argv,
                console,
                on_started=None if early else tracker.start_background,
                on_poll=tracker.poll,
            )
        except KeyboardInterrupt as exc:
            reason = exc.reason if isinstance(exc, Stopped) else "interrupted by the user (Ctrl-C)"
            tracker.finish("KILLED", reason, {})
            raise
    if result.returncode != 0 and result.error:  # the cause first, before the summary and MLflow
        from fleetwise.launcher.failure import TracebackFold, failure_report

        err_console = Console(stderr=True, soft_wrap=True)
        for line in failure_report(cfg, run_dir, argv, result.error, result.fold or TracebackFold()):
            err_console.print(line, highlight=False)
    elif result.fold is not None and result.fold.held:  # a traceback in a job that still succeeded
        for line in result.fold.held:
            console.print(line, highlight=False, markup=False, soft_wrap=True)
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


REDACTED = "<redacted>"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def redact_params(params: dict[str, str], env_paths=(), environ=None) -> dict[str, str]:
    """MLflow params without secrets: values read from the environment (${oc.env:…}), and any
    value equal to a credential in the environment (a tracking password, a token)."""
    import os

    from fleetwise.launcher.launch import is_secret_name

    environ = os.environ if environ is None else environ
    secrets = {v for k, v in environ.items() if is_secret_name(k) and len(v) >= 4}
    return {k: REDACTED if k in env_paths or any(s in v for s in secrets) else v for k, v in params.items()}


class _Tracking:
    """The job's MLflow run, owned by this launcher on node 0 (it outlives crashed ranks and torchrun
    restarts). It ships rank 0's metrics.jsonl in batches; metrics.jsonl doubles as the spool when
    the tracking server is away (`fleetwise sync` delivers what is left)."""

    POLL_EVERY_S = 1.0  # until the ranks train (MLflow's start-up, an outage's retries)
    # Once they train: a delivery every 10 s (MLflow's charts are at most that far behind). Measured
    # here: a log_batch into sqlite costs ~8 ms of CPU however few points it carries, plus 60-110 µs
    # a point; 1,000-point batches instead of one call a second for 2-rank gpt/tiny's ~33 steps.
    DELIVER_EVERY_S = 10.0
    MAX_BATCHES = 100  # per delivery in the thread: 100,000 points, any step rate's 10 s and more
    # The tracking thread's nice value once the ranks train (Linux keeps one per thread). Measured
    # on 2 cores, 2-rank gpt/tiny: the launcher spent 4-13% of a core inside the steps' window,
    # mostly MLflow's start-up (import, run, params: ~4 s of CPU) still running when the steps began.
    STEPPING_NICE = 10

    def __init__(self, cfg, plan, run_dir: Path, env_paths=frozenset(), auto: AutoOutcome | None = None):
        self.cfg, self.plan, self.run_dir = cfg, plan, run_dir
        self.auto = auto
        self.env_paths = env_paths  # config paths read from the environment: kept out of the params
        self.tracker = None
        self.enabled = cfg.tracking.enabled and cfg.launch.node_rank == 0
        self.last_poll = self.last_delivery = 0.0
        # a multi-node job: node 0 hands the run id to the other nodes, which log their system metrics
        self.multi_node = cfg.tracking.enabled and cfg.tracking.system_metrics and cfg.hardware.nodes > 1
        self.publisher = None
        self.node_metrics = None
        self._thread = None  # start_background's: RunTracker is used by it alone until finish joins it
        self._stop = threading.Event()
        self._tid: int | None = None
        self._metrics_at_start = -1
        self._yielded = False

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
            **cfg.tracking.tags,  # the user's own (reserved prefixes refused by validation)
            "fleetwise.recipe": cfg.recipe,
            "fleetwise.strategy": cfg.strategy.name,
            "fleetwise.hardware": cfg.hardware.name,
            "fleetwise.world_size": str(self.plan.world_size),
        }
        commit = git_commit()
        if commit:
            tags["fleetwise.git_commit"] = commit
        artifacts = [Path(name) for name in rundir.RUN_ARTIFACTS]
        if self.auto is not None:  # strategy=auto: the chosen layout and the candidates weighed
            tags["fleetwise.strategy"] = "auto"
            tags["fleetwise.auto_override"] = self.auto.override_text
            artifacts.append(Path(rundir.AUTO_SEARCH_FILE))
        name = cfg.run.name or f"{cfg.recipe.replace('/', '-')}-{cfg.strategy.name}-{cfg.hardware.name}"
        from fleetwise.tracking.datasets import describe_data

        self.tracker = RunTracker(
            self.run_dir,
            experiment=cfg.tracking.experiment,
            run_name=name,
            params=redact_params(flatten_config(cfg.model_dump(mode="json")), self.env_paths),
            tags=tags,
            artifacts=artifacts,
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

    def start_background(self) -> None:
        """`start`, then a delivery every POLL_EVERY_S, in a thread of this launcher: called once
        torchrun runs, so that importing mlflow (~2.5 s) overlaps the ranks' start-up; once the
        ranks train (`poll` sees metrics.jsonl grow) the thread yields the CPU to them and delivers
        every DELIVER_EVERY_S. A multi-node job's run is handled in the launcher's own loop (its id
        goes to the other nodes)."""
        if not self.enabled or self.multi_node:
            self.start()
            return
        self._metrics_at_start = _size(rundir.metrics_path(self.run_dir))
        self._thread = threading.Thread(target=self._deliver, name="fleetwise-tracking", daemon=True)
        self._thread.start()

    def _deliver(self) -> None:
        self._tid = threading.get_native_id()
        try:
            self.start()
            while not self._stop.wait(self.DELIVER_EVERY_S if self._yielded else self.POLL_EVERY_S):
                if self.tracker is not None:
                    self.tracker.poll(max_batches=self.MAX_BATCHES)  # never raises
        except Exception as exc:  # a bug here must not kill the job; the spool keeps the metrics
            print(f"fleetwise: MLflow tracking stopped: {exc}", file=sys.stderr, flush=True)

    def _yield_to_ranks(self) -> None:
        """Once the ranks train, the tracking thread runs at nice STEPPING_NICE: on a machine whose
        cores the ranks fill, MLflow's start-up and deliveries take only what they leave idle (a
        rank waking from a collective preempts it). Only then, so that the start-up keeps its share
        while the ranks start; the thread keeps the value (lowering it needs privileges), and
        `finish` runs in the launcher's own thread."""
        if self._yielded or self._tid is None:
            return
        if _size(rundir.metrics_path(self.run_dir)) == self._metrics_at_start:
            return
        self._yielded = True
        if sys.platform.startswith("linux"):  # elsewhere the id of a thread is not a process's
            import contextlib
            import os

            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self._tid, self.STEPPING_NICE)

    def poll(self) -> None:
        import time

        if self._thread is not None:
            self._yield_to_ranks()
            return
        if self.tracker is None or time.monotonic() - self.last_poll < self.POLL_EVERY_S:
            return
        self.last_poll = time.monotonic()
        training = _size(rundir.metrics_path(self.run_dir)) > 0
        if not training or self.last_poll - self.last_delivery >= self.DELIVER_EVERY_S:
            self.last_delivery = self.last_poll
            self.tracker.poll()
        if self.publisher is not None and self.tracker.run_id:
            self.publisher.publish(self.tracker.run_id)

    def finish(self, status: str, error: str | None, summary: dict) -> str | None:
        if self._thread is not None:  # its last delivery done, the rest happens here
            self._stop.set()
            self._thread.join()
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
        self.tracker.add_artifacts(rundir.rank_logs(self.run_dir) + [rundir.launcher_log(self.run_dir)])
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


def _against_chance(cfg, records, final: float) -> str:
    """The final loss beside the first step's and the loss of a model that learned nothing, so a
    run that learns shows it ("3.31, first 5.52; chance 5.55: -40%")."""
    from fleetwise.families import family_of

    text = f"{final:.4f}"
    losses = [r[Metric.LOSS] for r in records if Metric.LOSS in r]
    chance = family_of(cfg.model).chance_loss
    if losses:
        text += f" (first step {losses[0]:.4f}"
        if chance is not None:
            c = chance(cfg.model)
            text += f"; chance {c:.4f}: {final / c - 1:+.0%}"
        text += ")"
    return text


def print_summary(console: Console, cfg, plan, result) -> dict[str, float]:
    """The numbers of the run, warm-up steps excluded from throughput, beside the plan's."""
    from rich.table import Table

    from fleetwise.tracking.summary import summarize

    s = summarize(result.records, cfg.train.warmup_steps_excluded)
    if Summary.STEP_TIME_MEDIAN not in s:
        return s
    t = Table(
        title=f"summary ({int(s[Summary.STEPS])} steps, throughput over the last "
        f"{int(s[Summary.STEPS_MEASURED])})",
        show_header=False,
        box=None,
        title_justify="left",
    )
    t.add_column(style="bold cyan")
    t.add_column()
    t.add_row("final loss", _against_chance(cfg, result.records, s[Summary.FINAL_LOSS]))
    rate = f"{s[Summary.SAMPLES_PER_S]:,.1f} samples/s"
    if Summary.TOKENS_PER_S in s:
        rate += f" · {s[Summary.TOKENS_PER_S]:,.0f} tokens/s"
    t.add_row("throughput", rate)
    t.add_row(
        "step time",
        f"{s[Summary.STEP_TIME_MEDIAN] * 1e3:,.1f} ms median (plan {plan.step_time_s * 1e3:,.1f} ms)",
    )
    t.add_row("MFU", f"{s[Summary.MFU]:.1%} (plan {plan.mfu:.1%})")
    mib = 2**20
    ratio = s.get(Summary.MEMORY_RATIO)
    t.add_row(
        "peak memory",
        f"{s[Summary.PEAK_BYTES_MAX] / mib:,.2f} MiB per device, max over ranks (plan "
        f"{s[Summary.PREDICTED_BYTES] / mib:,.2f} MiB" + (f", ratio {ratio:.3f})" if ratio else ")"),
    )
    console.print(t)
    return s
