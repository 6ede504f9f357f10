"""Human-readable output of problems and plans (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fleetwise.config.problems import Problem
from fleetwise.config.run import RunConfig
from fleetwise.plan.records import COMPUTE_PARTS, Plan, step_parts
from fleetwise.plan.remedies import Remedy

GIB = 1024**3


def gib(n: float) -> str:
    """Bytes with a binary unit that keeps 3 significant digits (12.3 MiB, 39.4 GiB)."""
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            value = n / size
            return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
    return f"{n:.0f} B"


def count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def step_time_sum(time_s: dict[str, float]) -> str:
    """The planned step as the sum it is: the slowest stage's compute (its GEMMs, host ops,
    elementwise ops and gradient accumulation), the bubble, the communication left exposed (each
    mesh dimension's, less what hides behind compute), the optimizer step and offload's copies."""
    t = dict(time_s)
    terms = []
    if "compute" in t:
        inner = {"GEMMs": step_parts(time_s)["gemm"]} | {k: t.pop(k, 0.0) for k in COMPUTE_PARTS}
        shown = [f"{k.replace('_', ' ')} {seconds(v)}" for k, v in inner.items() if v > 0]
        compute = t.pop("compute")
        terms.append(f"compute {seconds(compute)}" + (f" ({' + '.join(shown)})" if len(shown) > 1 else ""))
    if t.get("bubble"):
        terms.append(f"bubble {seconds(t.pop('bubble'))}")
    comm = {
        k.removeprefix("comm_"): t.pop(k) for k in list(t) if k.startswith("comm_") and k != "comm_hidden"
    }
    hidden = t.pop("comm_hidden", 0.0)
    if any(comm.values()):
        sent = " + ".join(f"{k} {seconds(v)}" for k, v in comm.items() if v)
        if hidden:
            sent += f" − {seconds(hidden)} hidden behind compute"
        terms.append(f"comm ({sent})")
    terms += [f"{k.replace('_', ' ')} {seconds(v)}" for k, v in t.items() if v]
    return " + ".join(terms)


PART_LABELS = {
    "params": "params",
    "grads": "grads",
    "optimizer": "optimizer",
    "activations": "activations",
    "inputs": "inputs",
    "pipeline_buffers": "pipeline buffers",
    "step_temporaries": "optimizer-step temporaries",
    "server_shard": "server shard (params + optimizer state)",
}


def memory_parts(plan: Plan) -> str:
    """What the worst device holds at its peak, as parts that add up to the total, and the phase:
    'params 73.3 GiB + … + optimizer-step temporaries 48.8 GiB (peak: optimizer step)'."""
    peak = plan.memory_peak or {}
    parts = peak.get("parts") or {
        k: v for k, v in plan.memory_bytes.items() if k in PART_LABELS and v and k != "total"
    }
    text = " + ".join(f"{PART_LABELS.get(k, k)} {gib(v)}" for k, v in parts.items())
    return f"{text} (peak: {peak['phase']})" if peak.get("phase") else text


def print_problems(console: Console, problems: list[Problem]) -> None:
    noun = "problem" if len(problems) == 1 else "problems"
    console.print(f"[bold red]✗ invalid config: {len(problems)} {noun}[/]")
    for p in problems:  # values come from users and logs: escape rich's [markup]
        console.print(f"  [bold]{escape(p.loc)}[/]: {escape(p.msg)}", highlight=False, soft_wrap=True)
        console.print(f"    [green]fix:[/] {escape(p.hint)}", highlight=False, soft_wrap=True)


def mesh_text(m: dict[str, int]) -> str:
    """The degrees as the world-size rule multiplies them (cp only in a plan with context parallelism)."""
    cp = f" × cp {m['cp']}" if m.get("cp", 1) > 1 else ""
    return f"pp {m['pp']} × dp {m['dp']} × sharding {m['sharding']}{cp} × mp {m['mp']}"


def describe_job(cfg: RunConfig, plan: Plan) -> str:
    layout = "" if cfg.strategy.name == "ps" else f" ({mesh_text(plan.mesh)})"
    return f"{cfg.recipe} · {cfg.strategy.name}{layout} · {cfg.hardware.name} × {plan.world_size}"


def print_plan(console: Console, cfg: RunConfig, plan: Plan, remedies: list[Remedy]) -> None:
    console = Console(width=max(console.width, 120)) if not console.is_terminal else console
    console.print(f"[bold]fleetwise plan[/] · {describe_job(cfg, plan)}", highlight=False)
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column()
    _job_rows(t, cfg, plan)
    _memory_rows(t, plan)
    _time_rows(t, cfg, plan)
    for note in plan.notes:
        t.add_row("note", note)
    console.print(t)
    if not plan.fits and remedies:
        console.print("[bold]cheapest remedies:[/]")
        for r in remedies:
            console.print(f"  {r.describe()}", highlight=False)


def _job_rows(t: Table, cfg: RunConfig, plan: Plan) -> None:
    """The mesh (or the parameter server's roles), the batch and the parameters."""
    b = plan.batch
    m = plan.mesh
    if plan.ps is None:
        t.add_row(
            "mesh",
            f"{mesh_text(m)} = {plan.world_size} ranks · engine {plan.engine} · {plan.precision}",
        )
        t.add_row(
            "batch",
            f"global {b['global_batch_size']} = micro {b['micro_batch_size']} × accumulate "
            f"{b['accumulate_steps']} × dp {m['dp']} × sharding {m['sharding']}",
        )
    else:
        ps = plan.ps
        t.add_row(
            "roles", f"{ps['num_servers']} servers + {ps['num_trainers']} trainers · {cfg.strategy.mode}"
        )
        t.add_row(
            "batch",
            f"global {b['global_batch_size']} = micro {b['micro_batch_size']} × accumulate "
            f"{b['accumulate_steps']} × trainers {ps['num_trainers']}",
        )
    active = f" ({count(plan.active_params)} active a token)" if plan.active_params is not None else ""
    t.add_row("params", count(plan.params) + active)


def _memory_rows(t: Table, plan: Plan) -> None:
    """The worst device's memory, its parts, and where else memory peaks (stages, servers)."""
    mem = plan.memory_bytes
    verdict = "[green]fits[/]" if plan.fits else "[bold red]does NOT fit[/]"
    usable = (
        f" (usable {gib(plan.usable_memory_bytes)} after {gib(plan.device_overhead_bytes)} context/NCCL/cuBLAS/"
        "fragmentation)"
        if plan.device_overhead_bytes
        else ""
    )
    t.add_row("memory/device", f"{gib(mem['total'])} of {gib(plan.device_memory_bytes)}{usable} · {verdict}")
    t.add_row("", f"= {memory_parts(plan)}")
    at_peak = (plan.memory_peak or {}).get("parts", {})
    elsewhere = {
        k: mem[k]
        for k in ("activations", "inputs", "pipeline_buffers")
        if mem.get(k) and at_peak and at_peak.get(k) != mem[k]
    }
    if plan.ps is not None:
        t.add_row(
            "", f"a trainer holds {gib(plan.ps['trainer_bytes'])} (params, grads, pulled rows, activations)"
        )
    elif elsewhere:
        t.add_row(
            "",
            "at other times: "
            + " · ".join(f"{PART_LABELS[k]} {gib(v)}" for k, v in elsewhere.items())
            + " (forward/backward)",
        )
    if len(plan.stages) > 1:
        worst = max(plan.stages, key=lambda s: s["memory_total_bytes"])
        t.add_row(
            "",
            f"worst pipeline rank {worst['rank']} ({worst['layers']} layers); per rank: "
            + ", ".join(gib(s["memory_total_bytes"]) for s in plan.stages[:8])
            + (" …" if len(plan.stages) > 8 else ""),
        )
    if plan.ps is not None:
        ps = plan.ps
        t.add_row(
            "servers",
            f"{gib(ps['server_bytes'])} on the fullest server (params + optimizer state) · "
            f"sparse tables {gib(ps['sparse_table_bytes'])} "
            f"({count(ps['sparse_rows'])} rows)",
        )
        t.add_row(
            "pull/step",
            f"{count(ps['rows_pulled_per_step'])} rows = "
            f"{gib(ps['sparse_bytes_pulled_per_step'])} of the sparse tables per trainer (de-duplicated prefetch)",
        )


def _time_rows(t: Table, cfg: RunConfig, plan: Plan) -> None:
    """FLOPs, bubble, traffic, the step time and the throughput."""
    t.add_row("flops/step", f"{plan.flops_per_step:.3e}")
    if plan.mesh["pp"] > 1:
        t.add_row("bubble", f"{plan.bubble_fraction:.1%} ({cfg.strategy.schedule})")
    comm = " · ".join(f"{k} {gib(v)}" for k, v in plan.comm_bytes_per_step.items() if v)
    if comm:
        t.add_row("comm/step", comm + " (bytes sent per device)")
    t.add_row("step time", f"{seconds(plan.step_time_s)} planned = {step_time_sum(plan.time_s)}")
    rate = f"{plan.samples_per_s:,.1f} samples/s"
    if plan.tokens_per_s:
        rate += f" · {plan.tokens_per_s:,.0f} tokens/s"
    t.add_row("throughput", f"{rate} · MFU {plan.mfu:.1%} (planned)")
    if cfg.hardware.device_type == "cuda":
        t.add_row(
            "assumed",
            f"step time and MFU follow the {cfg.hardware.name} profile's assumed GEMM efficiency curve and "
            "per-op costs (published figures, not measured on your GPUs: `fleetwise calibrate` on one "
            "writes measured ones)",
        )


def print_search(console: Console, result, top_k: int, override: str) -> None:
    """strategy=auto: the top layouts (plan/search.py SearchResult) and the winner's override."""
    console = (
        Console(width=max(console.width, 160), stderr=console.stderr) if not console.is_terminal else console
    )
    console.print(
        f"[bold]strategy=auto[/] · {result.legal} legal layouts checked, {len(result.ranked)} fit in "
        f"{gib(result.budget_bytes)} per device (usable memory less headroom) · searched in "
        f"{result.elapsed_s:.2f} s",
        highlight=False,
    )
    t = Table(box=None, pad_edge=False)
    for col in ("#", "layout", "memory/device", "planned step", "planned MFU", "bubble", "vs #1"):
        t.add_column(col, no_wrap=col != "vs #1")
    for i, c in enumerate(result.ranked[:top_k], 1):
        p = c.plan
        t.add_row(
            str(i),
            escape(c.layout_text()),
            gib(c.memory),
            seconds(p.step_time_s),
            f"{p.mfu:.1%}",
            f"{p.bubble_fraction:.1%}",
            escape(c.why),
        )
    console.print(t)
    for summary in result.by_cp.values():  # context parallelism searched: why less cp is out
        console.print(escape(summary.text(result.budget_bytes)), highlight=False, soft_wrap=True)
    console.print(f"[bold green]winner[/]: {escape(override)}", highlight=False, soft_wrap=True)
