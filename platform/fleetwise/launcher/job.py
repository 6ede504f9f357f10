"""One job on this node, start to end: the plan shown, the run directory locked (and cleared for
run.overwrite), the ranks started under torchrun and followed (launcher/torchrun.py), the job's
MLflow run (launcher/job_tracking.py), the failure's report, and the summary beside the plan.

Ctrl-C, SIGTERM and SIGHUP stop the ranks and mark the run KILLED. `fleetwise train` runs one job per
sweep point through Hydra (launcher/sweeps.py).
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from fleetwise import rundir
from fleetwise.launcher.auto import AutoOutcome
from fleetwise.launcher.job_tracking import JobTracking
from fleetwise.rundir import Metric, Summary

EXIT_OK, EXIT_FAIL, EXIT_INVALID = 0, 1, 2


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

    from fleetwise.launcher.run_dir_guard import RunDirBusy, clear_run_dir, lock_run_dir
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

    from fleetwise.launcher.torchrun import launch_job, rdzv_id
    from fleetwise.runtime.lifeline import Stopped, stop_signals

    if auto is not None and cfg.launch.node_rank == 0:
        rundir.write_auto_search(run_dir, auto.to_dict())
    job_id = rdzv_id(cfg) if cfg.hardware.nodes > 1 else None  # alike on every node (multi-node)
    tracker = JobTracking(cfg, plan, run_dir, env_paths, auto, job_id)
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
