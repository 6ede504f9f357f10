"""Pipeline chunking: a copy of a model that keeps only some of its blocks, and its first and
last modules only on the first and last chunk (the contract: `fleetwise.models.contract`)."""

from __future__ import annotations

import copy

from fleetwise.models.contract import ModelContract


def pipeline_chunk(model: ModelContract, layer_ids: list[int], first: bool, last: bool) -> ModelContract:
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
