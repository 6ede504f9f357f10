"""Activations on one device: what each unit saves for its backward, times the micro-batches in
flight, and the short-lived peaks beside them (a unit's own backward, the loss, zero bubble's
weight steps); and the step's batch.

Per unit and sample the saved elements come from plan/units.py (Korthikanti et al. 2022,
redone for this engine), in bytes by precision and engine (plan/dtypes.py); the micro-batches
each schedule keeps in flight from plan/pipeline.py.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from fleetwise.families import family_of
from fleetwise.plan.cache import PLAN_CACHE
from fleetwise.plan.chunks import unit_groups
from fleetwise.plan.context_parallel import ring_backward_peak, saved_per_layer
from fleetwise.plan.dtypes import FP32
from fleetwise.plan.memory.context import RankContext
from fleetwise.plan.pipeline import PipelineSchedule
from fleetwise.plan.units import Unit


@dataclass(slots=True)
class UnitActivations:
    """One unit's activation bytes, for one micro-batch of this rank."""

    per_sample: float  # saved for its backward, per sample
    peak: float  # its short-lived peak beside the saved ones, per micro-batch


def unit_activations(ctx: RankContext, u: Unit) -> UnitActivations:
    s, mp, b = ctx.strategy, ctx.mp, ctx.b
    sp, split_bytes = s.sequence_parallel, ctx.act.matmul
    per_sample = ctx.saved_bytes(u.saved(s.recompute))
    short = u.transient_tp if mp > 1 and u.transient_tp is not None else u.transient
    peak = b * short.elements(mp, sp) * FP32 / ctx.cp
    # the unit's own backward: its gradient temporaries beside its saved activations,
    # with its largest parameter's fresh gradient and, under recompute, what the
    # recompute re-materialises (full: all but the block's input; selective: what it
    # does not keep)
    own = b * u.backward_transient.elements(mp, sp) * split_bytes / ctx.cp
    if u.kind == "block":  # the ring's backward, after the MLP's (plan/context_parallel.py)
        own = max(own, b * ring_backward_peak(ctx.cfg, ctx.layout, split_bytes))
    if s.recompute != "none" and u.kind == "block":
        own += b * max(0.0, ctx.saved_bytes(u.saved("none")) - per_sample)
    # context parallelism: what attention over the whole sequence saves beyond the rank's tokens
    # (plan/context_parallel.py); a fully recomputed block holds it only while it recomputes
    cp_extra = saved_per_layer(ctx.cfg, ctx.layout, split_bytes) if u.kind == "block" else 0.0
    if s.recompute == "full":
        own += b * cp_extra
    else:
        per_sample += cp_extra
    if own:
        peak = max(peak, own + ctx.fresh * u.fresh_grad_on_rank(mp, ctx.ep))
    if u.output_split:
        # the loss's forward (ParallelModel.loss): the logits' fp32 upcast is alive
        # beside the log-softmax output it saves; the 16-bit logits themselves die at
        # the upcast (under a pipeline the stage holds them anyway: pipeline_buffers)
        upcast = FP32 if split_bytes != FP32 else 0.0
        peak = max(peak, b * u.output_split / mp / ctx.cp * upcast)
    return UnitActivations(per_sample, peak)


@dataclass(slots=True)
class Activations:
    """One rank's activation bytes, summed over its local chunks' units."""

    saved: float = 0.0  # saved for the backward, every micro-batch in flight
    transient: float = 0.0  # the largest short-lived peak beside them
    one_micro_batch: float = 0.0  # what one micro-batch saves
    head_peak: float = 0.0  # the loss's backward peak
    body_peak: float = 0.0  # every other unit's
    loss_done: float = 0.0  # what the activations change by once the loss's backward is done
    head_saved: float = 0.0  # what the head saves for its backward, one micro-batch
    block_saved: float = 0.0  # what a block saves for its backward, one micro-batch
    weight_wait: float = 0.0  # zero bubble: what the micro-batches waiting for their weight step add
    weight_step: float = 0.0  # zero bubble: the weight step's own peak
    # ZB-V's cool-down: per local chunk, one micro-batch's saved activations and the output
    # gradients it keeps from its input-gradient step to its weight step
    chunk_saved: list[float] = field(default_factory=list)
    chunk_kept: list[float] = field(default_factory=list)


def rank_activations(ctx: RankContext) -> Activations:
    """Every local chunk's units (equal ones worked out once), then the peaks that come late."""
    out = Activations(chunk_saved=[0.0] * len(ctx.local), chunk_kept=[0.0] * len(ctx.local))
    memo: dict[Hashable, UnitActivations] = {}
    for i, c in enumerate(ctx.local):
        for u, count in unit_groups(ctx.chunks[c]):
            key = PLAN_CACHE.class_of(u)
            known = memo.get(key)
            if known is None:
                known = memo[key] = unit_activations(ctx, u)
            out.saved += count * ctx.flight.get(i, 1) * ctx.b * known.per_sample
            if ctx.cool is not None:
                _add_cool_down(out, ctx, i, u, count, known)
            if ctx.waiting:
                _add_weight_steps(out, ctx, i, c, u, count)
            _add_peaks(out, ctx, u, count, known)
    _add_late_peaks(out, ctx)
    return out


