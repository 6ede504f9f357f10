"""Tensor-parallel plans as data: module path -> ParallelStyle (Megatron-style sharding). The parts
GPT, ERNIE and Llama share live here (the transformer block's plan, the vocabulary-parallel embedding);
each family's whole plan lives with it (`fleetwise.families.<name>.tp_plan`).

Attention q/k/v and the first MLP linear are column-parallel (each rank computes a slice of the
heads / hidden units); the attention output projection and the second MLP linear are row-parallel
(partial sums, all-reduced). The token embedding is vocabulary-parallel and the LM head is
column-parallel over the vocabulary, its logits staying sharded for a vocabulary-parallel loss
(`loss_parallel`). With sequence parallelism the layer norms run on sequence shards and the
all-reduces become reduce-scatter + all-gather pairs (Korthikanti et al. 2022).
"""

from __future__ import annotations

from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from fleetwise.compat import local_rows, tensor_parallel_style


class VocabParallelEmbedding(tensor_parallel_style()):
    """A vocabulary-parallel nn.Embedding whose backward makes only this rank's rows of the gradient.

    The weight is sharded like RowwiseParallel's (Shard(0): each mp rank holds v/mp rows) and the
    output is the same replicated tensor, but the lookup runs on the local shard, as Megatron's
    VocabParallelEmbedding does: token ids outside the rank's rows are masked, their output rows
    zeroed, and the partial sums all-reduced. DTensor's own embedding backward has no vocabulary-
    sharded rule: it computed the whole (v, h) gradient on every mp rank and sliced it afterwards
    (GPT-3 175B: 2.5 GB fp32 per stage-0 rank). Here autograd differentiates the local lookup: a
    (v/mp, h) gradient, Shard(0) like the weight."""

    def apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if (
            not isinstance(module, nn.Embedding)
            or module.padding_idx is not None
            or module.max_norm is not None
        ):
            raise NotImplementedError(
                "VocabParallelEmbedding: a plain nn.Embedding (no padding_idx, max_norm)"
            )
        distribute_module(module, device_mesh, _rows_sharded)
        module.forward = MethodType(_vocab_parallel_lookup, module)
        return module


def _rows_sharded(_name: str, module: nn.Module, device_mesh) -> None:
    """The weight as a Shard(0) DTensor (RowwiseParallel's layout of an embedding)."""
    for name, param in module.named_parameters(recurse=False):
        sharded = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=0)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _vocab_parallel_lookup(module: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [b, s] (the same on every mp rank) -> replicated embeddings [b, s, h]."""
    weight = module.weight  # Shard(0) over the mp mesh (FSDP2 hands the TP DTensor to forward)
    rows, start = local_rows(weight)
    outside = (tokens < start) | (tokens >= start + rows)
    local = F.embedding((tokens - start).masked_fill(outside, 0), weight.to_local())
    local = local.masked_fill(outside.unsqueeze(-1), 0)  # its gradient rows: zero there too
    out = DTensor.from_local(local, weight.device_mesh, [Partial()], run_check=False)
    return out.redistribute(placements=[Replicate()], async_op=True).to_local()


def block_plan(
    prefix: str,
    act,
    sequence_parallel: bool,
    pre_ln: bool,
    mlp_in: tuple[str, ...] = ("fc1",),
    mlp_out: str = "fc2",
) -> dict[str, ParallelStyle]:
    """The plan of the transformer blocks under `prefix` (`models/transformer.py`; Llama's
    `families/llama/model.py`, whose gated MLP has two column-parallel inputs: `mlp_in`); `act`:
    the layout of the activations between blocks (sequence shards under sequence parallelism)."""
    plan: dict[str, ParallelStyle] = {
        f"{prefix}.attn.wq": ColwiseParallel(),
        f"{prefix}.attn.wk": ColwiseParallel(),
        f"{prefix}.attn.wv": ColwiseParallel(),
        f"{prefix}.attn.wo": RowwiseParallel(output_layouts=act),
        **{f"{prefix}.mlp.{name}": ColwiseParallel() for name in mlp_in},
        f"{prefix}.mlp.{mlp_out}": RowwiseParallel(output_layouts=act),
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
        if len(mlp_in) > 1:  # a gated MLP's two input projections, likewise
            plan[f"{prefix}.mlp"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
            )
    return plan
