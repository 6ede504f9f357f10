"""The moments of a step at which a device can peak, what is alive at each, and the peak: the
phase whose parts add up to the most (the plan's `memory_peak`).

Each moment after the forward/backward one was found in the dry run (fake tensors, every
allocation counted) where the sum of the steady parts missed the measured peak; each says where.
"""

from __future__ import annotations

from typing import NamedTuple

from fleetwise.config.engine import Engine, reshard_after_forward
from fleetwise.plan.dtypes import FP32
from fleetwise.plan.memory.activations import Activations
from fleetwise.plan.memory.buffers import PipelineMemory
from fleetwise.plan.memory.context import RankContext
from fleetwise.plan.memory.states import ModelStates, OptimizerStep
from fleetwise.plan.pipeline import PipelineSchedule
from fleetwise.plan.records import Memory


class Phase(NamedTuple):
    name: str
    parts: dict[str, float]  # bytes alive, by kind (Memory's fields)


def peak_phase(phases: list[Phase]) -> Phase:
    """The phase with the most bytes alive (the first of equal peaks)."""
    return max(phases, key=lambda ph: sum(ph.parts.values()))


def memory_phases(
    ctx: RankContext,
    states: ModelStates,
    acts: Activations,
    pipe: PipelineMemory,
    mem: Memory,
    step: OptimizerStep,
) -> list[Phase]:
    """Peak of forward/backward vs the other moments of the step. `mem`: the rank's steady parts."""
    engine, s, n = ctx.engine, ctx.strategy, ctx.n
    during = _during(ctx, mem)
    phases = [Phase("forward/backward", during)]
    if ctx.cool is not None:
        # ZB-V's cool-down: fewer micro-batches in flight, more of them waiting for their weight
        # steps (gpt/tiny pp 4, 8 layers: ranks 2 and 3 peak there, rank 3 was -12.7%)
        cool = {**during, "activations": pipe.cool_down_activations, "pipeline_buffers": pipe.cool_down}
        phases.append(Phase("cool-down input gradient", cool))
    if ctx.pipelined and ctx.schedule == PipelineSchedule.GPIPE and n > 1 and engine != Engine.ZERO1:
        # GPipe runs every forward before any backward: at the first backward all n micro-batches'
        # activations are held but no gradient exists yet (zero_grad set them to None; ZeRO-1's
        # buffer stays); the gradients are whole once that backward is done, when one micro-batch
        # fewer is held. Neither moment holds both.
        phases = [
            Phase("forward/backward", {**during, "grads": 0.0}),
            Phase("backward", {**during, "activations": mem.activations - acts.one_micro_batch}),
        ]
    unpipelined_fsdp = engine == Engine.FSDP and not ctx.pipelined
    zero3 = unpipelined_fsdp and reshard_after_forward(s.sharding_stage)
    if unpipelined_fsdp:
        backward = block_backward(ctx, acts, during)
        if not (zero3 and acts.head_peak):  # (with a loss peak it is the forward/backward moment, below)
            phases.append(Phase("block backward", backward))
    if zero3 and acts.head_peak:
        # ZeRO-3: the loss's backward (its gradients of the log-softmax output and of the logits)
        # runs before any unit's backward gathers again, when every unit, the root included, has
        # resharded after its forward (measured in the dry run). The units' own backward peaks
        # come later, with the root and two blocks gathered.
        loss = {**during, "params": states.resting, "activations": acts.saved + acts.head_peak}
        phases = [Phase("forward/backward", backward), Phase("loss backward", loss)]
    if zero3:
        # ZeRO-3, the backward's first unit: the root (embedding, head, final norm) gathers again
        # once the loss's backward is done; while FSDP copies its parameters out of the
        # all-gather buffer both are alive: twice the root, beside everything saved
        root = ctx.p - ctx.block_params
        params = states.resting + 2 * ctx.gather_bytes * root
        phases.append(
            Phase("root re-gather", {**during, "params": params, "activations": acts.saved + acts.loss_done})
        )
    if unpipelined_fsdp:
        phases.append(Phase("root reduce-scatter input", root_reduce_scatter_input(ctx, states, mem)))
        phases.append(Phase("root reduce-scatter", root_reduce_scatter(ctx, states, mem)))
    if not ctx.accumulating and not engine.keeps_grad_buffer:
        end = {
            "params": mem.params,
            "grads": mem.grads,
            "optimizer": mem.optimizer,
            "activations": acts.transient,
            "inputs": mem.inputs,
        }
        phases.append(Phase("end of backward", end))
    if engine == Engine.DDP:
        # DDP rebuilds its buckets once, at the second step's forward (in the order the gradients
        # came in the first): the new buckets are allocated while the old ones, which the
        # gradients still view, are alive -- the gradients twice beside the parameters and the
        # optimizer state, before any activation (a params-heavy model peaks there: mynet dp 2 in
        # the dry run 10,612,548 B against a real run's 10,686,276 B, where the steady moments
        # planned 9,013,312 B: -15%)
        rebuild = {"params": mem.params, "grads": 2 * mem.grads, "optimizer": mem.optimizer, "inputs": mem.inputs}
        phases.append(Phase("DDP bucket rebuild", rebuild))
    phases.append(Phase("optimizer step", _optimizer_step(ctx, mem, pipe, step)))
    return phases