def _add_cool_down(
    out: Activations, ctx: RankContext, i: int, u: Unit, count: int, known: UnitActivations
) -> None:
    """ZB-V's cool-down: one micro-batch's saved activations, and the output gradients it keeps."""
    out.chunk_saved[i] += count * ctx.b * known.per_sample
    out.chunk_kept[i] += count * ctx.b * ctx.saved_bytes(u.weight_grad_outputs)


def _add_weight_steps(out: Activations, ctx: RankContext, i: int, c: int, u: Unit, count: int) -> None:
    """Interleaved zero bubble's peak, a weight step on the last local chunk, with micro-batches
    waiting for theirs (pipeline.weight_steps_waiting)."""
    s, b, mp = ctx.strategy, ctx.b, ctx.mp
    wait = min(ctx.waiting.get(i, 0), ctx.flight.get(i, 1))
    if wait:
        # waiting for its weight step: the output gradients it reads, kept from its
        # input-gradient step, which freed the log-softmax output
        freed = u.saved(s.recompute).fp32 / mp * FP32
        out.weight_wait += count * wait * b * (ctx.saved_bytes(u.weight_grad_outputs) - freed)
    if c == ctx.local[-1]:
        # the weight step of one of them: torch runs its parameter groups from the chunk's
        # input up, each freeing its output gradients once its weight gradients exist; it
        # peaks in the first, with the first block re-run under recompute (once for all of
        # its groups, runtime/pipeline_stage.py) and a norm's small gradient
        rerun = ctx.saved_bytes(u.saved("none")) - ctx.saved_bytes(u.saved(s.recompute))
        out.weight_step = max(out.weight_step, b * rerun)


def _add_peaks(out: Activations, ctx: RankContext, u: Unit, count: int, known: UnitActivations) -> None:
    b, mp = ctx.b, ctx.mp
    out.one_micro_batch += count * b * known.per_sample
    out.transient = max(out.transient, known.peak)
    if u.kind == "head":
        out.head_peak = max(out.head_peak, known.peak)
        out.head_saved += count * b * known.per_sample
        # once the loss's backward is done: its log-softmax output freed, the logits'
        # gradient (in the matmul dtype) handed to the head
        fp32_saved = u.saved(ctx.strategy.recompute).fp32
        out.loss_done = b * (u.output_split / mp * ctx.act.matmul - fp32_saved / mp * FP32)
    else:
        out.body_peak = max(out.body_peak, known.peak)
    if u.kind == "block":
        out.block_saved = max(out.block_saved, b * known.per_sample)


def _add_late_peaks(out: Activations, ctx: RankContext) -> None:
    """A parameter's fresh gradient, and ZB-V's input-gradient step."""
    b, chunks = ctx.b, ctx.chunks
    if ctx.fresh:
        fresh = max((u.fresh_grad_on_rank(ctx.mp, ctx.ep) for u, _ in ctx.units), default=0.0)
        out.transient = max(out.transient, ctx.fresh * fresh)
    if ctx.schedule == PipelineSchedule.ZBV_ZERO_BUBBLE and ctx.pipelined:
        # ZB-V peaks inside an input-gradient step (torch 2.13's lists: each is followed at once by
        # its weight step, so none waits at the peak; gpt/tiny pp 2 rank 0: the last stage's, late
        # in the step). Its micro-batch keeps every output gradient it makes for that weight step
        # (`Unit.weight_grad_outputs`): near its end, those of all of the chunk's units at once
        # (gpt/tiny pp 2 rank 0: -3.33% without; pp 4 rank 0 -2.33%). Chunk 0 is left out: its
        # input needs no gradient (`block_recomputes`)
        for c in ctx.local:
            if c > 0:
                kept = sum(b * ctx.saved_bytes(u.weight_grad_outputs) for u in chunks[c])
                if c == len(chunks) - 1:
                    # the last stage receives no output gradient (elsewhere the received one is a
                    # pool set's, counted there, and the step's boundary-sized temporary matches
                    # it): here the temporary comes on top (dry run of gpt/tiny pp 2 and 4, rank 0:
                    # 18 boundaries at the step's peak, its 16 kept, the one it sends and that one)
                    kept += b * chunks[c - 1][-1].boundary_elements * ctx.act.residual / ctx.seq_shard
                out.transient = max(out.transient, kept)


def total_activations(ctx: RankContext, acts: Activations) -> float:
    """The activations at the forward/backward peak: zero bubble's weight step, not the
    input-gradient steps' temporaries (the loss's backward, a block's input gradients), but the
    waiting micro-batches' output gradients."""
    return acts.saved + (acts.weight_wait + acts.weight_step if ctx.waiting else acts.transient)


def input_bytes(ctx: RankContext) -> float:
    """Every rank loads its share of the step's batch at once. On a GPU it stays in host memory and
    each micro-batch is copied over in turn, except under a pipeline schedule, which takes the
    whole batch on the device and splits it itself."""
    cfg, b = ctx.cfg, ctx.b
    on_device = ctx.n * b if (cfg.hardware.device_type == "cpu" or ctx.pipelined) else b
    return on_device * family_of(cfg.model).input_bytes(cfg.model)
