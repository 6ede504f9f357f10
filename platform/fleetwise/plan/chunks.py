"""A model's units on the pipeline: which units each chunk holds, which chunks each rank holds,
and what makes two ranks alike (their roles).

The model is a chain of units (plan/units.py: embedding, blocks, head). Without pipelining it is
one chunk; with pp stages and v virtual stages it is pp·v chunks of consecutive blocks, the first
chunk taking the embedding and the last the head (`split_layers`, the same split the runtime
makes), and chunk c runs on the rank plan/pipeline.py `chunk_ranks` names. What a layout search
asks of every candidate (the units, the chunks, their groups and roles) is kept in plan/cache.py
(`PLAN_CACHE`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import NamedTuple

from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import CollectiveStrategy
from fleetwise.families import model_units
from fleetwise.plan.cache import MAX_MODELS, PLAN_CACHE
from fleetwise.plan.pipeline import PipelineSchedule, split_layers
from fleetwise.plan.units import Unit


def units_of(model) -> list[Unit]:
    """The model's units, built once per model config (`PLAN_CACHE`), each given its class of
    equal units (its fields but the name)."""
    # a custom model's units are traced on its dataset's items, which its section holds outside the
    # dump (a bad dataset's fallback units were served to the same model with a good one: a sweep)
    key = model.model_dump_json() + json.dumps(getattr(model, "dataset", None), sort_keys=True, default=str)
    if key not in PLAN_CACHE.units:
        if len(PLAN_CACHE.units) > MAX_MODELS:
            PLAN_CACHE.clear()
        units = model_units(model)
        classes: dict[str, str] = {}
        for u in units:
            sig = repr(replace(u, name=""))
            PLAN_CACHE.unit_class[id(u)] = classes.setdefault(sig, sig)
        PLAN_CACHE.units[key] = units
    return PLAN_CACHE.units[key]


class Ends(NamedTuple):
    """A model's units by place: what only the first chunk holds, the blocks, what only the last holds."""

    first: list[Unit]  # the embedding
    blocks: list[Unit]
    last: list[Unit]  # the head (final norm, LM head, loss)


def split_ends(units: list[Unit]) -> Ends:
    first = [u for u in units if u.kind == "embedding"]
    blocks = [u for u in units if u.kind == "block"]
    last = [u for u in units if u.kind == "head"]
    return Ends(first, blocks, last)