def _during(ctx: RankContext, mem: Memory) -> dict[str, float]:
    """The forward/backward moment. DDP's gradients are its all-reduce buckets, held for the whole
    job (gradient_as_bucket_view, zeroed in place: runtime/optim.py); micro-batches under no_sync
    accumulate into them, so there is no second copy (the dry run agrees to the byte on gpt/tiny dp 2)."""
    engine, mp = ctx.engine, ctx.mp
    grads_live = mem.grads if (ctx.accumulating or engine.keeps_grad_buffer) else 0.0
    if ctx.pipelined and engine == Engine.FSDP and ctx.mixed and ctx.schedule.zero_bubble:
        # Zero bubble under FSDP's mixed precision: a chunk's weight-gradient pass leaves its
        # 16-bit gradients on the unsharded parameters, and FSDP adds them into its fp32
        # accumulators only at the chunk's next post-backward (the next micro-batch's input-gradient
        # pass) -- every local chunk but the first, which torch back-propagates in one pass, holds
        # its parameters' gradients once more in the gather dtype (dry run of GPT-3 13B, zero
        # bubble v 2, rank 0: 786 MB, -3.7% before)
        later = sum(u.params_on_rank(mp) for c in ctx.local if c != 0 for u in ctx.chunks[c])
        grads_live += ctx.gather_bytes * later
    return {
        "params": mem.params,
        "grads": grads_live,
        "optimizer": mem.optimizer,
        "activations": mem.activations,
        "inputs": mem.inputs,
        "pipeline_buffers": mem.pipeline_buffers,
    }


class BackwardMoment(NamedTuple):
    """A moment of FSDP's backward (`block_backward`)."""

    activations: float
    grads_made: float  # gradients made so far
    params: float


def block_backward(ctx: RankContext, acts: Activations, during: dict[str, float]) -> dict[str, float]:
    """FSDP without a pipeline, a block's backward (measured in the dry run of gpt/tiny and of
    GPT-3 13B, ZeRO-3 x 8, mp 8): the head's saved activations are gone, and the root's gradients
    so far (the head's, unsharded, in the gather dtype) wait for the root's reduce-scatter at the
    end of the backward. The first block back peaks at fc2, with fc2's fresh weight gradient.
    Every later block has one block's saved activations fewer, but FSDP keeps the previous unit's
    fp32 reduce-scatter input until the next unit's (reduce_scatter_states), and it peaks in its
    attention's backward, past the MLP's temporaries, with all of the block's weight gradients.

    With one micro-batch no gradient exists before the backward: each block back adds its sharded
    gradient (its reduce-scatter's output) as one block's saved activations go, so the later
    blocks peak at the second block back, the one before the last, or the last, where FSDP
    prefetches the root, not another block (dry run of a 0.84B GPT, 16 layers, ZeRO-3 x 8, fp32:
    the 15th block back, with 14 blocks' gradients, was -6.9%; gpt/tiny d 256 x 4 blocks, full
    recompute: the 3rd, with 2 of them and 2 blocks gathered)."""
    mp, b, gather_bytes = ctx.mp, ctx.b, ctx.gather_bytes
    blocks = [u for u, _ in ctx.units if u.kind == "block"]
    block = max((u.params_on_rank(mp, ctx.ep) for u in blocks), default=0.0)
    heads = sum(count * u.params_on_rank(mp, ctx.ep) for u, count in ctx.units if u.kind == "head")
    first_grad = max((u.fresh_grad_on_rank(mp, ctx.ep) for u in blocks), default=0.0)
    mlp = max(
        (
            b * u.backward_transient.elements(mp, ctx.strategy.sequence_parallel) * ctx.act.matmul
            for u in blocks
        ),
        default=0.0,
    )
    first = acts.saved - acts.head_saved + acts.body_peak + gather_bytes * (heads + first_grad)
    later = first - acts.block_saved - mlp + gather_bytes * (block - first_grad) + FP32 * block
    n_blocks = sum(count for u, count in ctx.units if u.kind == "block")
    made = 0.0 if (ctx.accumulating or ctx.offloaded) else FP32 * block / ctx.sh
    gathered = during["params"]
    moments = [BackwardMoment(first, 0.0, gathered)]
    if n_blocks > 1:
        moments.append(BackwardMoment(later, made, gathered))
    if n_blocks > 2:
        moments.append(
            BackwardMoment(later - (n_blocks - 3) * acts.block_saved, (n_blocks - 2) * made, gathered)
        )
        last = later - (n_blocks - 2) * acts.block_saved
        moments.append(BackwardMoment(last, (n_blocks - 1) * made, gathered - gather_bytes * block))
    worst = max(moments, key=sum)
    return {
        **during,
        "params": worst.params,
        "activations": worst.activations,
        "grads": during["grads"] + worst.grads_made,
    }


