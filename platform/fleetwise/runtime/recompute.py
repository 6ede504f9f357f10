"""Activation checkpointing of the repeated blocks.

full:      keep only each block's input; recompute the whole block during backward.
selective: keep the outputs of matmuls and attention (the expensive ops) and recompute the cheap
           ones (layer norms, GELU, residual adds, layout copies) -- the op-level selective
           checkpointing of PyTorch's `create_selective_checkpoint_contexts`. Under tensor
           parallelism a row-parallel matmul (attention out-projection, fc2) outputs a partial
           sum of the full (s, h) activation on every rank; its reduced result (reduce-scatter
           under sequence parallelism: s/t rows; all-reduce otherwise) is kept instead, and the
           matmul re-runs in backward where the recompute reaches it (the out-projection: the
           second layer norm needs the residual after it; a pre-LN block's fc2 never, since
           recompute stops at the last tensor backward needs). Keeping the partial sums cost
           2·s·h per layer on every rank: at t=8 with SP, 52 instead of 24 bytes·s·b·h/t.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fleetwise.compat import (
    FUNCTIONAL_ALL_REDUCE,
    FUNCTIONAL_REDUCE_SCATTER,
    SDPA_KERNELS,
    checkpoint_wrapper,
)

_aten = torch.ops.aten
SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.convolution.default,
    *SDPA_KERNELS,
}


# the reductions that finish a row-parallel matmul (functional collectives, as DTensor issues them)
REDUCED_OPS = {
    FUNCTIONAL_REDUCE_SCATTER,
    FUNCTIONAL_ALL_REDUCE,
}


def _partial_sum(op, args) -> bool:
    """A matmul whose input is sharded along the contracted (last) dim: a row-parallel linear."""
    from torch.distributed.tensor import DTensor

    x = args[1] if op is _aten.addmm.default else args[0]
    return isinstance(x, DTensor) and any(p.is_shard(x.ndim - 1) for p in x.placements)


def _policy(ctx, op, *args, **kwargs):
    if op in REDUCED_OPS or (op in SAVE_OPS and not _partial_sum(op, args)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Wrap every block of `model.layers` in place (parameter names are unchanged for state dicts:
    torch.distributed.checkpoint strips the wrapper's prefix)."""
    for key, block in list(model.layers.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block)
        else:
            wrapped = checkpoint_wrapper(
                block, context_fn=partial(create_selective_checkpoint_contexts, _policy)
            )
        model.layers[key] = wrapped
