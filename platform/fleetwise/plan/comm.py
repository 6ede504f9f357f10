"""Communication: the bytes and collective calls one device makes per step, per mesh dimension
(dp, sharding, mp, pp), and their time.

Ring collectives (Thakur et al. 2005): an all-reduce moves 2(n-1)/n of the buffer per device, an
all-gather and a reduce-scatter (n-1)/n. What each engine runs per step:
- DDP: one all-reduce of the gradients (no_sync while accumulating).
- ZeRO-1 (runtime/zero1.py): per bucket a reduce-scatter of the fp32 gradients and an all-gather
  of the updated working weights over `sharding` (all-reduces on gloo), an all-reduce of the
  gradient shard over `dp`.
- FSDP: per unit an all-gather of its parameters (again for the backward under ZeRO-3) and a
  reduce-scatter of its gradients over `sharding`, an all-reduce of the shards over `dp` (HSDP).
- Tensor parallel: the DTensor plans' all-reduces (or all-gather + reduce-scatter pairs under
  sequence parallelism) of each block, the embedding and the head (`mp_traffic`).
- Pipeline: each micro-batch's boundary activation forward and its gradient back.
- Context parallel (a "cp" entry, only when cp > 1): the ring's point-to-point steps (K/V forward,
  K/V and dK/dV backward) or ulysses' all-to-alls of every layer (plan/context_parallel.py; the
  ring's steps partly hidden behind its blocks' attention on GPUs: `cp_hidden_seconds`); DDP's
  all-reduce spans dp × cp and FSDP's collectives sharding × cp.
A call costs the profile's latency, its bytes the profile's bandwidth (inter-node where the
dimension's groups span nodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from fleetwise.config.engine import ZERO1_BUCKET_ELEMENTS, Engine, reshard_after_forward
from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import CollectiveStrategy
from fleetwise.families import family_of
from fleetwise.plan.chunks import block_recomputes, rank_units
from fleetwise.plan.context_parallel import cp_traffic, ring_hidden_seconds
from fleetwise.plan.dtypes import FP32, activation_bytes, compute_bytes
from fleetwise.plan.units import Unit

DIMS = ("dp", "sharding", "mp", "pp")


@dataclass(slots=True)
class Comm:
    """One device's traffic per step, per mesh dimension (the worst pipeline rank's)."""

    bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIMS, 0.0))  # bytes it sends
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIMS, 0))  # collective calls
    # the bytes' cost in all-reduce bytes (what moves at the profile's all-reduce bandwidth in the
    # same time), where it differs from `bytes`: the backend's reduce-scatter or all-gather is
    # slower per byte of ring volume than its all-reduce (`reduce_scatter_gbps`, `all_gather_gbps`:
    # gloo's reduce-scatter costs more than its all-reduce of the same buffer; NCCL's do not differ)
    cost: dict[str, float] = field(default_factory=lambda: {"sharding": 0.0})

    def costs(self) -> dict[str, float]:
        """The cost of every dimension (its bytes where no other cost is given)."""
        return {dim: self.cost.get(dim, v) for dim, v in self.bytes.items()}


class Traffic(NamedTuple):
    bytes: float
    calls: int


class FsdpCollectives(NamedTuple):
    gathers: int  # all-gathers of each FSDP unit per step
    scatters: int  # reduce-scatters of each FSDP unit per step


def fsdp_collectives(s: CollectiveStrategy, layout: Layout, n: int) -> FsdpCollectives:
    """All-gathers and reduce-scatters of each FSDP unit per step. Under a pipeline FSDP gathers
    once before the first micro-batch and reduce-scatters once after the last; without one every
    micro-batch gathers (twice under ZeRO-3: again for its backward) and reduce-scatters."""
    if layout.pp > 1:
        return FsdpCollectives(1, 1)
    return FsdpCollectives((2 if reshard_after_forward(s.sharding_stage) else 1) * n, n)


# --------------------------------------------------------------------------------------------------
# dp and sharding: the engine's gradient and parameter traffic


def data_parallel_comm(
    cfg: RunConfig, layout: Layout, p: float, n: int, engine: Engine, n_units: int
) -> Comm:
    """Bytes and calls of the dp and sharding dimensions for a device holding `p` parameters in
    `n_units` FSDP units (the mp and pp entries stay 0)."""
    comm = Comm()
    if engine == Engine.DDP:
        dp = layout.dp * layout.cp  # DDP all-reduces over dp × cp (config/layout.py grad_sync_dims)
        dim = layout.ddp_dim  # (the cp group when dp is 1)
        comm.bytes[dim] = (
            2 * (dp - 1) / dp * (FP32 * p)
        )  # one all-reduce per step (no_sync while accumulating)
        comm.calls[dim] = 1
    elif engine == Engine.ZERO1:
        _zero1_comm(comm, cfg, layout, p)
    elif engine == Engine.FSDP:
        _fsdp_comm(comm, cfg, layout, p, n, n_units)
    return comm


def _relative_costs(cfg: RunConfig) -> tuple[float, float]:
    """Cost per byte of a reduce-scatter and of an all-gather, relative to an all-reduce's."""
    hw = cfg.hardware
    rs = hw.intra_node_gbps / (hw.reduce_scatter_gbps or hw.intra_node_gbps)
    ag = hw.intra_node_gbps / (hw.all_gather_gbps or hw.intra_node_gbps)
    return rs, ag


