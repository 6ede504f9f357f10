"""ERNIE's tensor-parallel plan as data: module path -> ParallelStyle (Megatron-style sharding).

The word embedding is vocabulary-parallel and the MLM head's decoder column-parallel over the
vocabulary, its logits staying sharded for a vocabulary-parallel loss (`loss_parallel`); the
blocks' plan is the one GPT and ERNIE share (`fleetwise.models.tp_plan.block_plan`).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
)

from fleetwise.models.tp_plan import VocabParallelEmbedding, block_plan


def ernie_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    act = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "embed.word": VocabParallelEmbedding(),
        "head.decoder": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        **block_plan("layers.*", act, sequence_parallel, pre_ln=False),
    }
    if sequence_parallel:
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        # the MLM transform runs on whole sequences
        plan["head"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan
