"""Model states on one device: parameters, gradients and optimizer state, as each engine keeps
them (config/engine.py), during the step and at the optimizer step.

ZeRO's accounting (Rajbhandari et al. 2020, section 3): fp32 params 4 B, grads 4 B, optimizer
k·4 B per parameter (AdamW k = 2), each divided by the sharding degree where the engine shards it.
FSDP2 keeps parameters sharded between uses and gathers them (in the compute dtype under mixed
precision); fleetwise's ZeRO-1 (runtime/zero1.py) keeps 16-bit working weights and an fp32
gradient buffer whole, masters and optimizer state sharded; DDP and a plain module keep it all.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetwise.config.engine import ZERO1_BUCKET_ELEMENTS, Engine, reshard_after_forward
from fleetwise.plan.dtypes import FP32
from fleetwise.plan.memory.context import RankContext


@dataclass(slots=True)
class ModelStates:
    """Bytes of model states during the forward and backward."""

    params: float
    grads: float
    optimizer: float
    resting: float  # the parameters as stored between uses (FSDP: its fp32 shards; 0 when offloaded)
    grads_sharded: float  # FSDP: the sharded fp32 gradients (0 when offloaded)


def model_states(ctx: RankContext) -> ModelStates:
    if ctx.engine == Engine.FSDP:
        return _fsdp_states(ctx)
    if ctx.engine == Engine.ZERO1:
        return _zero1_states(ctx)
    return _replicated_states(ctx)


def _fsdp_states(ctx: RankContext) -> ModelStates:
    s, p, gather_bytes = ctx.strategy, ctx.p, ctx.gather_bytes
    resting = 0.0 if ctx.offloaded else FP32 * ctx.p_shard
    if reshard_after_forward(s.sharding_stage) and not ctx.pipelined:
        # each block is an FSDP unit; the rest of the chunk (embedding, head, final norm) is
        # the root unit, which FSDP2 never reshards after forward (its parameters are needed
        # again first in backward): in backward the root, the block in use and the prefetched
        # next one are gathered at once
        blocks = [u.params_on_rank(ctx.mp, ctx.ep) for u, _ in ctx.units if u.kind == "block"]
        root = p - ctx.block_params
        working = gather_bytes * (root + 2 * max(blocks, default=0.0))
    else:  # stage 2 / replication, and any pipelined FSDP (kept gathered across micro-batches)
        working = gather_bytes * p
    grads_sharded = 0.0 if ctx.offloaded else FP32 * ctx.p_shard
    return ModelStates(
        params=resting + working,
        # Under a pipeline schedule FSDP2 accumulates unsharded gradients (in the fp32 reduce
        # dtype) over the micro-batches and reduce-scatters them once, after the last backward
        # (torch.distributed.pipelining's REDUCE_GRAD), freeing each unit's unsharded gradients as
        # its sharded ones appear; the optimizer's zero_grad left no sharded gradients behind: one
        # fp32 copy of the chunk's gradients at most.
        grads=FP32 * p if ctx.pipelined else grads_sharded,
        optimizer=0.0 if ctx.offloaded else ctx.k * FP32 * ctx.p_shard,
        resting=resting,
        grads_sharded=grads_sharded,
    )


def _zero1_states(ctx: RankContext) -> ModelStates:
    # runtime/zero1.py: 16-bit working weights and the fp32 gradient buffer whole; fp32 masters
    # (under fp32 the working weights are their own masters) and optimizer state sharded
    p, mixed = ctx.p, ctx.mixed
    return ModelStates(
        params=(2 if mixed else FP32) * p,
        grads=FP32 * p,
        optimizer=(ctx.k + (1 if mixed else 0)) * FP32 * p / ctx.sh,
        resting=FP32 * p,
        grads_sharded=0.0,
    )


def _replicated_states(ctx: RankContext) -> ModelStates:
    p = ctx.p
    return ModelStates(
        params=FP32 * p + (2 * p if ctx.mixed else 0.0),  # + autocast's low-precision weight cache
        grads=FP32 * p,
        optimizer=ctx.k * FP32 * p,
        resting=FP32 * p,
        grads_sharded=0.0,
    )


@dataclass(slots=True)
class OptimizerStep:
    """Model states at the optimizer step, its temporaries, and the host memory offload takes."""

    params: float
    grads: float
    temporaries: float  # the step's own (plan `step_temporaries`)
    host: float  # offload on a GPU: the offloaded state, in host RAM


def optimizer_step(ctx: RankContext, states: ModelStates) -> OptimizerStep:
    engine, p = ctx.engine, ctx.p
    fsdp = engine == Engine.FSDP
    # autocast's low-precision weight cache is gone by the optimizer step (cleared on leaving autocast)
    params = states.resting if fsdp else (FP32 * p if engine in (Engine.NONE, Engine.DDP) else states.params)
    grads = (0.0 if ctx.offloaded else FP32 * ctx.p_shard) if fsdp else states.grads
    temporaries, host = step_temporaries(ctx), 0.0
    if ctx.offloaded:
        # the step runs on the offloaded shards, in host memory, with torch's fused CPU kernel:
        # no temporaries (runtime/optim.py step_kernel)
        host = FP32 * ctx.p_shard * (2 + ctx.k)
        temporaries = 0.0
    if engine == Engine.ZERO1:
        # (the reduce-scatter is in place in the gradient buffer); after the update one bucket's
        # all-gather, in place: the whole bucket, in the working dtype
        bucket = min(p, ZERO1_BUCKET_ELEMENTS)
        gather = (2 if ctx.mixed else FP32) * bucket
        temporaries = max(temporaries, gather)
    return OptimizerStep(params, grads, temporaries, host)


def step_temporaries(ctx: RankContext) -> float:
    """AdamW's sqrt(exp_avg_sq) and its quotient: on CUDA torch's multi-tensor step makes one for
    every parameter at once; on CPU its per-tensor loop makes two of one tensor at a time
    (runtime/optim.py: build_optimizer's foreach follows the job's device). FSDP and ZeRO-1 step
    their pieces of each tensor. (Offloaded shards step with the fused kernel: none, optimizer_step.)"""
    own = ctx.sh if ctx.engine.shards_optimizer else 1
    if ctx.k != 2:
        return 0.0
    if ctx.cfg.hardware.device_type == "cuda":
        return FP32 * (ctx.p_shard if ctx.engine == Engine.FSDP else ctx.p / own)
    return 2 * FP32 * max((u.largest_on_rank(ctx.mp, ctx.ep) for u, _ in ctx.units), default=0.0) / own