def _zero1_comm(comm: Comm, cfg: RunConfig, layout: Layout, p: float) -> None:
    """Per bucket: reduce-scatter of the fp32 gradients, all-gather of the updated working weights
    (16-bit under mixed precision), all-reduce of the gradient shard across dp."""
    dp, sh = layout.dp, layout.sharding
    grad_bytes, gather = FP32 * p, compute_bytes(cfg.train.precision)
    rs, ag = _relative_costs(cfg)
    buckets = max(1, math.ceil(p / ZERO1_BUCKET_ELEMENTS))
    if cfg.hardware.backend == "gloo":  # all-reduces instead: gloo's reduce-scatter and all-gather are slower
        comm.bytes["sharding"] = comm.cost["sharding"] = 2 * (sh - 1) / sh * (grad_bytes + gather * p)
    else:
        comm.bytes["sharding"] = (sh - 1) / sh * (grad_bytes + gather * p)
        comm.cost["sharding"] = (sh - 1) / sh * (rs * grad_bytes + ag * gather * p)
    # + the all-reduce of the gradient chunks' squared norm (runtime/optim.py: zero_grad_norm)
    comm.calls["sharding"] = 2 * buckets + 1 if sh > 1 else 0
    comm.bytes["dp"] = 2 * (dp - 1) / dp * grad_bytes / sh
    comm.calls["dp"] = buckets if dp > 1 else 0


def _fsdp_comm(comm: Comm, cfg: RunConfig, layout: Layout, p: float, n: int, n_units: int) -> None:
    """Per unit its all-gathers and reduce-scatters (`fsdp_collectives`) over sharding; the
    all-reduce of the shards across dp replicas (HSDP)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    dp, sh = layout.dp, layout.sharding * layout.cp  # FSDP shards over sharding × cp
    grad_bytes, gather = FP32 * p, compute_bytes(cfg.train.precision)
    rs, ag = _relative_costs(cfg)
    gathers_per_step, scatters = fsdp_collectives(s, layout, n)
    comm.bytes["sharding"] = (sh - 1) / sh * (gathers_per_step * gather * p + scatters * grad_bytes)
    comm.cost["sharding"] = (sh - 1) / sh * (ag * gathers_per_step * gather * p + rs * scatters * grad_bytes)
    # + the gradient norm's all-reduce of the shards' squared norms (DTensor's full_tensor)
    comm.calls["sharding"] = (gathers_per_step + scatters) * n_units + 1 if sh > 1 else 0
    comm.bytes["dp"] = 2 * (dp - 1) / dp * grad_bytes / sh  # HSDP: all-reduce of the shards across replicas
    comm.calls["dp"] = n_units if dp > 1 else 0


# --------------------------------------------------------------------------------------------------
# mp: tensor parallelism


def mp_traffic(
    cfg: RunConfig,
    layout: Layout,
    units: list[Unit],
    n: int,
    engine: Engine,
    recomputes: dict[int, int] | None = None,
) -> Traffic:
    """Tensor-parallel bytes a device sends per step, and calls, for its `units` (the DTensor plans
    of models/tp_plan.py, counted in the dry run's collectives). Per (seq, hidden) all-reduce of a
    block (`mp_allreduces`): forward, the row-parallel output (matmul dtype); backward, the
    column-parallel input's gradient (residual-stream dtype: autocast casts inside the linear).
    With sequence parallelism each becomes an all-gather + reduce-scatter pair of half the bytes
    each (forward: gather the norm output, scatter the partial sum; backward the reverse). The
    embedding's vocabulary-parallel output is all-reduced in forward (and, split along the
    sequence, gathered in backward); the column-parallel head all-reduces its input gradient
    (sequence parallel: gathers its input, scatters the gradient). Full recompute re-runs a
    block's forward collectives (`recomputes` times: block_recomputes)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    mp, b, sp = layout.mp, cfg.train.micro_batch_size, s.sequence_parallel
    act, residual = activation_bytes(cfg.train.precision, engine, family_of(cfg.model).convolutional)
    half = (mp - 1) / mp  # an all-gather's or a reduce-scatter's share of the full tensor
    hidden = max((u.boundary_elements for u in units), default=0.0)
    tally = _Tally()
    tokens = 1 / layout.cp if layout.cp > 1 else 1  # a cp rank's share of every sample's tokens
    for u in units:
        size = b * (u.boundary_elements or hidden) * tokens
        if u.kind == "block":
            again = (recomputes or {}).get(id(u), 1)
            k = _block_mp(tally, u, s.recompute, sp, half, act, residual, size, again)
        elif u.kind == "embedding":
            k = u.mp_allreduces * (2 if sp else 1)
            tally.bytes += u.mp_allreduces * (2 + sp) * half * residual * size
        elif u.kind == "head":
            k = 2 if sp else 1
            tally.bytes += 2 * half * residual * size
        else:
            k = 0
        tally.calls += k * (2 if sp and u.kind == "block" else 1)
    if sp and engine in (Engine.FSDP, Engine.ZERO1):
        # the norms' replicated weights see one sequence shard, so their gradient is a partial
        # sum: FSDP and ZeRO-1 take each micro-batch's gradient at once and all-reduce it over mp
        # first (in the parameters' dtype: 16-bit under mixed precision). The embedding's
        # replicated weights (positions) get a whole gradient: its output is all-reduced.
        grad_bytes = compute_bytes(cfg.train.precision)
        tally.bytes += 2 * half * grad_bytes * sum(u.params_whole for u in units if u.kind != "embedding")
    return Traffic(n * tally.bytes, int(n * tally.calls))


