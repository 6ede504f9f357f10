"""Wire format between a trainer and one server: one flat float32 tensor of values (or
gradients) and one int64 tensor of row ids per message, instead of a dict of small tensors.

TensorPipe moves every tensor of a message as its own payload; for the few-KB messages of a
parameter server that per-tensor cost dominates (measured on 2 cores: 12 tensors of 200 floats
≈ 2× the round-trip time and CPU of one tensor of 2400). Both sides know the layout from the
placement, so only the per-table row counts travel beside the two tensors.

Layout of the values of server s: its dense blocks in placement order (each flattened), then for
each of its distributed tables in placement order, `count` rows of `width` floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fleetwise.plan.ps import Placement

Ids = tuple[torch.Tensor, list[int]]  # (ids of all tables concatenated, count per table)


@dataclass(frozen=True)
class ShardLayout:
    block_keys: tuple[str, ...]
    block_shapes: tuple[tuple[int, ...], ...]
    tables: tuple[tuple[str, int], ...]  # (name, width)

    @classmethod
    def of(cls, place: Placement, server: int) -> ShardLayout:
        blocks = place.blocks_on(server)
        shapes = tuple((b.row_stop - b.row_start, *b.shape[1:]) for b in blocks)
        return cls(tuple(b.key for b in blocks), shapes, tuple((t.name, t.width) for t in place.tables))

    @property
    def dense_numel(self) -> int:
        return sum(math.prod(s) for s in self.block_shapes)

    def pack_ids(self, ids: dict[str, torch.Tensor]) -> Ids:
        parts = [ids.get(name, torch.empty(0, dtype=torch.int64)) for name, _ in self.tables]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64), [len(p) for p in parts]

    def unpack_ids(self, packed: Ids) -> dict[str, torch.Tensor]:
        ids, counts = packed
        if len(counts) != len(self.tables) or sum(counts) != len(ids):
            raise ValueError(f"ids of {sum(counts)} rows in {len(counts)} tables do not match {len(ids)} ids")
        return {name: part for (name, _), part in zip(self.tables, ids.split(counts), strict=True)}

    def pack(self, dense: dict[str, torch.Tensor], rows: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [dense[k].reshape(-1) for k in self.block_keys]
        parts += [rows[name].reshape(-1) for name, _ in self.tables if name in rows]
        return torch.cat(parts) if parts else torch.empty(0)

    def unpack(
        self, flat: torch.Tensor, counts: list[int]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Inverse of `pack` (views into `flat`); raises if the sizes do not add up."""
        sizes = [math.prod(s) for s in self.block_shapes] + [
            c * w for c, (_, w) in zip(counts, self.tables, strict=True)
        ]
        if flat.dim() != 1 or len(flat) != sum(sizes):
            raise ValueError(f"message of {tuple(flat.shape)} values, layout expects {sum(sizes)}")
        pieces = flat.split(sizes)
        dense = {k: p.view(s) for k, s, p in zip(self.block_keys, self.block_shapes, pieces, strict=False)}
        rows = {
            name: p.view(c, w)
            for (name, w), c, p in zip(self.tables, counts, pieces[len(self.block_keys) :], strict=True)
        }
        return dense, rows
