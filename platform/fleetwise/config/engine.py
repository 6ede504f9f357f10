"""Which PyTorch mechanism implements the data-parallel part of a layout.

Shared by the planner (memory and communication accounting) and the runtime (what it wraps the
model in), so that both always agree. No torch import here.

| layout                                  | engine  | PyTorch mechanism                                         |
|-----------------------------------------|---------|-----------------------------------------------------------|
| dp = sharding = 1                       | none    | plain module                                              |
| dp > 1, no sharding, mp = pp = 1        | ddp     | DistributedDataParallel (no_sync while accumulating)      |
| sharding_stage 1 (ZeRO-1), any mp / pp  | zero1   | fleetwise's distributed optimizer (runtime/zero1.py)      |
| sharding_stage 2 (ZeRO-2)               | fsdp    | fully_shard(reshard_after_forward=False) on (dp, sharding) |
| sharding_stage 3 (ZeRO-3)               | fsdp    | fully_shard(reshard_after_forward=True) on (dp, sharding)  |
| dp > 1 with mp > 1 or pp > 1, no sharding | fsdp  | fully_shard on (dp, sharding=1): HSDP that only replicates |

Context parallel ranks (cp > 1) count as data-parallel ones here: dp = 1 and cp > 1 without
sharding is DDP over cp; with sharding, FSDP shards over sharding × cp (config/layout.py) -- and
over cp alone when sharding_degree is 1 and a sharding_stage 2 or 3 is set (the same flattened
"sharding_cp" dim, of size cp).

FSDP2 always stores parameters sharded between steps, so "stage 2" here differs from ZeRO-2 on
paper (which keeps whole parameters on every rank): parameters are gathered once per forward and
kept until the backward is done, instead of being re-gathered for the backward as in stage 3.
DDP cannot wrap DTensor (tensor-parallel) parameters, and it cannot follow a pipeline schedule's
interleaved forwards and backwards, which is why dp combined with mp or pp goes through FSDP (as in
torchtitan).

ZeRO-1 is Megatron-LM's distributed optimizer, written with plain collectives (no DDP): working
weights whole (16-bit under bf16/fp16), one fp32 gradient accumulation buffer whole, fp32 master
weights and optimizer state sharded over `sharding`; per step one reduce-scatter of the gradients
(+ an all-reduce of the shards across dp replicas) and one all-gather of the updated weights.
Bytes per parameter with Adam: Megatron's 6 + 12/d under bf16/fp16 and 8 + 8/d under fp32 (the
master is the working weight itself; the reduce-scatter works in place in the gradient buffer). It works on TP shards and under every pipeline schedule.
"""

from __future__ import annotations

from enum import StrEnum

from fleetwise.config.layout import Layout

# ZeRO-1's buckets (runtime/zero1.py): at most this many elements each (the whole-size all-gather
# output of the step's end is one bucket's); one reduce-scatter and one all-gather per bucket
ZERO1_BUCKET_ELEMENTS = 2**26


class Engine(StrEnum):
    """The data-parallel engine of a layout (the table above). A `StrEnum`: each member is its
    name as a string (`Engine.FSDP == "fsdp"`), so plans, logs and JSON carry the same text."""

    NONE = "none"
    DDP = "ddp"
    ZERO1 = "zero1"
    FSDP = "fsdp"

    @property
    def shards_optimizer(self) -> bool:
        """Each rank keeps and steps its 1/sharding piece of every tensor's optimizer state (and,
        for FSDP, of the parameters and gradients too)."""
        return self in (Engine.FSDP, Engine.ZERO1)

    @property
    def keeps_grad_buffer(self) -> bool:
        """Gradients live in buffers held for the whole job, whole on every rank: DDP's all-reduce
        buckets (gradient_as_bucket_view) and ZeRO-1's fp32 accumulation buffer."""
        return self in (Engine.DDP, Engine.ZERO1)

    @property
    def casts_weights(self) -> bool:
        """Under mixed precision the model computes with 16-bit weights the engine made (FSDP's
        MixedPrecisionPolicy gathers them so; ZeRO-1 keeps 16-bit working weights), instead of
        autocast casting fp32 weights op by op: the residual stream is 16-bit too."""
        return self in (Engine.FSDP, Engine.ZERO1)


def dp_engine(layout: Layout, sharding_stage: int | None) -> Engine:
    if layout.sharding > 1:
        return Engine.ZERO1 if sharding_stage == 1 else Engine.FSDP
    if layout.cp > 1 and sharding_stage in (2, 3):  # FSDP over cp alone: "sharding_cp" of sharding 1
        return Engine.FSDP
    if layout.dp > 1 or layout.cp > 1:  # cp ranks' gradients are averaged like dp replicas'
        return Engine.FSDP if (layout.mp > 1 or layout.pp > 1) else Engine.DDP
    return Engine.NONE


def reshard_after_forward(sharding_stage: int | None) -> bool:
    """ZeRO-3 frees gathered parameters after each forward; stage 2 (and replication) keeps them."""
    return sharding_stage == 3


def optimizer_state_factor(name: str, momentum: float) -> int:
    """fp32 state tensors per parameter: AdamW 2 (exp_avg, exp_avg_sq), Adagrad 1, SGD 1 with momentum."""
    if name == "adamw":
        return 2
    if name == "adagrad":
        return 1
    return 1 if momentum > 0 else 0