@dataclass(slots=True)
class _Tally:
    bytes: float = 0.0
    calls: float = 0.0


def _block_mp(
    tally: _Tally,
    u: Unit,
    recompute: str,
    sp: bool,
    half: float,
    act: int,
    residual: int,
    size: float,
    again: int,
) -> float:
    """Adds a block's tensor-parallel bytes to `tally`; returns its calls (pairs under SP)."""
    k = 2 * u.mp_allreduces
    tally.bytes += u.mp_allreduces * 2 * half * (act + residual) * size
    if recompute == "full":
        # torch's checkpoint stops recomputing once the saved tensors are back: a pre-LN
        # block's fc2 (`recompute_skipped_flops`) and its all-reduce / reduce-scatter are
        # not re-run; the gathers before attention and MLP are
        sums = u.mp_allreduces - (1 if u.recompute_skipped_flops else 0)
        tally.bytes += again * (
            (half * (u.mp_allreduces * residual + sums * act) if sp else 2 * half * sums * act) * size
        )
        k += again * sums
    elif recompute == "selective" and sp:
        # the recompute gathers the norms' outputs again (as Megatron does); the
        # reduce-scatters' outputs are kept (runtime/recompute.py)
        tally.bytes += again * u.mp_allreduces * half * residual * size
        k += again * u.mp_allreduces / 2  # one call each (k counts pairs under SP)
    return k


# --------------------------------------------------------------------------------------------------
# pp, and every dimension together


def pp_bytes_of_rank(
    chunks: list[list[Unit]], ranks: list[int], rank: int, n: int, b: int, residual: float
) -> float:
    """Bytes pipeline rank `rank` sends per step: each micro-batch's activations to the next chunk
    (all but the last chunk) and its input gradients to the previous one (all but the first), where
    that chunk is on another rank (ZB-V's rank pp-1 hands its middle boundary to itself; gpt/tiny
    pp 2 rank 1 was +100%)."""
    out = 0.0
    for c, owner in enumerate(ranks):
        if owner != rank:
            continue
        if c < len(chunks) - 1 and ranks[c + 1] != rank:
            out += n * b * chunks[c][-1].boundary_elements * residual
        if c > 0 and ranks[c - 1] != rank:
            out += n * b * chunks[c - 1][-1].boundary_elements * residual
    return out