def assign_units(cfg: RunConfig, layout: Layout) -> list[list[Unit]]:
    """Units of each pipeline chunk (pp × virtual_stages chunks; one chunk without pipelining)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    units = units_of(cfg.model)
    chunks = layout.pp * s.virtual_stages if layout.pp > 1 else 1
    explicit = tuple(s.layer_split) if layout.pp > 1 and s.layer_split else None
    key = (id(units), chunks, explicit)
    if key not in PLAN_CACHE.chunks:
        PLAN_CACHE.chunks[key] = _assign(units, chunks, explicit)
    return PLAN_CACHE.chunks[key]


def _assign(units: list[Unit], chunks: int, explicit: tuple[int, ...] | None) -> list[list[Unit]]:
    first, blocks, last = split_ends(units)
    split = split_layers(len(blocks), chunks, list(explicit) if explicit else None)
    out, i = [], 0
    for c, count in enumerate(split):
        chunk = list(blocks[i : i + count])
        i += count
        if c == 0:
            chunk = first + chunk
        if c == chunks - 1:
            chunk = chunk + last
        out.append(chunk)
    return out


class UnitGroup(NamedTuple):
    """Equal units of a chunk: one of them and how many."""

    unit: Unit
    count: int


def unit_groups(chunk: list[Unit]) -> list[UnitGroup]:
    """The chunk's units by class (`PLAN_CACHE.class_of`), each once with its count, in order of
    first appearance: sums over a chunk's units are count × the class's term."""
    held = PLAN_CACHE.groups.get(chunk)
    if held is not None:
        return held
    groups: dict[object, list] = {}
    for u in chunk:
        key = PLAN_CACHE.class_of(u)
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [u, 1]
    return PLAN_CACHE.groups.put(chunk, [UnitGroup(u, count) for u, count in groups.values()])


def local_chunks(ranks: list[int], pp: int) -> list[list[int]]:
    """The chunks each pipeline rank holds, in order (one pass: a search plans thousands)."""
    out: list[list[int]] = [[] for _ in range(pp)]
    for c, r in enumerate(ranks):
        out[r].append(c)
    return out


def rank_units(chunks: list[list[Unit]], ranks: list[int], rank: int) -> list[Unit]:
    """The units of every chunk pipeline rank `rank` holds."""
    return [u for c, r in enumerate(ranks) if r == rank for u in chunks[c]]


class ChunkRole(NamedTuple):
    """What one local chunk's work and traffic depend on (a hashable key: ranks whose chunks have
    equal roles compute and send the same)."""

    first: bool  # the pipeline's first chunk
    last: bool  # the pipeline's last chunk
    units: tuple  # its units' classes
    receives_from: tuple | None  # the class of the unit whose output it receives
    previous_here: bool  # the previous chunk is on this rank (ZB-V's rank pp-1)
    next_here: bool  # the next chunk is on this rank


RankRole = tuple[ChunkRole, ...]  # one per local chunk, in order


def rank_role(chunks: list[list[Unit]], ranks: list[int], rank: int) -> RankRole:
    """What pipeline rank `rank`'s work and traffic depend on: per local chunk, whether it is the
    first or the last one, its units (by class: equal units share one), the unit whose output
    it receives and whether its neighbours are on this rank (ZB-V's rank pp-1 sends nothing
    between its chunks: its pp bytes were +100%). Ranks with the same role compute and send the same."""
    last = len(chunks) - 1

    def classes(units: list[Unit]) -> tuple:
        return tuple(PLAN_CACHE.class_of(u) for u in units)

    return tuple(
        ChunkRole(
            c == 0,
            c == last,
            classes(chunks[c]),
            classes(chunks[c - 1][-1:]) if c > 0 else None,
            c > 0 and ranks[c - 1] == rank,
            c < last and ranks[c + 1] == rank,
        )
        for c, r in enumerate(ranks)
        if r == rank
    )


def rank_roles(chunks: list[list[Unit]], ranks: list[int], pp: int) -> list[RankRole]:
    """`rank_role` of every pipeline rank, once per chunk assignment (`PLAN_CACHE.roles`)."""
    held = PLAN_CACHE.roles.get(chunks, tuple(ranks))
    if held is not None:
        return held
    every = [rank_role(chunks, ranks, r) for r in range(pp)] if pp > 1 else [()]
    return PLAN_CACHE.roles.put(chunks, every, tuple(ranks))


def block_recomputes(schedule: str, pp: int, chunks: list[list[Unit]]) -> dict[int, int]:
    """id(unit) -> how many times a checkpointed unit's forward is re-run in one micro-batch's
    backward. Once, except under the zero-bubble schedules: torch splits the backward into an
    input-gradient and a weight-gradient call (pipelining._backward), and a checkpointed block is
    recomputed in each (runtime/pipeline_stage.py runs each micro-batch's weight-gradient calls
    under one GraphExecGroup, or it would be once per parameter group). The first chunk is the
    exception: its input needs no gradient, so torch runs one full backward there."""
    twice = pp > 1 and PipelineSchedule(schedule).zero_bubble
    held = PLAN_CACHE.recomputes.get(chunks, twice)  # a search asks it of every candidate (read-only)
    if held is not None:
        return held
    again = {id(u): 2 if twice and c > 0 else 1 for c, chunk in enumerate(chunks) for u in chunk}
    return PLAN_CACHE.recomputes.put(chunks, again, twice)
