"""The parameter server (`strategy=ps`): where its variables live, and its plan.

Where variables live (PaddlePaddle Fluid's pserver mode: round_robin / hash_name dispatch,
slice_var_up), as arithmetic on the config: no torch. Shared by the planner (exact bytes per
server) and the runtime (what each server holds), so both always agree.

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

The plan (`ps_plan`): the fullest server's shard and a trainer's dense copy, pulled rows and
activations; per step a trainer pulls the distinct rows of its micro-batches (`expected_unique`
under the data's Zipf law) and the dense parameters, and pushes their gradients back.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from fleetwise.config.engine import optimizer_state_factor
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import PSStrategy
from fleetwise.families import family_of, model_units
from fleetwise.plan.dtypes import FP32
from fleetwise.plan.records import Memory, Plan
from fleetwise.plan.units import Unit


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


# --------------------------------------------------------------------------------------------------
# The plan


def expected_unique(num_rows: int, draws: int, alpha: float) -> float:
    """Expected distinct ids among `draws` samples of a Zipf(alpha) law over `num_rows` ids:
    sum_i 1 - (1 - p_i)^draws. A steep law gives p_1 = 1 exactly: log1p(-1) = -inf, and the term
    is then 1 (every draw is id 1), which is right; numpy's warning about it is not news."""
    import numpy as np

    with np.errstate(divide="ignore"):
        return _expected_unique(np, num_rows, draws, alpha)


def _expected_unique(np, num_rows: int, draws: int, alpha: float) -> float:
    if num_rows <= EXACT_ROWS:
        ranks = np.arange(1, num_rows + 1, dtype=np.float64)
        p = ranks**-alpha
        p /= p.sum()
        return float(np.sum(-np.expm1(draws * np.log1p(-p))))
    # A 10^9-row table would need 7.45 GiB of ranks: the head exactly, the tail in narrow
    # geometric bins (ratio ~1.001 over 10^12 rows) with the probability at each bin's midpoint.
    head = np.arange(1, EXACT_ROWS + 1, dtype=np.float64)
    edges = np.unique(np.geomspace(EXACT_ROWS + 1, num_rows + 1, TAIL_BINS).round())
    counts = np.diff(edges)
    mids = (edges[:-1] + edges[1:] - 1) / 2
    weight_head, weight_tail = head**-alpha, counts * mids**-alpha
    total = weight_head.sum() + weight_tail.sum()
    p_head, p_tail = weight_head / total, mids**-alpha / total
    return float(
        np.sum(-np.expm1(draws * np.log1p(-p_head))) + np.sum(counts * -np.expm1(draws * np.log1p(-p_tail)))
    )


EXACT_ROWS = 1 << 16  # rows summed one by one; beyond, TAIL_BINS bins (a few ms per table)
TAIL_BINS = 20_000


@dataclass(frozen=True)
class SparseRows:
    """The distributed sparse tables, and what a trainer pulls of them per step."""

    rows: int  # rows of all distributed tables
    width: int  # floats per row (the embedding and its first-order weight)
    pulled: float  # expected distinct rows a trainer pulls per step

    @property
    def params(self) -> int:
        return self.rows * self.width


def sparse_rows(cfg: RunConfig) -> SparseRows:
    """A trainer prefetches once per step the distinct rows of all its n micro-batches (parameters
    do not change within a step), so the draws per table are b·n, de-duplicated."""
    m, t = cfg.model, cfg.train
    family = family_of(m)
    draws = t.micro_batch_size * (t.accumulate_steps or 1)
    rows, pulled, width = 0, 0.0, 0
    if family.sparse_tables is not None:
        width = family.sparse_row_width(m)
        for table in family.sparse_tables(m):
            if table.distributed:
                rows += table.num_embeddings
                pulled += expected_unique(table.num_embeddings, draws, cfg.data.zipf_alpha)
    return SparseRows(rows, width, pulled)


def bytes_per_server(cfg: RunConfig, dense_params: float, sparse_params: int) -> list[int]:
    """Exact bytes of each server's shard, following the dispatch and slicing rules (an even split
    where the family does not name its parameters' shapes)."""
    s = cfg.strategy
    assert isinstance(s, PSStrategy)
    if family_of(cfg.model).parameter_shapes is not None:
        place = placement(cfg)
        return [place.server_bytes(i) for i in range(s.num_servers)]
    k = optimizer_state_factor(cfg.optim.name, cfg.optim.momentum)
    sparse_k = 1 if s.sparse_optimizer == "adagrad" else 0
    even = (FP32 * dense_params * (1 + k) + FP32 * sparse_params * (1 + sparse_k)) / s.num_servers
    return [int(even)] * s.num_servers


@dataclass(frozen=True)
class TrainerStep:
    """What one trainer moves and computes per step."""

    pull: float  # bytes of values pulled
    push: float  # bytes of gradients pushed, with their row ids (int64), the ids also sent once
    compute: float  # seconds
    comm: float  # seconds

    @property
    def step(self) -> float:
        return self.compute + self.comm


