"""Activation checkpointing of the repeated blocks.

full:      keep only each block's input; recompute the whole block during backward.
selective: keep the outputs of matmuls and attention (the expensive ops) and recompute the cheap
           ones (layer norms, GELU, residual adds, layout copies) -- the op-level selective
           checkpointing of PyTorch's `create_selective_checkpoint_contexts`.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


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
