"""Where parameter-server variables live (PaddlePaddle Fluid's pserver mode: round_robin / hash_name
dispatch, slice_var_up), as arithmetic on the config: no torch.

Shared by the planner (exact bytes per server) and the runtime (what each server holds), so both
always agree.

Dense variables (every model parameter except the distributed sparse tables):
- slicing (`slice_var_up`): a variable with more than `slice_min_elements` elements is cut into
  min(num_servers, rows) blocks of whole rows (dim 0), as even as ceil-division allows. Paddle's
  transpiler documents the same rule ("variables above 8192 elements are split across servers") to
  balance load; smaller variables stay whole because a block costs one more message per step.
- dispatch: the blocks (a whole variable is one block) are assigned in model order either
  `round_robin` (block i goes to server i mod S, one counter over all blocks) or `hash_name`
  (server = crc32(block key) mod S). crc32 rather than Python's `hash()`, which is salted per
  process: every rank and the planner must compute the same placement.

Distributed sparse tables (`distributed: true`): one server table per field holding the embedding
row and the first-order weight side by side (width embedding_dim + 1, pulled together). Rows are
sharded by id modulo the server count (row r lives on server r mod S as local row r // S), as
Paddle's split_ids does: hot ids of a skewed (Zipf) distribution spread over all servers instead
of piling onto the server that owns the first block. Tables with `distributed: false` are ordinary
dense variables (sliced and dispatched like the MLP).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from fleetwise.config.engine import optimizer_state_factor
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import PSStrategy
from fleetwise.families import family_of

FP32 = 4


def stable_hash(text: str) -> int:
    """Same value in every process and Python version (unlike the salted built-in `hash`)."""
    return zlib.crc32(text.encode())


@dataclass(frozen=True)
class VarBlock:
    """Rows [row_start, row_stop) of dense variable `name`, held by `server`."""

    name: str
    shape: tuple[int, ...]  # of the whole variable
    index: int  # block number inside the variable
    sliced: bool
    row_start: int
    row_stop: int
    server: int

    @property
    def key(self) -> str:
        """Name on the server and in messages (Paddle's `<var>.block<i>`)."""
        return f"{self.name}.block{self.index}" if self.sliced else self.name

    @property
    def numel(self) -> int:
        return (self.row_stop - self.row_start) * math.prod(self.shape[1:])


@dataclass(frozen=True)
class ServerTable:
    """A distributed sparse table: `num_rows` rows of `width` floats, row-sharded by id mod S."""

    name: str
    num_rows: int
    width: int
    field: int  # position of the field in model.sparse_tables (column of sparse_ids)

    def rows_on(self, server: int, num_servers: int) -> int:
        return len(range(server, self.num_rows, num_servers))


def slice_rows(
    shape: tuple[int, ...], num_servers: int, min_elements: int, enabled: bool
) -> list[tuple[int, int]]:
    """Row ranges a variable is cut into (one range when it is not sliced)."""
    rows = shape[0] if shape else 1
    if not enabled or num_servers == 1 or rows < 2 or math.prod(shape) <= min_elements:
        return [(0, rows)]
    per = -(-rows // min(num_servers, rows))
    return [(r, min(r + per, rows)) for r in range(0, rows, per)]


def dispatch(keys: list[str], num_servers: int, method: str) -> list[int]:
    if method == "round_robin":
        return [i % num_servers for i in range(len(keys))]
    if method == "hash_name":
        return [stable_hash(k) % num_servers for k in keys]
    raise ValueError(f"unknown dispatch method {method!r}")


def place_dense(named_shapes: list[tuple[str, tuple[int, ...]]], s: PSStrategy) -> list[VarBlock]:
    parts: list[tuple[str, tuple[int, ...], int, bool, int, int]] = []
    for name, shape in named_shapes:
        ranges = slice_rows(shape, s.num_servers, s.slice_min_elements, s.slice_var_up)
        for i, (a, b) in enumerate(ranges):
            parts.append((name, shape, i, len(ranges) > 1, a, b))
    keys = [f"{n}.block{i}" if sl else n for n, _, i, sl, _, _ in parts]
    servers = dispatch(keys, s.num_servers, s.dispatch)
    return [
        VarBlock(n, sh, i, sl, a, b, srv) for (n, sh, i, sl, a, b), srv in zip(parts, servers, strict=True)
    ]


@dataclass(frozen=True)
class Placement:
    num_servers: int
    dense: list[VarBlock]
    tables: list[ServerTable]
    dense_state_factor: int  # optimizer state tensors per dense element
    sparse_state_factor: int  # per sparse element (Adagrad's accumulator: 1, SGD: 0)

    def blocks_on(self, server: int) -> list[VarBlock]:
        return [b for b in self.dense if b.server == server]

    def server_bytes(self, server: int) -> int:
        """fp32 parameters + optimizer state held by one server (the trainers never hold them)."""
        dense = sum(b.numel for b in self.blocks_on(server)) * (1 + self.dense_state_factor)
        sparse = sum(t.rows_on(server, self.num_servers) * t.width for t in self.tables) * (
            1 + self.sparse_state_factor
        )
        return FP32 * (dense + sparse)

    @property
    def dense_names(self) -> list[str]:
        return list(dict.fromkeys(b.name for b in self.dense))


def table_parameter_names(table_name: str) -> tuple[str, str]:
    """The CTRNet parameters a server table stores side by side (embedding, first-order weight)."""
    return f"embeddings.{table_name}.weight", f"first_order.{table_name}.weight"


def placement(cfg: RunConfig) -> Placement:
    """Placement of a CTR model's variables over the servers of a `strategy=ps` config."""
    s, m = cfg.strategy, cfg.model
    family = family_of(m)
    assert isinstance(s, PSStrategy) and family.sparse_tables and family.parameter_shapes, (
        "placement() needs strategy=ps and a model family with sparse tables (CTR)"
    )
    tables = [
        ServerTable(t.name, t.num_embeddings, family.sparse_row_width(m), i)
        for i, t in enumerate(family.sparse_tables(m))
        if t.distributed
    ]
    remote = {n for t in tables for n in table_parameter_names(t.name)}
    dense = [(n, shape) for n, shape in family.parameter_shapes(m) if n not in remote]
    return Placement(
        num_servers=s.num_servers,
        dense=place_dense(dense, s),
        tables=tables,
        dense_state_factor=optimizer_state_factor(cfg.optim.name, cfg.optim.momentum),
        sparse_state_factor=1 if s.sparse_optimizer == "adagrad" else 0,
    )
