"""The memory of a layout's pipeline ranks: one rank's peak from its terms (`pipeline_rank_memory`),
which ranks can hold the most (`memory_ranks`), ranks alike worked out once (`memory_of`), and the
worst device (`worst_of`), which a layout search asks of every candidate before timing it.
"""

from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple

from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import CollectiveStrategy
from fleetwise.plan.chunks import RankRole, local_chunks, rank_role, rank_roles
from fleetwise.plan.job import Job
from fleetwise.plan.memory.activations import input_bytes, rank_activations, total_activations
from fleetwise.plan.memory.buffers import pipeline_memory
from fleetwise.plan.memory.context import rank_context
from fleetwise.plan.memory.phases import memory_phases, peak_phase
from fleetwise.plan.memory.states import model_states, optimizer_step
from fleetwise.plan.pipeline import PipelineSchedule, chunks_in_flight, weight_steps_waiting
from fleetwise.plan.records import Memory
from fleetwise.plan.units import Unit


class RankPeak(NamedTuple):
    memory: Memory  # the rank's peak memory
    params: float  # its parameters (after the mp split, before sharding)


RankMemory = dict[int, RankPeak]  # pipeline rank -> its peak


def pipeline_rank_memory(
    cfg: RunConfig, layout: Layout, chunks: list[list[Unit]], ranks: list[int], rank: int, n: int
) -> RankPeak:
    """Peak memory of pipeline rank `rank` and its parameter count (after mp split, before sharding)."""
    ctx = rank_context(cfg, layout, chunks, ranks, rank, n)
    states = model_states(ctx)
    acts = rank_activations(ctx)
    pipe = pipeline_memory(ctx, acts)
    step = optimizer_step(ctx, states)
    mem = Memory(
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        activations=total_activations(ctx, acts),
        inputs=input_bytes(ctx),
        pipeline_buffers=pipe.during,
        step_temporaries=step.temporaries,
        host=step.host,
    )
    phase = peak_phase(memory_phases(ctx, states, acts, pipe, mem, step))
    mem.total = sum(phase.parts.values())
    mem.peak = {"phase": phase.name, "parts": {k: v for k, v in phase.parts.items() if v}}
    return RankPeak(mem, ctx.p)


def rank_memory(cfg: RunConfig, stop_above: float = math.inf) -> RankMemory:
    """The memory of the pipeline ranks that can hold the most (`memory_ranks`), without timing
    the step: what a layout search asks first, to drop layouts that do not fit before planning
    them. `make_plan(cfg, memory=...)` takes it, so that a layout that fits is not worked out twice.
    `stop_above`: return as soon as one rank needs more (then only the ranks worked out so far,
    which a search that only drops the layout needs no more of; not for `make_plan`)."""
    job = Job.of(cfg)
    layout, chunks, ranks, n = job.layout, job.chunks, job.ranks, job.n
    which = memory_ranks(job.strategy, layout, chunks, ranks, n)
    every = rank_roles(chunks, ranks, layout.pp)
    return memory_of(cfg, layout, chunks, ranks, n, which, roles=every, stop_above=stop_above)


def worst_of(memory: RankMemory) -> float:
    """Bytes the worst device needs (the plan's memory_bytes["total"])."""
    return max(mem.total for mem, _ in memory.values())


def worst_memory(cfg: RunConfig) -> float:
    """Bytes the worst device needs (the plan's memory_bytes["total"]) without timing the step."""
    return worst_of(rank_memory(cfg))


class MemoryRole(NamedTuple):
    """What a pipeline rank's memory depends on beyond its config: ranks with equal ones hold the same."""

    role: RankRole  # its chunks' units and neighbours (chunks.rank_role)
    in_flight: tuple[int, ...]  # micro-batches in flight per local chunk
    neighbours_here: tuple[tuple[bool, bool], ...]  # per local chunk: the previous, the next on this rank
    waiting: tuple[tuple[int, int], ...]  # interleaved zero bubble: waiting for a weight step
    # gradient receive sets (recv_buffer_sets): interleaved zero bubble r + 1, ZB-V r + 2 (and r)
    izb_gradient_sets: int
    zbv_gradient_sets: int


