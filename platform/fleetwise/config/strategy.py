"""How a job is parallelised: the `strategy` config group.

Two families (PaddlePaddle's distributed-training overview): *collective* strategies (dp, mp, pp, sharding and their 4D `hybrid`),
where every rank is a worker, and the *parameter server* (`ps`), where servers hold the
parameters and trainers push gradients and pull values.

A collective strategy is five degrees whose product is the world size
(sharding × dp × mp × pp × cp = nodes × devices_per_node; cp, context parallelism, splits each
sequence over ranks and is set only with `strategy=hybrid`). The named strategies are presets: each
one fixes which degrees may exceed 1, so `strategy=dp strategy.mp_degree=2` is refused with a
pointer to `strategy=hybrid` instead of silently becoming a hybrid job.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from fleetwise.config.base import Section

# A degree is a number, `auto` (the one degree that takes what the others leave of the world size)
# or `max` (the largest degree this model, hardware and the other degrees allow: validation tries
# them from the largest down with the same rules; see config/validate.py `fill_max`).
Degree = Annotated[int, Field(ge=1)] | Literal["auto", "max"]

DEGREE_NAMES = ("sharding_degree", "dp_degree", "mp_degree", "pp_degree")

# Pipeline schedules, named as users write them; the runtime maps each one to its
# torch.distributed.pipelining class.
Schedule = Literal[
    "GPipe", "1F1B", "interleaved_1F1B", "looped_BFS", "interleaved_zero_bubble", "ZBV_zero_bubble"
]
INTERLEAVED_SCHEDULES = ("interleaved_1F1B", "looped_BFS", "interleaved_zero_bubble", "ZBV_zero_bubble")


class CollectiveStrategy(Section):
    """Degrees of the 4D collective layout plus the pipeline and memory knobs."""

    # Degrees a preset lets exceed 1 (hybrid: all of them).
    free_degrees: ClassVar[tuple[str, ...]] = DEGREE_NAMES

    dp_degree: Degree = Field(
        1, description="Data-parallel replicas (outermost mesh dim; gradients all-reduced)."
    )
    mp_degree: Degree = Field(1, description="Tensor (intra-layer) model parallel ranks; keep inside a node.")
    pp_degree: Degree = Field(1, description="Pipeline stages (inter-layer); cheap traffic, may cross nodes.")
    sharding_degree: Degree = Field(
        1, description="ZeRO/FSDP sharding group size (innermost data dim, intra-node)."
    )
    ep_degree: int = Field(
        1,
        ge=1,
        description="Expert-parallel ranks (model.moe): the routed experts split over groups of this many "
        "data-parallel ranks, tokens exchanged by all-to-all; not a factor of the world size.",
    )
    sharding_stage: Literal[1, 2, 3] | None = Field(
        None,
        description="ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters. Only with sharding_degree > 1.",
    )
    schedule: Schedule = Field("1F1B", description="Pipeline schedule (used when pp_degree > 1).")
    virtual_stages: int = Field(
        1, ge=1, description="Model chunks per pipeline rank (interleaved schedules need >= 2)."
    )
    layer_split: list[Annotated[int, Field(ge=1)]] | None = Field(
        None,
        description="Explicit layers per pipeline stage (pp_degree × virtual_stages entries); null = balanced.",
    )
    recompute: Literal["none", "selective", "full"] = Field(
        "none",
        description="Activation checkpointing: none, selective (keep matmul outputs), full (per block).",
    )
    offload: bool = Field(False, description="Keep sharded parameters and optimizer state in host memory.")
    sequence_parallel: bool = Field(
        False, description="Shard layer norms/dropout along the sequence over mp ranks."
    )
    cp_degree: int = Field(
        1,
        ge=1,
        description="Context parallel ranks: each sequence is split over them (head-tail chunks, causal "
        "load balance); they share parameter shards like data-parallel ranks. Only with strategy=hybrid.",
    )
    cp_method: Literal["ring", "ulysses"] = Field(
        "ring",
        description="ring: keys/values of every rank's chunks gathered, blockwise softmax merged; ulysses: "
        "all-to-all from sequence- to head-sharding around attention (heads divisible by cp_degree).",
    )

    def degree(self, name: str) -> int | str:
        return getattr(self, name)

    @property
    def is_ps(self) -> bool:
        return False


class DPStrategy(CollectiveStrategy):
    name: Literal["dp"] = "dp"
    free_degrees: ClassVar[tuple[str, ...]] = ("dp_degree",)


class MPStrategy(CollectiveStrategy):
    name: Literal["mp"] = "mp"
    free_degrees: ClassVar[tuple[str, ...]] = ("mp_degree", "dp_degree")


class PPStrategy(CollectiveStrategy):
    name: Literal["pp"] = "pp"
    free_degrees: ClassVar[tuple[str, ...]] = ("pp_degree", "dp_degree")


class ShardingStrategy(CollectiveStrategy):
    name: Literal["sharding"] = "sharding"
    free_degrees: ClassVar[tuple[str, ...]] = ("sharding_degree", "dp_degree")


class HybridStrategy(CollectiveStrategy):
    name: Literal["hybrid"] = "hybrid"


class PSStrategy(Section):
    """Parameter server: `num_servers` hold parameter shards, `num_trainers` compute gradients (PaddlePaddle Fluid's pserver mode)."""

    name: Literal["ps"] = "ps"
    num_servers: int = Field(2, ge=1, description="Server processes holding parameter shards.")
    num_trainers: int = Field(2, ge=1, description="Trainer processes; each reads its own slice of the data.")
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: one update per step after all trainers pushed; async: apply each push on arrival.",
    )
    dispatch: Literal["round_robin", "hash_name"] = Field(
        "round_robin", description="How dense variables are assigned to servers."
    )
    slice_var_up: bool = Field(
        True, description="Split variables above slice_min_elements across servers in row blocks."
    )
    slice_min_elements: int = Field(8192, ge=1, description="Element count above which a variable is sliced.")
    dense_fallback: bool = Field(
        False,
        description="Allow a model without distributed sparse tables (its dense params live on servers).",
    )
    sparse_optimizer: Literal["sgd", "adagrad"] = Field(
        "adagrad", description="Server-side update of sparse rows."
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="async only: a trainer waits if it is more than this many steps ahead of the slowest.",
    )
    server_address: str = Field(
        "127.0.0.1", description="Address servers bind to (loopback unless configured)."
    )
    allow_remote_servers: bool = Field(
        False,
        description="Allow a non-loopback server_address (RPC unpickles its calls: trusted networks only).",
    )

    @property
    def is_ps(self) -> bool:
        return True


StrategyConfig = Annotated[
    DPStrategy | MPStrategy | PPStrategy | ShardingStrategy | HybridStrategy | PSStrategy,
    Field(discriminator="name"),
]