def trainer_step(cfg: RunConfig, dense_params: float, sparse: SparseRows, fwd_flops: float) -> TrainerStep:
    """Two round trips per step, to all servers in parallel: async pull + push; sync push (stage)
    + commit, whose reply prefetches the next step's values."""
    t, hw = cfg.train, cfg.hardware
    pull = FP32 * (dense_params + sparse.pulled * sparse.width)
    push = FP32 * (dense_params + sparse.pulled * sparse.width) + 2 * 8 * sparse.pulled
    peak = hw.peak_flops(t.precision)
    compute = (t.accumulate_steps or 1) * t.micro_batch_size * 3 * fwd_flops / (peak * hw.matmul_efficiency)
    comm = (pull + push) / (hw.intra_node_gbps * 1e9) + 2 * hw.comm_latency_us * 1e-6
    return TrainerStep(pull, push, compute, comm)


@dataclass(frozen=True)
class TrainerMemory:
    """A trainer's bytes: its dense parameters and their gradients, the rows it pulled and their
    gradients, one micro-batch's activations and all its micro-batches' inputs."""

    dense: float  # the dense parameters (their gradients as many)
    pulled: float  # the pulled rows' values (their gradients as many)
    activations: float
    inputs: float

    @property
    def total(self) -> float:
        return self.dense * 2 + self.pulled * 2 + self.activations + self.inputs


def trainer_memory(
    cfg: RunConfig, units: list[Unit], dense_params: float, sparse: SparseRows
) -> TrainerMemory:
    """A trainer's bytes, for the model's `units` (no recompute: it runs whole micro-batches)."""
    m, t = cfg.model, cfg.train
    n, b = t.accumulate_steps or 1, t.micro_batch_size
    acts = sum(u.saved("none").total for u in units) * b * FP32
    inputs = n * b * family_of(m).input_bytes(m)  # a trainer loads all its micro-batches of the step
    return TrainerMemory(FP32 * dense_params, FP32 * sparse.pulled * sparse.width, acts, inputs)


def ps_memory(trainer: TrainerMemory, server_bytes: int) -> Memory:
    """The worst device: the fullest server, or a trainer."""
    mem = Memory(
        params=trainer.dense,
        grads=trainer.dense,
        optimizer=0.0,
        activations=trainer.activations + trainer.pulled * 2,
        inputs=trainer.inputs,
        total=max(server_bytes, trainer.total),
    )
    if server_bytes >= trainer.total:
        mem.peak = {"phase": "the fullest server", "parts": {"server_shard": server_bytes}}
    else:
        parts = {
            "params": mem.params,
            "grads": mem.grads,
            "activations": mem.activations,
            "inputs": mem.inputs,
        }
        mem.peak = {"phase": "a trainer", "parts": parts}
    return mem


def ps_plan(cfg: RunConfig) -> Plan:
    """The plan of a `strategy=ps` job: its worst device (a server or a trainer), a trainer's
    traffic and step, and the servers' shards (`plan.ps`)."""
    s, t, hw = cfg.strategy, cfg.train, cfg.hardware
    assert isinstance(s, PSStrategy)
    n, b = t.accumulate_steps or 1, t.micro_batch_size
    units = model_units(cfg.model)
    params = sum(u.params for u in units)
    sparse = sparse_rows(cfg)
    dense_params = params - sparse.params
    per_server = bytes_per_server(cfg, dense_params, sparse.params)
    server_bytes = max(per_server)
    trainer = trainer_memory(cfg, units, dense_params, sparse)
    mem = ps_memory(trainer, server_bytes)
    flops_per_step = t.global_batch_size * 3 * sum(u.fwd_flops for u in units)
    peak = hw.peak_flops(t.precision)
    work = trainer_step(cfg, dense_params, sparse, sum(u.fwd_flops for u in units))
    step = work.step
    usable = hw.memory_per_device_bytes - hw.device_overhead_bytes
    return Plan(
        world_size=s.num_servers + s.num_trainers,
        mesh={"pp": 1, "dp": s.num_trainers, "sharding": 1, "mp": 1},
        params=int(params),
        batch={
            "global_batch_size": t.global_batch_size,
            "micro_batch_size": b,
            "accumulate_steps": n,
            "num_microbatches": n,
        },
        memory_bytes=mem.as_ints(),
        memory_peak=mem.peak_ints(),
        device_memory_bytes=hw.memory_per_device_bytes,
        fits=mem.total <= usable,
        device_overhead_bytes=hw.device_overhead_bytes,
        usable_memory_bytes=usable,
        flops_per_step=float(flops_per_step),
        bubble_fraction=0.0,
        step_time_s=step,
        mfu=flops_per_step / (step * s.num_trainers * peak) if step else 0.0,
        device_peak_flops=peak,
        engine="ps",
        precision=t.precision,
        samples_per_s=t.global_batch_size / step if step else 0.0,
        comm_bytes_per_step={"pull": int(work.pull), "push": int(work.push)},
        time_s={"compute": work.compute, "comm_ps": work.comm},
        ps={
            "num_servers": s.num_servers,
            "num_trainers": s.num_trainers,
            "dense_params": int(dense_params),
            "sparse_rows": int(sparse.rows),
            "sparse_params": int(sparse.params),
            "server_bytes": int(server_bytes),
            "server_bytes_per_server": per_server,
            "trainer_bytes": int(trainer.total),
            "rows_pulled_per_step": sparse.pulled,
            "sparse_bytes_pulled_per_step": int(FP32 * sparse.pulled * sparse.width),
            "sparse_table_bytes": int(FP32 * sparse.params),
        },
    )