def memory_of(
    cfg: RunConfig,
    layout: Layout,
    chunks: list[list[Unit]],
    ranks: list[int],
    n: int,
    which: list[int],
    known: RankMemory | None = None,
    roles: list[RankRole] | None = None,
    stop_above: float = math.inf,
) -> RankMemory:
    """`pipeline_rank_memory` of the pipeline ranks `which` (those in `known` taken from it), worked
    out once per memory role: ranks in the same role (`MemoryRole`) hold the same (the inner ranks
    of a deep interleaved pipeline; of a 1F1B one while the micro-batches are fewer than the stages)."""
    out: RankMemory = {r: known[r] for r in which if known and r in known}
    todo = [r for r in which if r not in out]
    if len(todo) < 2:  # nothing to share
        return out | {r: pipeline_rank_memory(cfg, layout, chunks, ranks, r, n) for r in todo}
    by_role: dict[MemoryRole, RankPeak] = {}
    held = local_chunks(ranks, layout.pp)
    for r in todo:
        role = roles[r] if roles is not None else rank_role(chunks, ranks, r)
        key = _memory_role(cfg, layout, role, held[r], r, n)
        if key not in by_role:
            by_role[key] = pipeline_rank_memory(cfg, layout, chunks, ranks, r, n)
        out[r] = by_role[key]
        if out[r].memory.total > stop_above:
            break
    return out


def _memory_role(
    cfg: RunConfig, layout: Layout, role: RankRole, local: list[int], r: int, n: int
) -> MemoryRole:
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    v = s.virtual_stages if layout.pp > 1 else 1
    flight = chunks_in_flight(s.schedule, layout.pp, v, n, r) if layout.pp > 1 else {}
    waiting = weight_steps_waiting(s.schedule, layout.pp, v, n, r) if layout.pp > 1 else {}
    return MemoryRole(
        role,
        tuple(flight.get(i, 1) for i in range(len(local))),
        tuple((c - 1 in local, c + 1 in local) for c in local),
        tuple(sorted(waiting.items())),
        min(n, r + 1) if s.schedule == PipelineSchedule.INTERLEAVED_ZERO_BUBBLE else 0,
        min(n, r + 2) if s.schedule == PipelineSchedule.ZBV_ZERO_BUBBLE else 0,
    )


def memory_ranks(
    s: CollectiveStrategy, layout: Layout, chunks: list[list[Unit]], ranks: list[int], n: int
) -> list[int]:
    """Pipeline ranks that can hold the most memory. Ranks whose chunks are all inner ones (neither
    the first nor the last) with the same units differ only in the micro-batches they keep in flight,
    and their memory grows with that count (activations per micro-batch; their receive buffers
    add up to 2n whatever it is): of such a group only the rank with the most in flight is planned."""
    v = s.virtual_stages if layout.pp > 1 else 1
    return list(_memory_ranks_of(s.schedule, layout.pp, v, n, tuple(map(len, chunks)), tuple(ranks)))


@cache  # a search asks it of every candidate; it depends on the chunks' sizes only
def _memory_ranks_of(
    schedule: str, pp: int, v: int, n: int, sizes: tuple[int, ...], ranks: tuple[int, ...]
) -> tuple[int, ...]:
    last = len(sizes) - 1
    keep: list[int] = []
    groups: dict[tuple, list[tuple[tuple[int, ...], int]]] = {}
    for r, local in enumerate(local_chunks(list(ranks), pp)):
        if 0 in local or last in local:
            keep.append(r)
            continue
        flight = chunks_in_flight(schedule, pp, v, n, r)
        counts = tuple(flight.get(i, 1) for i in range(len(local)))
        groups.setdefault(tuple(sizes[c] for c in local), []).append((counts, r))
    for members in groups.values():
        top = max(members)
        if all(all(a >= b for a, b in zip(top[0], m[0], strict=True)) for m in members):
            keep.append(top[1])
        else:  # no rank holds the most of every chunk: plan them all
            keep += [r for _, r in members]
    return tuple(keep)
