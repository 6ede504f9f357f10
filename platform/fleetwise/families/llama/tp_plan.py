"""Llama's tensor-parallel plan as data: module path -> ParallelStyle (Megatron-style sharding).

q, k, v, gate and up are column-parallel (each rank holds a/mp query heads, kv/mp kv heads and f/mp
hidden units), o and down row-parallel; the token embedding is vocabulary-parallel and the LM head
column-parallel over the vocabulary, its logits staying sharded for `loss_parallel` (as GPT's). A
tied head (`model.TiedHead`) owns no weight: it multiplies by the vocabulary-parallel embedding's,
whose Shard(0) rows are exactly a column-parallel head's, so only its input is laid out here.

Qwen 3's q/k norms share one weight over the heads, and each rank sees only its own heads: their
weight is a replicated DTensor over inputs sharded along the head dimension
(`SequenceParallel(sequence_dim=2)` on [b, s, heads, d], as torchtitan's Qwen 3), so its gradient is
summed over the mp ranks instead of differing between them.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    SequenceParallel,
)

from fleetwise.models.tp_plan import VocabParallelEmbedding, block_plan


def llama_plan(
    sequence_parallel: bool, qk_norm: bool = False, tied: bool = False
) -> dict[str, ParallelStyle]:
    act = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "embed.tok": VocabParallelEmbedding(),
        "output": (
            # the embedding's weight, already vocabulary-sharded: its logits come out Shard(-1)
            PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),))
            if tied
            else ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
        ),
        **block_plan("layers.*", act, sequence_parallel, pre_ln=True, mlp_in=("gate", "up"), mlp_out="down"),
    }
    if qk_norm:
        # local heads in, local heads out: RoPE and SDPA run on the plain local tensors
        plan["layers.*.attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["layers.*.attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        # the lookup is all-reduced whole, then each rank keeps its sequence slice
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["norm"] = SequenceParallel()
    return plan