def root_reduce_scatter_input(ctx: RankContext, states: ModelStates, mem: Memory) -> dict[str, float]:
    """The root's reduce-scatter input allocated (FSDP's foreach_reduce, in its final callback):
    the fp32 buffer for the whole root while every unsharded gradient of the root (in the gather
    dtype: the embedding's as well as the head's) waits to be copied in; nothing else of the
    backward is alive. It wins where the root is large and the activations are small: Llama 3 8B's
    untied 128k-vocabulary embedding and head (1.05 GB each in bf16) at 2,048 tokens a rank (seq
    8k, cp 4, ZeRO-3 + offload): dry run 6,304,358,416 B, of which this buffer 4,202,708,992 and
    the two gradients; planned 5.88 GB (-6.75%) without this moment."""
    root = ctx.p - ctx.block_params
    return {
        "params": states.resting,
        "grads": states.grads_sharded,
        "optimizer": mem.optimizer,
        "activations": FP32 * root + ctx.gather_bytes * root,
        "inputs": mem.inputs,
    }


def root_reduce_scatter(ctx: RankContext, states: ModelStates, mem: Memory) -> dict[str, float]:
    """The root's reduce-scatter, the backward's last unit (FSDP runs it in its final callback,
    after autograd is done): every unit resharded, every activation freed, but the root's
    fp32 reduce-scatter input (its unsharded gradients) and output (its new sharded ones,
    beside those of the micro-batches before, or of the units before under offload: those
    are on the host) are alive, and so is the head's weight gradient in the gather dtype:
    autograd still holds it (a real gloo run holds it too: measured with the dry run's fake
    tensors and with real ones). It wins where the root dominates (a large vocabulary on a
    small model: gpt/tiny, vocab 16k, ZeRO-2 x mp 2 was -3.07%). gloo reduces a copy of the
    whole input, alive for the call (NCCL reduces in place): the input twice there (the same
    row, dry run and real run: -20.2% without it)."""
    root = ctx.p - ctx.block_params
    head_grad = max((u.fresh_grad_on_rank(ctx.mp) for u, _ in ctx.units if u.kind == "head"), default=0.0)
    copies = 2 if ctx.cfg.hardware.backend == "gloo" else 1
    return {
        "params": states.resting,
        "grads": states.grads_sharded + (FP32 * root / ctx.sh if ctx.n > 1 or ctx.offloaded else 0.0),
        "optimizer": mem.optimizer,
        "activations": copies * FP32 * root + ctx.gather_bytes * head_grad,
        "inputs": mem.inputs,
    }


def _optimizer_step(
    ctx: RankContext, mem: Memory, pipe: PipelineMemory, step: OptimizerStep
) -> dict[str, float]:
    return {
        "params": step.params,
        "grads": step.grads,
        "optimizer": mem.optimizer,
        "step_temporaries": step.temporaries,
        "pipeline_buffers": pipe.at_step if ctx.pipelined else 0.0,
    }
