"""The `fleetwise` command: one table of commands (`COMMANDS`), one prologue for those that take a config.

    fleetwise validate [OVERRIDES…] [--json] [-m]  exit 0 valid, 2 invalid (every problem listed)
    fleetwise plan     [OVERRIDES…] [--json] [-m]  the analytic plan (exit 2 if the config is invalid)
                                               -m: a sweep (key=a,b), one row / JSON entry per point
    fleetwise train    [OVERRIDES…] [-m]       run the job (exit 2 on a bad config, nothing started)
    fleetwise dryrun   [OVERRIDES…] [--ranks SPEC] [--steps N] [--exact] [--json]
                                               the real runtime of any world size on fake tensors
    fleetwise calibrate [--out PATH] [--json]  measure this machine, write hardware profile `local`
    fleetwise tokenize TEXT… --out FILE.bin    a byte-level token file for data=token_file

A row of the table is a `Command`: its handler, its line of help, and its arguments. A config command
(validate, plan, train) goes through one prologue, `run_config_command`: it parses the overrides and
the shared flags (--json where the row has it, -m, --cfg, --help), prints --help and --cfg, expands a
sweep into its points, composes, validates and plans every point (`preflight`), prints every problem
(exit 2) and hands the handler what is left to do. Commands with arguments of their own (dryrun,
calibrate, checkpoint, tokenize, ui, compare, sync) parse their argv themselves.

Heavy imports (torch, mlflow) stay out of validate/plan: they load inside the commands that use them.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fleetwise.config.problems import Problem, did_you_mean
from fleetwise.launcher.preflight import Preflight, preflight
from fleetwise.tracking import commands as tracking  # light: mlflow loads inside the commands

EXIT_OK, EXIT_FAIL, EXIT_INVALID = 0, 1, 2

Argument = tuple[tuple[str, ...], dict[str, Any]]  # argparse's add_argument(*flags, **options)
JSON: Argument = (("--json",), {"action": "store_true", "help": "machine-readable output"})


@dataclass(frozen=True)
class Command:
    """One row of the command table."""

    handler: Callable[..., int]
    help: str  # its line in `fleetwise --help`
    # A config command's arguments beyond the overrides, -m, --cfg and --help every one of them takes;
    # None: the handler parses its own argv (`handler(argv)`).
    arguments: tuple[Argument, ...] | None = None
    # preflight's keywords: the prologue checks and plans every point and calls `handler(args, pf)`
    # with a valid one (without -m). None: `handler(args, points)` checks the points itself (train,
    # whose check also asks this machine).
    checks: dict[str, bool] | None = None


# ------------------------------------------------------------------------------------------------
# argument parsing shared by the config commands


def _parser(prog: str, description: str, *, with_json: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"fleetwise {prog}", description=description, add_help=False)
    p.add_argument("overrides", nargs="*", help="Hydra overrides: group=option, key=value, +key=value")
    if with_json:
        p.add_argument(*JSON[0], **JSON[1])
    p.add_argument("--cfg", "-c", choices=["job", "hydra", "all"], help="print the composed config and exit")
    p.add_argument("--resolve", action="store_true", help="with --cfg: resolve interpolations")
    p.add_argument("--help", "-h", action="store_true", help="show groups, options and examples")
    p.add_argument(
        "--multirun",
        "-m",
        action="store_true",
        help="a sweep (key=a,b): one row per point, as train -m runs them",
    )
    return p


def run_config_command(name: str, command: Command, argv: list[str]) -> int:
    """The prologue of every config command: parse, --help, --cfg, the sweep's points, and (where
    the row asks for it) every point composed, validated and planned, every problem printed with
    exit 2; then the handler."""
    p = _parser(name, command.help, with_json=False)
    for flags, options in command.arguments or ():
        p.add_argument(*flags, **options)
    args = p.parse_intermixed_args(argv)
    as_json = getattr(args, "json", False)
    if args.help:
        return print_help(name)
    if args.cfg:
        return _print_cfg(args.overrides, args.cfg, args.resolve)
    points = _points(args.overrides, args.multirun)
    if isinstance(points, Problem):
        return _report_invalid([points], as_json)
    if command.checks is None:
        return command.handler(args, points)
    if name == "validate":
        told: set[tuple[str, str]] = set()  # each notice once per command, not once per sweep point
        checked = [_validate_contained(point, command.checks, told) for point in points]
    else:
        checked = [preflight(point, **command.checks) for point in points]
    if args.multirun:
        return _sweep_report(name, args, points, checked)
    if checked[0].problems:
        return _report_invalid(checked[0].problems, as_json)
    return command.handler(args, checked[0])


def _validate_contained(point: list[str], checks: dict, told: set[tuple[str, str]]) -> Preflight:
    """`validate` of a recipe from elsewhere: a `_target_` outside the recipe's project, fleetwise,
    torch and transformers is named in a notice and not imported (families/custom/targets.py)."""
    from fleetwise.config.compose import compose_partial, composing_once
    from fleetwise.families.custom.targets import foreign_targets, holding

    with composing_once():  # the preflight reuses this composition
        data, _ = compose_partial(point)
        foreign = foreign_targets({k: data.get(k) for k in ("model", "data")})
        err = Console(stderr=True, soft_wrap=True)
        for loc, target, where in [f for f in foreign if f[:2] not in told]:
            told.add((loc, target))
            module = str(where) if where is not None else "not found on the path"
            err.print(
                f"[yellow]notice[/]: {loc}={target} would import code from outside this recipe's project, "
                f"fleetwise, torch and transformers ({module}). A recipe is code, like a script: validate "
                "did not import it and skipped its checks; plan and train import and run it.",
                highlight=False,
            )
        with holding([target for _, target, _ in foreign]):
            pf = preflight(point, **checks)
    pf.held_back = tuple(target for _, target, _ in foreign)
    return pf


def _points(overrides: list[str], multirun: bool) -> list[list[str]] | Problem:
    """The points of `-m` (each a full override list), or the one point without it."""
    if not multirun:
        return [list(overrides)]
    from fleetwise.launcher.sweeps import sweep_points

    try:
        return sweep_points(overrides)
    except Exception as exc:  # noqa: BLE001 - bad sweep syntax is a config problem
        return Problem(
            "<overrides>", f"cannot parse the sweep: {exc}", "write key=a,b (see Hydra's sweep syntax)"
        )


def _labels(points: list[list[str]]) -> list[str]:
    """Per point of a sweep, the overrides that vary."""
    varying = [i for i in range(len(points[0])) if len({p[i] for p in points}) > 1] if points else []
    return [" ".join(p[i] for i in varying) or " ".join(p) for p in points]


def _sweep_report(name: str, args, points: list[list[str]], checked: list[Preflight]) -> int:
    """`validate -m` / `plan -m`: every point checked and planned like a single config; one row each
    (`--json`: a list, each entry what the single command prints plus `overrides`); exit 2 if any
    point is invalid."""
    validate_only = name == "validate"
    rows = list(zip(points, _labels(points), checked, strict=True))
    invalid = any(pf.problems for _, _, pf in rows)
    if args.json:
        out = []
        for point, _, pf in rows:
            if pf.problems:
                entry = {"valid": False, "errors": [p.to_dict() for p in pf.problems]}
            elif validate_only:
                entry = {"valid": True, "errors": []}
            else:
                entry = {**pf.plan.to_dict(), "remedies": [r.to_dict() for r in pf.remedies]}
            out.append({"overrides": point, **entry})
        print(json.dumps(strict_json(out), indent=2, allow_nan=False))
        return EXIT_INVALID if invalid else EXIT_OK
    from fleetwise.plan.render import gib, print_problems, seconds

    console = Console()
    console = Console(width=max(console.width, 140)) if not console.is_terminal else console
    table = Table(title=f"{'validate' if validate_only else 'plan'} -m: {len(rows)} points", box=None)
    for col in ("point", "valid", "mesh pp/dp/sh/mp", "memory/device", "fits", "planned step", "planned MFU"):
        table.add_column(col, no_wrap=col != "point")
    for _, label, pf in rows:
        if pf.plan is None:  # invalid, or valid with its model held back unimported (not planned)
            table.add_row(label, "[red]✗[/]" if pf.problems else "[green]✓[/] not imported", "", "", "", "", "")
            continue
        m, plan = pf.plan.mesh, pf.plan
        table.add_row(
            label,
            "[red]✗[/]" if pf.problems else "[green]✓[/]",
            f"{m['pp']}/{m['dp']}/{m['sharding']}/{m['mp']}",
            f"{gib(plan.memory_bytes['total'])} of {gib(plan.usable_memory_bytes or plan.device_memory_bytes)}",
            "yes" if plan.fits else "[red]no[/]",
            seconds(plan.step_time_s),
            f"{plan.mfu:.1%}",
        )
    console.print(table)
    for _, label, pf in rows:
        if pf.problems:
            Console(stderr=True).print(f"[bold]{label}[/]:", highlight=False)
            print_problems(Console(stderr=True), pf.problems)
    return EXIT_INVALID if invalid else EXIT_OK


def _print_cfg(overrides: list[str], which: str, resolve: bool) -> int:
    from omegaconf import OmegaConf, open_dict

    from fleetwise.config.compose import _compose

    try:
        cfg = _compose(overrides, hydra_cfg=which != "job")
    except Exception as exc:  # noqa: BLE001
        from fleetwise.config.compose import diagnose

        return _report_invalid(diagnose(overrides, exc)[0], as_json=False)
    if which == "hydra":
        cfg = cfg.hydra
    elif which == "job":
        from fleetwise.config.recipes import apply_strategy_choice

        with open_dict(cfg):
            cfg.pop("hydra", None)
        # the strategy section the job runs with: a `strategy=X` other than the recipe's replaces
        # the recipe's strategy keys (config/recipes.py), which Hydra's composition alone still shows
        cfg = OmegaConf.create(apply_strategy_choice(OmegaConf.to_container(cfg), overrides))
    print(OmegaConf.to_yaml(cfg, resolve=resolve and which == "job"), end="")
    return EXIT_OK


def _two_columns(rows) -> Table:
    """Name and text, the text wrapping under itself on a narrow terminal."""
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True, min_width=12)
    table.add_column()
    for name, text in rows:
        table.add_row(f"  {name}", Text(text))
    return table


def print_help(command: str | None = None) -> int:
    from fleetwise.config.paths import config_dir, group_options

    console = Console()
    console.print("[bold]fleetwise[/]: declarative distributed training for PyTorch\n")
    console.print("usage: fleetwise COMMAND [OVERRIDES…] [--json] [--cfg job] [--help]\n")
    console.print("[bold]commands[/]")
    console.print(_two_columns((name, command.help) for name, command in COMMANDS.items()))
    console.print("\n[bold]config groups[/] (choose one option each, e.g. strategy=hybrid)")
    groups = sorted(p.name for p in config_dir().iterdir() if p.is_dir())
    console.print(_two_columns((g, ", ".join(group_options(g))) for g in groups))
    console.print(
        "\n[bold]overrides[/] set any key: train.steps=50 strategy.pp_degree=4 hardware.nodes=16; "
        "+key=value adds a key; --cfg job prints the composed config.\n"
        "[bold]examples[/]\n"
        "  fleetwise plan recipe=gpt/gpt3_175b strategy=hybrid hardware=a100 hardware.nodes=128 "
        "strategy.mp_degree=8 strategy.pp_degree=16\n"
        "  fleetwise validate recipe=gpt/tiny strategy=hybrid strategy.pp_degree=2 strategy.mp_degree=2 --json",
        highlight=False,
    )
    return EXIT_OK


def strict_json(value):
    """JSON has no NaN or Infinity (json.dumps would write bare `NaN` tokens other parsers refuse):
    a non-finite number becomes null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _report_invalid(problems: list[Problem], as_json: bool) -> int:
    if as_json:
        print(json.dumps({"valid": False, "errors": [p.to_dict() for p in problems]}, indent=2))
    else:
        from fleetwise.plan.render import print_problems

        print_problems(Console(stderr=True), problems)
    return EXIT_INVALID