def collective_comm(
    cfg: RunConfig,
    layout: Layout,
    chunks: list[list[Unit]],
    ranks: list[int],
    p: float,
    n: int,
    engine: Engine,
) -> Comm:
    """One device's traffic per step, per mesh dimension, on the pipeline rank holding the most
    parameters (`p` its parameters)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    units_per_rank: list[list[Unit]] = [[] for _ in range(layout.pp)]  # one pass (a search plans thousands)
    for c, r in enumerate(ranks):
        units_per_rank[r].extend(chunks[c])
    worst_units = max(units_per_rank, key=lambda us: sum(u.params for u in us))
    mp, pp = layout.mp, layout.pp
    experts = sum(u.expert_params for u in worst_units) / s.ep_degree if s.ep_degree > 1 else 0.0
    comm = data_parallel_comm(cfg, layout, p - experts, n, engine, max(1, len(worst_units)))
    if experts:
        comm.bytes["edp"], comm.calls["edp"] = edp_traffic(cfg, layout, experts, n, engine, worst_units)
    if mp > 1:
        again = block_recomputes(s.schedule, pp, chunks)
        comm.bytes["mp"], comm.calls["mp"] = mp_traffic(cfg, layout, worst_units, n, engine, again)
    if s.ep_degree > 1:
        comm.bytes["ep"], comm.calls["ep"] = ep_traffic(cfg, s.ep_degree, worst_units, n)
    if layout.cp > 1:  # (a "cp" entry only then: plans without context parallelism keep their keys)
        layers = cfg.model.num_layers if s.recompute == "full" else 0
        cp_bytes, cp_calls = cp_traffic(cfg, layout, n, recomputes=layers)
        comm.bytes["cp"] = comm.bytes.get("cp", 0.0) + cp_bytes
        comm.calls["cp"] = comm.calls.get("cp", 0) + cp_calls
    if pp > 1:
        residual = activation_bytes(cfg.train.precision, engine, family_of(cfg.model).convolutional).residual
        local_chunks = max(1, len(chunks) // pp)
        boundary = max((u.boundary_elements for u in worst_units), default=0.0)
        # activations forward, gradients back (under sequence parallelism: the sequence shard)
        b = cfg.train.micro_batch_size
        comm.bytes["pp"] = n * local_chunks * 2 * b * boundary * residual / (mp if s.sequence_parallel else 1)
        if layout.cp > 1:  # a stage passes this cp rank's chunks
            comm.bytes["pp"] /= layout.cp
        comm.calls["pp"] = n * local_chunks * 2
    return comm


def edp_traffic(
    cfg: RunConfig, layout: Layout, experts: float, n: int, engine: Engine, units: list[Unit]
) -> Traffic:
    """The experts' data-parallel traffic (runtime/expert_parallel.py): their gradients (`experts`
    elements on this rank, E / ep) reduced over the edp = sharding × dp / ep ranks holding the same
    experts -- under DDP one fp32 all-reduce per step (ExpertGrads); under FSDP each MoE layer's
    experts a unit of their own over edp, gathered and reduce-scattered like every unit."""
    s = cfg.strategy
    edp = layout.sharding * layout.dp // s.ep_degree
    if edp == 1:
        return Traffic(0.0, 0)
    if engine == Engine.DDP:
        return Traffic(2 * (edp - 1) / edp * FP32 * experts, 1)
    gathers_per_step, scatters = fsdp_collectives(s, layout, n)
    gathered = gathers_per_step * compute_bytes(cfg.train.precision) * experts
    blocks = sum(1 for u in units if u.expert_params)
    return Traffic(
        (edp - 1) / edp * (gathered + scatters * FP32 * experts), (gathers_per_step + scatters) * blocks
    )


def ep_traffic(cfg: RunConfig, ep: int, units: list[Unit], n: int) -> Traffic:
    """Bytes a device sends per step in its experts' all-to-alls (models/moe.py `MoE.exchange`),
    and calls. Per MoE block and micro-batch, b · tokens · top_k rows of `hidden` elements (the
    unit's exchange_elements per sample) go out to the experts' ranks and come back, forward, and
    their gradients the same two ways backward -- four exchanges (six under full recompute, which
    runs the forward's two again); under balanced routing (ep - 1) / ep of the rows leave the rank.
    Rows travel in the compute dtype. Calls: three collectives per forward (the counts, the rows
    out and back), two per backward."""
    s = cfg.strategy
    rows = compute_bytes(cfg.train.precision)
    again = 1 if s.recompute == "full" else 0
    per_sample = sum(u.exchange_elements for u in units)
    blocks = sum(1 for u in units if u.exchange_elements)
    sent = n * cfg.train.micro_batch_size * per_sample * rows * (4 + 2 * again) * (ep - 1) / ep
    return Traffic(sent, n * blocks * (5 + 3 * again))


def stage_comm_bytes(
    cfg: RunConfig,
    layout: Layout,
    chunks: list[list[Unit]],
    ranks: list[int],
    p: float,
    rank: int,
    n: int,
    engine: Engine,
    again: dict[int, int] | None = None,
) -> dict[str, int]:
    """Bytes a device of pipeline rank `rank` sends per step, by mesh dimension: gradient and
    parameter traffic for its own parameters `p`, pipeline traffic for its own chunks. `again`:
    block_recomputes of the chunks, when the caller has it."""
    units = rank_units(chunks, ranks, rank)
    ep = cfg.strategy.ep_degree
    experts = sum(u.expert_params for u in units) / ep if ep > 1 else 0.0
    vol = data_parallel_comm(cfg, layout, p - experts, n, engine, 1).bytes
    if experts:  # (as collective_comm: the experts' gradients over edp, and their rows over ep)
        vol["edp"] = edp_traffic(cfg, layout, experts, n, engine, units).bytes
        vol["ep"] = ep_traffic(cfg, ep, units, n).bytes
    if layout.cp > 1:
        vol["cp"] = (
            vol.get("cp", 0.0)
            + cp_traffic(cfg, layout, n, cfg.model.num_layers if cfg.strategy.recompute == "full" else 0)[0]
        )
    residual = activation_bytes(cfg.train.precision, engine, family_of(cfg.model).convolutional).residual
    # under sequence parallelism a stage sends its output's sequence shard
    residual /= layout.mp if cfg.strategy.sequence_parallel else 1
    residual /= layout.cp if layout.cp > 1 else 1  # (and this cp rank's chunks)
    vol["pp"] = pp_bytes_of_rank(chunks, ranks, rank, n, cfg.train.micro_batch_size, residual)
    if layout.mp > 1:
        again = again if again is not None else block_recomputes(cfg.strategy.schedule, layout.pp, chunks)
        vol["mp"] = mp_traffic(cfg, layout, units, n, engine, again).bytes
    return {d: int(v) for d, v in vol.items()}


# --------------------------------------------------------------------------------------------------
# time


def bandwidth(cfg: RunConfig, layout: Layout, dim: str) -> float:
    """Bytes per second of a mesh dimension's links: inter-node where its groups span nodes."""
    hw = cfg.hardware
    crosses = _span(cfg, layout, dim) > hw.devices_per_node and hw.nodes > 1
    return (hw.inter_node_gbps if crosses else hw.intra_node_gbps) * 1e9


def _span(cfg: RunConfig, layout: Layout, dim: str) -> int:
    """Consecutive ranks one group of `dim` spans; an expert group ("ep") is ep_degree consecutive
    data-parallel ranks, and the ranks holding the same experts ("edp") one of every group: all
    sharding × dp of them (runtime/expert_parallel.py; only sharding and dp exceed 1 beside it)."""
    if dim == "ep":
        return cfg.strategy.ep_degree
    return layout.sharding * layout.dp if dim == "edp" else layout.span(dim)


def latency(cfg: RunConfig, layout: Layout, dim: str) -> float:
    """Seconds of fixed cost per collective call of a mesh dim: hardware.inter_node_latency_us when
    its groups span nodes (and it is set), else comm_latency_us."""
    hw = cfg.hardware
    crosses = _span(cfg, layout, dim) > hw.devices_per_node and hw.nodes > 1
    if crosses and hw.inter_node_latency_us is not None:
        return hw.inter_node_latency_us * 1e-6
    return hw.comm_latency_us * 1e-6


def comm_seconds(cfg: RunConfig, layout: Layout, comm: Comm) -> dict[str, float]:
    """Seconds of each dimension's traffic: its cost over the bandwidth plus a latency per call,
    stretched by the ranks sharing a core."""
    bw = {dim: bandwidth(cfg, layout, dim) for dim in comm.bytes}
    cost = comm.costs()
    return {
        dim: (cost[dim] / bw[dim] + comm.calls[dim] * latency(cfg, layout, dim)) * cfg.hardware.ranks_per_core
        for dim in comm.bytes
    }


def cp_hidden_seconds(cfg: RunConfig, layout: Layout, n: int) -> float:
    """Seconds of the ring's point-to-point steps hidden behind its blocks' attention, per step, at
    the cp dimension's bandwidth and latency (plan/context_parallel.py ring_hidden_seconds)."""
    if layout.cp == 1:
        return 0.0
    recomputes = cfg.model.num_layers if cfg.strategy.recompute == "full" else 0
    return ring_hidden_seconds(
        cfg, layout, n, bandwidth(cfg, layout, "cp"), latency(cfg, layout, "cp"), recomputes
    )
