"""Tensor-parallel plans as data: module path -> ParallelStyle (Megatron-style sharding).

Attention q/k/v and the first MLP linear are column-parallel (each rank computes a slice of the
heads / hidden units); the attention output projection and the second MLP linear are row-parallel
(partial sums, all-reduced). The token embedding is vocabulary-parallel and the LM head is
column-parallel over the vocabulary, its logits staying sharded for a vocabulary-parallel loss
(`loss_parallel`). With sequence parallelism the layer norms run on sequence shards and the
all-reduces become reduce-scatter + all-gather pairs (Korthikanti et al. 2022).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)


def gpt_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    act = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "embed.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "output": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False),
        **_block_plan("layers.*", act, sequence_parallel, pre_ln=True),
    }
    if sequence_parallel:
        # token + position sum is computed replicated, then each rank keeps its sequence slice
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["norm"] = SequenceParallel()
    return plan


def ernie_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    act = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "embed.word": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "head.decoder": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        **_block_plan("layers.*", act, sequence_parallel, pre_ln=False),
    }
    if sequence_parallel:
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        # the MLM transform runs on whole sequences
        plan["head"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def _block_plan(prefix: str, act, sequence_parallel: bool, pre_ln: bool) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {
        f"{prefix}.attn.wq": ColwiseParallel(),
        f"{prefix}.attn.wk": ColwiseParallel(),
        f"{prefix}.attn.wv": ColwiseParallel(),
        f"{prefix}.attn.wo": RowwiseParallel(output_layouts=act),
        f"{prefix}.mlp.fc1": ColwiseParallel(),
        f"{prefix}.mlp.fc2": RowwiseParallel(output_layouts=act),
    }
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan[f"{prefix}.attn"] = gather
        plan[f"{prefix}.mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        # a post-LN block adds the norm's output to a sublayer's (plain, local) output: the norm
        # must hand back its local sequence shard too, not a DTensor
        plan[f"{prefix}.ln1"] = SequenceParallel(use_local_output=not pre_ln)
        plan[f"{prefix}.ln2"] = SequenceParallel(use_local_output=not pre_ln)
    else:
        # the attention input as one replicated DTensor: the q, k and v projections' partial input
        # gradients add up before a single all-reduce (each would all-reduce its own otherwise)
        plan[f"{prefix}.attn"] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
        )
    return plan
