"""Model families: plain nn.Modules (GPT, ERNIE, ResNet, CTR) with no parallel code inside.

Every model exposes the same small surface the runtime relies on:
- `layers`: an nn.ModuleDict of the repeated blocks (what pipelines split, FSDP wraps and
  activation checkpointing recomputes), keyed by index so names survive any split;
- `first_modules` / `last_modules`: attribute names kept only by the first / last pipeline stage;
- `forward(*inputs)` on the first stage, `forward(hidden)` on later ones.
"""

from __future__ import annotations

import copy

from torch import nn


def pipeline_chunk(model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> nn.Module:
    """A copy of `model` holding only the given blocks (and the embedding/head at the ends)."""
    chunk = copy.deepcopy(model)
    keep = {str(i) for i in layer_ids}
    for key in list(chunk.layers.keys()):
        if key not in keep:
            del chunk.layers[key]
    if not first:
        for name in chunk.first_modules:
            setattr(chunk, name, None)
    if not last:
        for name in chunk.last_modules:
            setattr(chunk, name, None)
    return chunk
