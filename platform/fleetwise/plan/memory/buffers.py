"""Pipeline buffers on one device: the receive buffers of runtime/pipeline_stage.py, the outputs
and gradients a stage sends and holds, and the last stage's logits. Counted in the dry run (the
rank logs' `pipeline receive buffers`) and on torch 2.13's lowered action lists of each schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from fleetwise.plan.memory.activations import Activations
from fleetwise.plan.memory.context import RankContext
from fleetwise.plan.pipeline import PipelineSchedule, SendsMade, zbv_sends_made


class ReceiveSets(NamedTuple):
    activations: int  # sets of activation receive buffers
    gradients: int  # sets of gradient receive buffers


def recv_buffer_sets(
    schedule: str,
    n: int,
    held: int,
    rank: int = 0,
    local: int = 0,
    virtual: int = 1,
    handed: tuple[bool, bool] = (False, False),
    pp: int = 0,
) -> ReceiveSets:
    """Sets of receive buffers (activations, gradients) one pipeline chunk makes, for a chunk that
    holds `held` micro-batches in flight at its peak. Counted on gpt/tiny with 32 micro-batches
    (`pipeline receive buffers` in the rank logs): 1F1B and GPipe receive an activation only for
    a micro-batch about to run and a gradient only for the backward about to run (pp 4, 1F1B: 3,
    2, 1 activation sets on stages 1-3 = pp - r, one gradient set each); looped BFS posts every
    micro-batch's receives of a phase at once (32 and 32); the interleaved and zero-bubble
    schedules post ahead of their backwards (pp 2, v 2: up to 2 × the micro-batches in flight
    and 2 gradient sets; taken as the bound). Interleaved zero bubble, from torch 2.13's lowered
    action lists (each receive taken at its RECV action, given back at the micro-batch's weight
    step; pp 2-8, v 2-3; rank `rank`, local chunk `local` of `virtual`): its first local chunk
    2 × in flight, its last one in flight, r + 1 gradient sets (the bound was rank 0's 4 + 2 and
    2 + 2 for 2 + 1 and 1: planner +3.7% on gpt/tiny pp 2 v 2 rank 0). ZB-V, from the same lists
    (pp 2-8; local chunk 0 is stage r, 1 is stage 2pp-1-r): one activation set more than in flight
    on each chunk, r + 2 gradient sets on the first and r on the second (the bound was 2 x in
    flight and 2). Rank pp-1 hands its middle boundary to itself (`handed`: the previous, the
    next chunk is on this rank): torch's stage puts the output, the input gradient it hands over
    into the receiving chunk's set (set_local_fwd_input, set_local_bwd_input), taken at the
    handing chunk's forward or input-gradient step and given back at the receiving one's weight
    step: in flight activation sets, r + 1 gradient sets. With n = pp (no cool-down) every
    gradient set is given back before the next is taken: one."""
    if schedule == PipelineSchedule.INTERLEAVED_ZERO_BUBBLE:
        acts = held if local == virtual - 1 and virtual > 1 else 2 * held
        return ReceiveSets(min(n, acts), min(n, rank + 1))
    if schedule == PipelineSchedule.ZBV_ZERO_BUBBLE:
        acts = held if handed[0] else min(n, held + 1)
        if n < 2 * pp:
            return ReceiveSets(acts, 1)
        return ReceiveSets(acts, min(n, rank + 1 if handed[1] else rank + 2 if local == 0 else rank))
    if schedule == PipelineSchedule.LOOPED_BFS:
        return ReceiveSets(n, n)
    if schedule in (PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.GPIPE):
        return ReceiveSets(held, min(n, 1))
    return ReceiveSets(min(n, 2 * held), min(n, 2))


class BufferElements(NamedTuple):
    in_step: float  # elements held during the step
    pooled: float  # elements of the pooled receive sets (all that is left at the optimizer step)


@dataclass(slots=True)
class Moment:
    """When in the step a rank's buffers are counted: its peak, or ZB-V's cool-down."""

    waiting: dict[int, int] | None = None  # at the peak: those waiting for a zero-bubble weight step
    now: dict[int, int] | None = None  # later: micro-batches in flight then, per local chunk
    to_come: dict[int, int] | None = None  # ... and of a chunk's input gradients, those not sent yet


class _Local(NamedTuple):
    """One local chunk at the moment counted."""

    i: int  # its index among the rank's chunks
    c: int  # its index in the pipeline
    held: int  # micro-batches in flight
    sets: ReceiveSets  # receive sets it made
    sent: SendsMade | None  # ZB-V's first moment: the sends made by then
    previous_here: bool  # the previous chunk is on this rank
    next_here: bool  # the next chunk is on this rank


def pipeline_buffers(ctx: RankContext, moment: Moment) -> BufferElements:
    """Elements a pipeline rank holds beyond its units' saved activations, during the step and at
    the optimizer step.

    During the step, per local chunk: the receive buffers of runtime/pipeline_stage.py (a set per
    micro-batch between its receive and the end of its backward, reused: `recv_buffer_sets`) for
    the activations it receives (all but the first chunk; those of in-flight micro-batches are the
    first block's saved input already) and for the gradients (all but the last chunk); and the
    outputs it sends on: each in-flight micro-batch's output is kept until its backward.

    torch's multi-stage schedules (interleaved, zero bubble, looped BFS:
    `PipelineSchedule.multi_stage`) keep every send's Work to the end of the step, and a gloo or
    NCCL Work holds the tensor it sends: there every output and every input gradient sent to
    another rank stays until the step ends. The rank's peak comes late in the step (measured in the
    dry run on gpt/tiny, pp 2, v 2: the gap grew by exactly one boundary tensor per send per
    micro-batch), so all n are counted -- but the input gradients of micro-batches whose
    input-gradient step is still to come, where `moment.waiting` names the peak's zero-bubble weight step
    (pipeline.weight_steps_waiting). ZB-V's first moment (n >= 2pp) is mid-step: there only the
    sends made by then are counted.

    At the optimizer step only the pooled receive sets remain, every one of them (the stage keeps
    them for its life).

    `moment`: the peak (`waiting`), or a later moment (ZB-V's cool-down, pipeline.zbv_cool_down),
    with `now` micro-batches in flight per local chunk (the pools made for `flight` stay) and
    `to_come` of a chunk's input gradients not sent yet."""
    chunks, local, n, b = ctx.chunks, ctx.local, ctx.n, ctx.b
    mine = set(local)
    pp = len(chunks) // len(local)
    # ZB-V's first moment is mid-step: only the sends made by then are held
    first_moment = ctx.schedule == PipelineSchedule.ZBV_ZERO_BUBBLE and moment.now is None and n >= 2 * pp
    sent = zbv_sends_made(pp, n, ctx.rank) if first_moment else None
    in_step = pooled = 0.0
    for i, c in enumerate(local):
        held = min(n, ctx.flight.get(i, 1))
        handed = (c - 1 in mine, c + 1 in mine)  # a neighbour on this rank (ZB-V's rank pp-1)
        sets = recv_buffer_sets(ctx.schedule, n, held, ctx.rank, i, len(local), handed, pp)
        if moment.now is not None:
            held = min(n, moment.now.get(i, 0))
        chunk = _Local(i, c, held, sets, sent, *handed)
        if c > 0:
            boundary = b * chunks[c - 1][-1].boundary_elements
            pooled += sets.activations * boundary
            in_step += _received(ctx, moment, chunk) * boundary
        if c < len(chunks) - 1:  # outputs: sent to the next chunk's rank, or kept for the backward
            boundary = b * chunks[c][-1].boundary_elements
            pooled += sets.gradients * boundary
            in_step += (sets.gradients + _outputs(ctx, chunk)) * boundary
    return BufferElements(in_step, pooled)


def _received(ctx: RankContext, moment: Moment, chunk: _Local) -> int:
    """Boundary tensors a local chunk holds on its input side: received activations beyond those
    in flight, and the input gradients it sent back, while their sends are held."""
    n, i, held = ctx.n, chunk.i, chunk.held
    received = max(0, chunk.sets.activations - held)
    # input gradients sent back; looped BFS peaks at the end of its all-forward phase, before any
    held_sends = ctx.schedule.multi_stage
    if held_sends and not chunk.previous_here and ctx.schedule != PipelineSchedule.LOOPED_BFS:
        if moment.to_come is not None:
            received += n - moment.to_come.get(i, 0)
        elif chunk.sent is not None:
            received += chunk.sent.input_gradients[i]
        elif moment.waiting is None:
            received += n
        else:
            received += n - held + min(moment.waiting.get(i, 0), held)
    return received


def _outputs(ctx: RankContext, chunk: _Local) -> int:
    """Outputs a local chunk holds: sent on and held (multi-stage schedules), or kept for the
    backward; handed to a chunk on this rank, they are that chunk's activation receive sets."""
    if chunk.sent is not None and not chunk.next_here:
        return chunk.sent.outputs[chunk.i]
    if ctx.schedule.multi_stage and not chunk.next_here:
        return ctx.n
    return 0 if chunk.next_here else chunk.held


@dataclass(slots=True)
class PipelineMemory:
    """Bytes of one rank's pipeline buffers at each moment of the step (0 without a pipeline)."""

    during: float = 0.0  # during the forwards and backwards (plan `pipeline_buffers`)
    at_step: float = 0.0  # at the optimizer step: the pooled receive sets
    cool_down: float = 0.0  # at ZB-V's cool-down moment
    cool_down_activations: float = 0.0  # the activations then


def pipeline_memory(ctx: RankContext, acts: Activations) -> PipelineMemory:
    if not ctx.pipelined:
        return PipelineMemory()
    whole_bytes, shard = ctx.act.residual, ctx.seq_shard
    in_step, pooled = pipeline_buffers(ctx, Moment(waiting=ctx.waiting or None))
    during = in_step * whole_bytes / shard
    last = len(ctx.chunks) - 1
    if last in ctx.local:  # the last stage's outputs (the logits), from each forward to its backward
        i = ctx.local.index(last)
        held = min(ctx.n, ctx.flight.get(i, 1)) - min(ctx.waiting.get(i, 0), ctx.flight.get(i, 1))
        during += held * ctx.b * ctx.chunks[last][-1].output_split / ctx.mp * ctx.act.matmul
    # at the optimizer step the schedule is done: its held sends and kept outputs are gone
    # (torch drops the send Works when `step` returns), its pooled receive buffers stay
    # (runtime/pipeline_stage.py; GPT-3 13B zero bubble v 2, rank 0 was +3.4%: the step
    # phase with every send still held)
    at_step = pooled * whole_bytes / shard
    if ctx.cool is None:
        return PipelineMemory(during, at_step)
    cool_in_step, cool_acts = _cool_down(ctx, acts)
    return PipelineMemory(during, at_step, cool_in_step * whole_bytes / shard, cool_acts)


def _cool_down(ctx: RankContext, acts: Activations) -> tuple[float, float]:
    """ZB-V's cool-down moment: the buffers' elements then, and the activations' bytes.

    A waiting micro-batch's last output gradient is the one it received (a gradient receive set,
    counted there); the step running (on chunk 0) holds, at its end, all of its own and a
    temporary of that size (dry run of gpt/tiny pp 4, 8 layers, rank 3: a waiting micro-batch
    holds 10 of its block's 11 boundary-sized output gradients, the step 12 at its peak, with the
    input gradient it sends)."""
    assert ctx.cool is not None
    now, waits, to_come = ctx.cool
    local, b = ctx.local, ctx.b
    in_step = pipeline_buffers(ctx, Moment(now=now, to_come={0: to_come})).in_step
    out = [b * ctx.chunks[c][-1].boundary_elements * ctx.act.residual / ctx.seq_shard for c in local]
    cool_acts = sum(now[i] * acts.chunk_saved[i] for i in range(len(local)))
    cool_acts += sum(waits[i] * (acts.chunk_kept[i] - out[i]) for i in range(len(local))) + out[0]
    return in_step, cool_acts
