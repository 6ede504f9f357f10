"""GPT's tensor-parallel plan as data: module path -> ParallelStyle (Megatron-style sharding).

The token embedding is vocabulary-parallel and the LM head column-parallel over the vocabulary,
its logits staying sharded for a vocabulary-parallel loss (`loss_parallel`); the blocks' plan is
the one GPT and ERNIE share (`fleetwise.models.tp_plan.block_plan`).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    SequenceParallel,
)

from fleetwise.models.tp_plan import VocabParallelEmbedding, block_plan


def gpt_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    act = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "embed.tok": VocabParallelEmbedding(),
        "output": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False),
        **block_plan("layers.*", act, sequence_parallel, pre_ln=True),
    }
    if sequence_parallel:
        # token + position sum is computed replicated, then each rank keeps its sequence slice
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["norm"] = SequenceParallel()
    return plan
