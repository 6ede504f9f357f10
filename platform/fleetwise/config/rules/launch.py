"""Rules of the `launch`, `fault` and `checkpoint` sections, and the elastic resize of a config
(validated by config/validate.py `elastic_config`)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from fleetwise.config.problems import Problem
from fleetwise.config.rules.context import Context, rule
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import CollectiveStrategy

_NNODES = re.compile(r"^(\d+)(?::(\d+))?$")


@rule
def launch_topology(ctx: Context) -> Iterator[Problem]:
    launch, hw = ctx.cfg.launch, ctx.cfg.hardware
    if ctx.dryrun:  # a dry run starts no rendezvous
        return
    match = _NNODES.match(launch.nnodes)
    if not match:
        yield Problem(
            "launch.nnodes", f"nnodes={launch.nnodes!r} is not N or MIN:MAX", "e.g. launch.nnodes=2"
        )
        return
    lo = int(match.group(1))
    hi = int(match.group(2) or lo)
    if not 1 <= lo <= hi:
        yield Problem(
            "launch.nnodes", f"nnodes={launch.nnodes}: need 1 <= MIN <= MAX", "e.g. launch.nnodes=1:2"
        )
    if hi != hw.nodes:
        yield Problem(
            "launch.nnodes",
            f"launch.nnodes={launch.nnodes} but hardware.nodes={hw.nodes}",
            f"set hardware.nodes={hi} (the layout is planned for the largest node count)",
        )
    if launch.node_rank >= hi:
        yield Problem(
            "launch.node_rank",
            f"node_rank={launch.node_rank} but only {hi} nodes",
            f"use a node_rank in 0..{hi - 1}",
        )
    host, _, port = launch.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        yield Problem(
            "launch.rdzv_endpoint",
            f"rdzv_endpoint={launch.rdzv_endpoint!r} is not host:port",
            "e.g. launch.rdzv_endpoint=10.0.0.1:29500",
        )
    elif hi > 1 and int(port) == 0 and ctx.launching:
        yield Problem(
            "launch.rdzv_endpoint",
            "a multi-node job needs a fixed rendezvous port (got 0)",
            "set launch.rdzv_endpoint=<node0-host>:29500 on every node",
        )


def node_range(nnodes: str) -> tuple[int, int]:
    lo, _, hi = nnodes.partition(":")
    return int(lo), int(hi or lo)


@rule
def elastic_nodes(ctx: Context) -> Iterator[Problem]:
    """Elastic jobs (launch.nnodes=MIN:MAX) grow and shrink the data-parallel dimension: every node
    count in the range must still give a valid layout and batch split."""
    s, cfg = ctx.collective, ctx.cfg
    if ctx.dryrun or not _NNODES.match(cfg.launch.nnodes):
        return
    lo, hi = node_range(cfg.launch.nnodes)
    if lo == hi:
        return
    if s is None:
        yield Problem(
            "launch.nnodes",
            "elastic node counts are for collective strategies, not ps",
            f"set launch.nnodes={hi}",
        )
        return
    if ctx.layout is None or lo < 1 or lo > hi:
        return
    for n in range(lo, hi + 1):
        problems = elastic_problems(ctx.check(elastic_candidate(cfg, n)))  # the whole validation
        if problems:
            yield Problem(
                "launch.nnodes",
                f"with {n} node(s): {problems[0].msg}",
                "choose degrees and a global batch that every node count in the range divides "
                "(only dp_degree changes with the node count)",
            )
            return


_ELASTIC_IGNORES = ("launch.nnodes", "launch.node_rank")


def elastic_candidate(cfg: RunConfig, nodes: int) -> RunConfig:
    """The config of an elastic job running on `nodes` nodes, before validation: data parallelism
    absorbs the change (pp, sharding and mp stay as planned), accumulation is derived again
    (config/validate.py `elastic_config` validates and resolves it)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    hardware = cfg.hardware.model_copy(update={"nodes": nodes})
    strategy = s.model_copy(update={"dp_degree": "auto"})
    train = cfg.train.model_copy(update={"accumulate_steps": None})
    return cfg.model_copy(
        update={
            "hardware": hardware,
            "strategy": strategy,
            "train": train,
            "launch": cfg.launch.model_copy(update={"nnodes": str(hardware.nodes)}),
        }
    )


def elastic_problems(problems: list[Problem]) -> list[Problem]:
    """The problems of an elastic candidate that count. Not problems of the smaller world: the node
    ranks torch's rendezvous hands out (node_rank is the static launch's), and a test hook aimed at
    a rank that this node count does not have."""
    return [p for p in problems if p.loc not in _ELASTIC_IGNORES and not p.loc.startswith("fault.")]


@rule
def fault_hooks(ctx: Context) -> Iterator[Problem]:
    f = ctx.cfg.fault
    ws = (
        ctx.cfg.hardware.world_size
        if ctx.collective
        else ctx.cfg.strategy.num_servers + ctx.cfg.strategy.num_trainers
    )
    if f.kill_rank is not None and f.kill_rank >= ws:
        yield Problem(
            "fault.kill_rank", f"kill_rank={f.kill_rank} but world_size={ws}", f"use a rank in 0..{ws - 1}"
        )
    if (f.kill_rank is None) != (f.at_step is None):
        yield Problem(
            "fault.at_step", "fault.kill_rank and fault.at_step go together", "set both, or neither"
        )
    if f.at_step is not None and f.at_step > ctx.cfg.train.steps:
        yield Problem(
            "fault.at_step",
            f"at_step={f.at_step} > train.steps={ctx.cfg.train.steps}",
            "choose a step the run reaches",
        )


@rule
def checkpoint_options(ctx: Context) -> Iterator[Problem]:
    c = ctx.cfg.checkpoint
    if c.interval and not c.enabled:
        yield Problem(
            "checkpoint.interval",
            f"interval={c.interval} but checkpoint.enabled=false",
            "set checkpoint.enabled=true",
        )
    if c.resume == "auto" and not ctx.cfg.run.dir:
        yield Problem(
            "checkpoint.resume",
            "resume=auto continues a run directory, but run.dir is not set",
            "set run.dir=<the directory of the job to continue>",
        )
    if c.resume not in ("none", "auto") and not Path(c.resume).exists():
        yield Problem(
            "checkpoint.resume",
            f"checkpoint {c.resume!r} does not exist",
            "give an existing checkpoint directory, or checkpoint.resume=auto",
        )
    elif c.resume not in ("none", "auto") and not Path(c.resume).is_dir():
        yield Problem(
            "checkpoint.resume",
            f"{c.resume!r} is a file, not a checkpoint directory",
            "give a checkpoint directory (run_dir/checkpoints/step_N), or checkpoint.resume=auto",
        )