# ------------------------------------------------------------------------------------------------
# commands


def cmd_validate(args, pf: Preflight) -> int:
    """A valid config: one line with the job and its memory per device (--json: no errors)."""
    if args.json:
        out = {"valid": True, "errors": []}
        if pf.auto is not None:
            out["auto"] = pf.auto.to_dict()
        print(json.dumps(strict_json(out), indent=2))
    else:
        if pf.auto is not None:
            Console().print(f"strategy=auto chose: {pf.auto.override_text}", highlight=False, soft_wrap=True)
        from fleetwise.plan.render import describe_job, gib

        plan = pf.plan
        if plan is None:  # the model was held back unimported: neither checked nor planned
            cfg = pf.cfg
            job = f"{cfg.recipe} · {cfg.strategy.name} · {cfg.hardware.name} × {cfg.hardware.world_size}"
            what = f"not planned: your model was not imported ({', '.join(pf.held_back)})"
        else:
            job = describe_job(pf.cfg, plan)
            what = f"memory/device {gib(plan.memory_bytes['total'])} of {gib(plan.device_memory_bytes)}"
        Console().print(f"[bold green]✓ valid[/]: {job} · {what}", highlight=False)
    return EXIT_OK


def cmd_plan(args, pf: Preflight) -> int:
    """The plan of a valid config: mesh, memory, FLOPs, bubble, step time (and remedies)."""
    if args.json:
        out = pf.plan.to_dict()
        out["remedies"] = [r.to_dict() for r in pf.remedies]
        if pf.auto is not None:
            out["auto"] = pf.auto.to_dict()
        print(json.dumps(strict_json(out), indent=2, allow_nan=False))
    else:
        from fleetwise.plan.render import print_plan, print_search

        if pf.auto is not None:
            print_search(Console(), pf.auto.result, pf.cfg.auto.top_k, pf.auto.override_text)

        print_plan(Console(), pf.cfg, pf.plan, pf.remedies)
    return EXIT_OK


def cmd_train(args, points: list[list[str]]) -> int:
    """Validate every sweep point (exit 2, nothing started), then run the job(s) through Hydra."""
    from fleetwise.launcher import sweeps

    problems, checked = sweeps.check_points(points)
    if problems:
        return _report_invalid(problems, as_json=False)
    try:
        return sweeps.run_hydra(args.overrides, args.multirun, checked)
    except KeyboardInterrupt as exc:  # the job was stopped and its run marked KILLED
        from fleetwise.runtime.lifeline import Stopped

        why = exc.reason if isinstance(exc, Stopped) else "interrupted by the user (Ctrl-C)"
        Console(stderr=True).print(f"[bold red]✗ training stopped[/]: {why}", highlight=False)
        return 128 + (exc.signum if isinstance(exc, Stopped) else signal.SIGINT)


def cmd_dryrun(argv: list[str]) -> int:
    """Validate like `train` (exit 2, nothing started), then run the selected ranks' real runtime
    on fake tensors and the fake process group (fleetwise.dryrun); planner figures beside them."""
    p = _parser("dryrun", cmd_dryrun.__doc__)
    p.add_argument(
        "--ranks", default="roles", help="'roles' (one per distinct role), 'all', or e.g. 0,7,8-11"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=2,
        help="optimizer steps per rank, the last reported (a sampled rank runs 3: see --exact)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="simulate every micro-batch and every block of a step (default: two small counts of each, "
        "scaled, where exact and cheaper)",
    )
    args = p.parse_intermixed_args(argv)
    if args.help:
        return print_help("dryrun")
    if args.cfg:
        return _print_cfg(args.overrides, args.cfg, args.resolve)
    from fleetwise.dryrun import parent as dryrun

    # a dry run is how one checks a job that may not fit: the memory rule only warns here; what it
    # cannot simulate (strategy=ps, train.compile) is refused by config/rules/dryrun.py
    pf = preflight(args.overrides, launching=True, dryrun=True, enforce_memory=False)
    problems = list(pf.problems)
    if args.steps < 1:
        problems.append(Problem("--steps", f"--steps {args.steps}: at least one step", "use --steps 2"))
    ranks: list[int] = []
    if pf.cfg is not None and not problems:
        from fleetwise.config.layout import Layout

        layout = Layout.of(pf.cfg)
        try:
            ranks = (
                dryrun.default_ranks(layout, dryrun.stand_ins(pf.cfg))
                if args.ranks == "roles"
                else dryrun.parse_ranks(args.ranks, layout.world_size)
            )
        except ValueError as err:
            problems.append(
                Problem(
                    "--ranks",
                    f"--ranks {args.ranks}: {err}",
                    "give ranks like 0,7,8-11, or 'all', or 'roles'",
                )
            )
    if problems:
        return _report_invalid(problems, args.json)
    err_console = Console(stderr=True)
    started = time.perf_counter()
    err_console.print(
        f"dryrun: {len(ranks)} of {layout.world_size} ranks ({', '.join(map(str, ranks))}), {args.steps} steps each",
        highlight=False,
    )
    try:
        reports = dryrun.simulate(
            pf.cfg,
            pf.plan,
            args.overrides,
            ranks,
            args.steps,
            progress=lambda m: err_console.print(f"dryrun: {m}", highlight=False),
            exact=args.exact,
        )
    except RuntimeError as err:
        err_console.print(f"[bold red]✗ dry run failed[/]: {err}", highlight=False)
        return EXIT_FAIL
    for rep in reports:
        rep["planner"] = dryrun.compare(pf.plan, rep)
    out = {"world_size": layout.world_size, "mesh": layout.as_dict(), "steps": args.steps, "ranks": reports}
    out["time_s"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_dryrun(out)
    return EXIT_OK


def _print_dryrun(out: dict) -> None:
    def pct(x) -> str:
        return "n/a" if x is None else f"{x:+.1%}"

    table = Table(
        title=f"dry run: world size {out['world_size']}, mesh {out['mesh']} ({out['time_s']:.0f} s)"
    )
    for col in (
        "rank",
        "pp/sh/mp/dp",
        "peak GiB",
        "planner",
        "Δ",
        "TFLOP/step",
        "planner",
        "Δ",
        "comm MiB by dim",
    ):
        table.add_column(col, justify="right")
    for r in out["ranks"]:
        c, cmp = r["coords"], r["planner"]
        mem, fl = cmp["memory_bytes"], cmp["flops_per_step"]
        comm = " ".join(
            f"{d} {v['dryrun'] / 2**20:,.1f} ({pct(v['rel'])})"
            for d, v in cmp["comm_bytes_per_step"].items()
            if v["dryrun"] or v["planner"]
        )
        table.add_row(
            str(r["rank"]),
            f"{c['pp']}/{c['sharding']}/{c['mp']}/{c['dp']}",
            f"{mem['dryrun'] / 2**30:.3f}",
            f"{mem['planner'] / 2**30:.3f}",
            pct(mem["rel"]),
            f"{fl['dryrun'] / 1e12:.3f}",
            f"{fl['planner'] / 1e12:.3f}",
            pct(fl["rel"]),
            comm,
        )
    Console().print(table)
    for r in out["ranks"]:
        host = r["planner"].get("host_memory_bytes")
        if host:
            Console().print(
                f"rank {r['rank']}: offloaded state in host memory, peak {host['dryrun'] / 2**30:.3f} GiB "
                f"(planner {host['planner'] / 2**30:.3f} GiB, {pct(host['rel'])}); not in the device peak"
            )
    Console().print(
        "Δ: planner relative to the dry run; comm: bytes this rank sends per step (ring algorithms)"
    )


def cmd_checkpoint(argv: list[str]) -> int:
    """`fleetwise checkpoint export RUN_DIR|CHECKPOINT [--out FILE] [--format torch|hf]`: one
    consolidated state dict, or a Hugging Face model directory."""
    p = argparse.ArgumentParser(prog="fleetwise checkpoint", description=cmd_checkpoint.__doc__)
    sub = p.add_subparsers(dest="action", required=True)
    ex = sub.add_parser("export", help="write the model of a sharded checkpoint as one torch.save file")
    ex.add_argument(
        "source", help="a run directory (its newest complete checkpoint) or a checkpoint directory"
    )
    ex.add_argument("--out", help="output file (default: <checkpoint>.pt); with --format hf, a directory")
    ex.add_argument(
        "--format",
        choices=("torch", "hf"),
        default="torch",
        help="torch: one torch.save state dict; hf: a Hugging Face model directory (config.json, "
        "safetensors shards, index), for Llama-family models",
    )
    ex.add_argument(
        "--dtype", choices=("fp32", "bf16", "fp16"), help="with --format hf: the weights' dtype (default: as trained)"
    )
    ex.add_argument(
        "--log-model",
        action="store_true",
        help="also log it as an MLflow model (weights, signature, config, eval/loss) to the job's run",
    )
    ex.add_argument("--register", metavar="NAME", help="with --log-model: register a version under NAME")
    args = p.parse_args(argv)
    from pathlib import Path

    from fleetwise.runtime.checkpoint_files import META, complete_checkpoints

    source = Path(args.source)
    ckpt = source if (source / META).exists() else (complete_checkpoints(source) or [None])[-1]
    console = Console(stderr=True)
    if ckpt is None:
        console.print(f"[bold red]✗[/] no complete checkpoint in {source}", highlight=False)
        return EXIT_INVALID
    if args.format == "hf":
        return _export_hf(ckpt, args, console)
    out = Path(args.out) if args.out else ckpt.with_suffix(".pt")
    from fleetwise.runtime.checkpoint import CheckpointRefused, export

    try:
        export(ckpt, out)
    except CheckpointRefused as exc:
        console.print(f"[bold red]✗[/] {ckpt}: {exc}", highlight=False)
        return EXIT_INVALID
    console.print(
        f"[green]✓[/] {ckpt} -> {out} (model state dict: load with model.load_state_dict)", highlight=False
    )
    return (
        _log_exported_model(ckpt, args.register, Console(stderr=True, soft_wrap=True))
        if args.log_model
        else EXIT_OK
    )


def _export_hf(ckpt, args, console: Console) -> int:
    """`checkpoint export --format hf --out DIR`: a Hugging Face model directory."""
    from pathlib import Path

    from fleetwise.families.llama.weights import WeightsError
    from fleetwise.runtime.checkpoint import CheckpointRefused, export_hf

    if not args.out:
        console.print("[bold red]✗[/] --format hf needs --out DIR (the model directory to write)")
        return EXIT_INVALID
    try:
        files = export_hf(ckpt, Path(args.out), args.dtype)
    except (WeightsError, CheckpointRefused) as exc:
        console.print(f"[bold red]✗[/] {exc}", highlight=False)
        return EXIT_INVALID
    size = sum(f.stat().st_size for f in files)
    console.print(
        f"[green]✓[/] {ckpt} -> {args.out} ({len(files) - 2} safetensors shard(s), index, config.json; "
        f"{size / 2**20:.1f} MiB): load with transformers.AutoModelForCausalLM.from_pretrained",
        highlight=False,
    )
    return EXIT_OK


def _log_exported_model(ckpt, register: str | None, console: Console) -> int:
    """Log a checkpoint's model to the MLflow run of the job that wrote it (its tracking.json)."""
    from fleetwise.tracking.spool import load_state

    run_dir = ckpt.parent.parent
    state = load_state(run_dir)
    if state is None or state.run_id is None:
        console.print(
            f"[bold red]✗[/] {run_dir} has no MLflow run (no run id in its tracking.json). fix: log the "
            "job with tracking.enabled=true, or `fleetwise sync` it if MLflow was down",
            highlight=False,
        )
        return EXIT_INVALID
    from fleetwise.tracking.models import log_model
    from fleetwise.tracking.store import describe

    try:
        logged = log_model(state.tracking_uri, state.run_id, ckpt, register_as=register)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        console.print(f"[bold red]✗ the model was not logged:[/] {describe(exc)}", highlight=False)
        return EXIT_FAIL
    note = f", eval/loss {logged['eval_loss']:.4f}" if "eval_loss" in logged else ""
    reg = f", registered as {register} v{logged['version']}" if "version" in logged else ""
    console.print(
        f"[green]✓[/] logged to run {state.run_id}: {logged['model_uri']} ({logged['kind']}{note}{reg})",
        highlight=False,
    )
    return EXIT_OK


def cmd_calibrate(argv: list[str]) -> int:
    """`fleetwise calibrate [--out PATH] [--name NAME] [--json] [--no-comm]`: measure peak matmul,
    per-op overhead and all-reduce speed here, and write a hardware profile (hardware=NAME)."""
    from fleetwise.calibrate.command import main as calibrate

    return calibrate(argv)


def cmd_tokenize(argv: list[str]) -> int:
    """`fleetwise tokenize TEXT… --out FILE.bin`: a byte-level token file for data=token_file."""
    from fleetwise.data.tokenize_text import main as tokenize

    return tokenize(argv)


COMMANDS: dict[str, Command] = {
    "validate": Command(
        cmd_validate,
        "check a config: every problem with its path, values and fix (exit 2; -m a sweep)",
        arguments=(JSON,),
        checks={"enforce_memory": True},
    ),
    "plan": Command(
        cmd_plan,
        "mesh, memory per device, FLOPs, communication, bubble, step time, MFU (-m a sweep)",
        arguments=(JSON,),
        checks={"enforce_memory": False},
    ),
    "train": Command(
        cmd_train, "run the job on torch.distributed (torchrun; -m for Hydra sweeps)", arguments=()
    ),
    "dryrun": Command(
        cmd_dryrun, "the real runtime of any world size on fake tensors: memory, FLOPs, comm per rank"
    ),
    "calibrate": Command(
        cmd_calibrate, "measure this machine (matmul, op overhead, all-reduce): hardware=local"
    ),
    "checkpoint": Command(
        cmd_checkpoint,
        "checkpoint export RUN_DIR [--log-model] [--format hf --out DIR]: one consolidated state dict (and an MLflow model), or a Hugging Face model directory",
    ),
    "tokenize": Command(
        cmd_tokenize, "text files -> a byte-level token file for data=token_file (vocab 257)"
    ),
    "ui": Command(tracking.cmd_ui, "browse tracked runs in the MLflow UI (127.0.0.1:5000 by default)"),
    "compare": Command(
        tracking.cmd_compare, "table + PNG of runs: throughput, MFU, peak vs predicted memory"
    ),
    "sync": Command(
        tracking.cmd_sync, "deliver metrics that did not reach MLflow (server down during a run)"
    ),
}


def take_config_dirs(argv: list[str]) -> list[str]:
    """`--config-dir DIR` / `--config-dir=DIR` / `-cd DIR` (Hydra's flag, any command, repeatable):
    the trees are overlaid on conf/ (config/paths.py) through the environment, which the ranks and a
    sweep's jobs inherit. Returns argv without them."""
    import os

    from fleetwise.config.paths import EXTRA_DIRS_ENV

    rest, dirs = [], []
    it = iter(argv)
    for a in it:
        if a in ("--config-dir", "-cd"):
            dirs.append(next(it, ""))
        elif a.startswith("--config-dir="):
            dirs.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    if dirs:
        found = [os.path.abspath(d) for d in dirs if d]
        os.environ[EXTRA_DIRS_ENV] = os.pathsep.join([*found, *filter(None, os.environ.get(EXTRA_DIRS_ENV, "").split(os.pathsep))])
    return rest


def main(argv: list[str] | None = None) -> int:
    from fleetwise.tracking.store import adopt_uri_credentials

    adopt_uri_credentials()  # a tracking URI's user:password@ leaves the URI before anything runs
    argv = take_config_dirs(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help", "help"):
        return print_help()
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        Console(stderr=True).print(
            f"[bold red]✗ unknown command {command!r}.{did_you_mean(command, COMMANDS)}[/] "
            f"Commands: {', '.join(COMMANDS)}",
            highlight=False,
        )
        return EXIT_INVALID
    row = COMMANDS[command]
    return row.handler(rest) if row.arguments is None else run_config_command(command, row, rest)


if __name__ == "__main__":
    sys.exit(main())
