"""Expert parallelism (`strategy.ep_degree`): the routed experts of every MoE layer split over
groups of ep_degree data-parallel ranks, the tokens exchanged by all-to-all (models/moe.py
`MoE.exchange`), the experts' gradients reduced over the ranks that hold the same experts.

The mesh: at each pipeline stage and tensor-parallel rank (pp × mp coordinates), the data-parallel
ranks there (sharding_degree × dp_degree, in data-rank order: config/layout.py `data_rank`) as
[data / ep, ep] -- consecutive data ranks form an expert group ("ep"), and the ranks at the same
place of every group hold the same experts ("edp"). One DeviceMesh [pp, mp, edp, ep] over the job
holds them all (its "ep_pp"/"ep_mp" dims are only the frame: nothing communicates over them); context
parallelism is still refused beside ep (config/rules/moe.py).

Pipeline stages: each stage's MoE layers exchange their rows within the stage's expert groups
(every rank of an expert group is at the same stage and micro-batch: the schedule is the same on
every data-parallel rank). Tensor parallelism (mp > 1, without sequence parallelism): the experts
are not split over mp ranks (models/moe.py); each mp rank holds the same tokens, so each mp rank
of an expert group runs the same exchange in a group of its own (the mp rank's "ep"), and its
experts' gradients equal the other mp ranks' -- nothing is reduced over mp.

Each expert weight [E, out, in] becomes a DTensor sharded along the experts over "ep" (on meta,
before allocation): each rank allocates and initialises its E / ep experts only (the slice of the
layout-invariant initial value, models/init.py), the gradient norm and the optimizer see it as
one more mesh (runtime/optim.py groups by mesh), and a checkpoint stores the whole [E, out, in]
tensor in shards (DCP), so it loads into any ep_degree, or none.

Gradients under DDP: DDP averages the dense parameters over all dp ranks and leaves the experts alone
(`ddp_ignore`). An expert's gradient on its rank already sums the contributions of the tokens of
every rank of its group (the all-to-all's backward brought them); `reduce_grads` sums it over
"edp" and divides by dp_degree -- the mean over the data-parallel ranks that DDP takes of a dense
gradient, so every layout computes one process's update.

Under FSDP (sharding_degree > 1, ZeRO-2/3), torchtitan's way: every MoE layer's experts are one
FSDP unit of their own on the "edp" mesh (each block's unit, on the job's FSDP mesh, holds the
rest: router, shared experts, attention), so an expert weight is a DTensor over [edp, ep],
sharded along the experts over "ep" and FSDP-sharded over "edp". FSDP's reduce-scatter over
"edp" sums the experts' gradients and divides by data = sharding × dp (not by edp, its default):
the same mean over the data-parallel ranks as above. FSDP shards the experts along their output
rows (Shard(1); torchtitan does so when edp × ep exceeds the experts), never along the experts
again: Shard(0) over both dims would be a strided placement that the layout-invariant
initialisation (models/init.py) and the checkpoint's resharding would have to interleave.

Without expert parallelism (`expert_placement`) the experts sit in their block's FSDP unit, sharded
over the job's FSDP ranks (sharding × cp). FSDP2's default Shard(0) splits them along the experts:
with more FSDP ranks than experts that is uneven -- Mixtral's 8 experts over 64 ranks left ranks
0-7 one whole expert of every block each (22.6 GB) and ranks 8-63 none. There they are sharded
along their output rows too (Shard(1), as above), evenly on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fleetwise.compat import ddp_ignore, foreach_mul_, local_tensor
from fleetwise.config.layout import Layout
from fleetwise.models.moe import MoE

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def expert_mesh(layout: Layout, ep: int, device_type: str) -> DeviceMesh:
    """[pp, mp, data / ep, ep] over the job's ranks (`expert_ranks`), named ("ep_pp", "ep_mp",
    "edp", "ep"), less the frame's dims of size 1 (a DeviceMesh makes process groups along every
    dim: there, one per rank for nothing) (called collectively by every rank)."""
    ranks = torch.tensor(expert_ranks(layout, ep))
    names = ("ep_pp", "ep_mp", "edp", "ep")
    keep = [i for i, n in enumerate(ranks.shape) if n > 1 or i >= 2]
    ranks = ranks.reshape([ranks.shape[i] for i in keep])
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(names[i] for i in keep))


def expert_ranks(layout: Layout, ep: int) -> list:
    """The global ranks as [pp][mp][edp][ep]: at each pipeline stage and mp rank, the data-parallel
    ranks in data-rank order (dp replica × sharding member), ep consecutive ones to a group."""
    data = layout.sharding * layout.dp

    def rank(p: int, m: int, d: int) -> int:
        return layout.rank_of({"dp": d // layout.sharding, "pp": p, "sharding": d % layout.sharding, "mp": m})

    return [
        [[[rank(p, m, g * ep + i) for i in range(ep)] for g in range(data // ep)] for m in range(layout.mp)]
        for p in range(layout.pp)
    ]


def shard_experts(part: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Make every MoE layer's expert weights DTensors sharded along the experts over mesh["ep"]
    (on meta: nothing allocated) and give the layer its group; the names of those parameters
    (in `part`), which DDP must leave alone."""
    ep_mesh = mesh["ep"]
    names = []
    for mname, module in part.named_modules():
        if not isinstance(module, MoE):
            continue
        module.ep_group = ep_mesh.get_group()
        experts = module.experts
        for attr in EXPERT_WEIGHTS:
            w = getattr(experts, attr)
            sharded = distribute_tensor(w.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(attr, nn.Parameter(sharded, requires_grad=w.requires_grad))
            names.append(f"{mname}.experts.{attr}")
    return names


def fully_shard_experts(part: nn.Module, mesh: DeviceMesh, data: int, **kwargs) -> None:
    """FSDP-shard every MoE layer's experts (already sharded over mesh["ep"]) over mesh["edp"], one
    unit per layer, before the blocks' units take the rest (see the module's doc); `kwargs`: the
    job's other fully_shard arguments (reshard_after_forward, mp_policy, offload_policy)."""
    for module in part.modules():
        if not isinstance(module, MoE):
            continue
        unit = fully_shard(module.experts, mesh=mesh["edp"], shard_placement_fn=_rows, **kwargs)
        # sum over edp, then divide by every data-parallel rank (a plain sum, then a division:
        # gloo has no pre-multiplied sum, and a sum in fp32 neither overflows nor underflows).
        # Not on a size-1 edp (ep_degree = sharding × dp): there torch 2.13's foreach_reduce divides
        # by the factor when it copies the unreduced gradient and again after it (the forced sum's
        # post-division): the experts' gradients came out halved at sharding 2, ep 2. Without the
        # forced sum it divides once (and communicates nothing either way).
        if mesh["edp"].size() > 1:
            unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(float(data))


def _rows(_param: nn.Parameter) -> Shard:
    return Shard(1)


def expert_shard_dim(num_experts: int, rows: int, degree: int) -> int:
    """The dim FSDP shards a routed-expert weight [E, rows, cols] along over `degree` ranks
    without expert parallelism: the rows (1) when there are more ranks than experts and the rows
    split evenly (FSDP2 refuses an uneven Shard(1)); else the experts (0). Dim 0 where it can:
    a Shard(1) weight costs FSDP2 a temporary copy of the gathered weight at each all-gather and
    of the gradient at each reduce-scatter (it regroups the rows), and with ranks ≤ experts dim 0
    leaves no rank empty (even, whole experts when the degree divides them)."""
    return 1 if degree > num_experts and rows % degree == 0 else 0


def expert_placement(block: nn.Module, degree: int) -> Callable[[nn.Parameter], Shard | None] | None:
    """fully_shard's shard_placement_fn for a block whose routed experts it shards over `degree`
    ranks (`expert_shard_dim`); None (FSDP's default Shard(0) for all) when no weight needs dim 1.
    The experts of an expert-parallel job are not the block's (`fully_shard_experts`)."""
    rows = {
        id(w): Shard(1)
        for m in block.modules() if isinstance(m, MoE) and not isinstance(m.experts.w1, DTensor)
        for w in (getattr(m.experts, a) for a in EXPERT_WEIGHTS)
        if expert_shard_dim(w.shape[0], w.shape[1], degree) == 1
    }  # fmt: skip
    if not rows:
        return None
    return lambda param: rows.get(id(param))


def keep_from_ddp(part: nn.Module, names: list[str]) -> None:
    ddp_ignore(part, names)


class ExpertGrads:
    """The experts' gradient reduction of an expert-parallel job (see the module's doc)."""

    def __init__(self, parts: list[nn.Module], mesh: DeviceMesh, dp: int):
        self.params = [
            p for part in parts for m in part.modules() if isinstance(m, MoE)
            for p in m.experts.parameters()
        ]  # fmt: skip
        self.group = mesh["edp"].get_group() if mesh["edp"].size() > 1 else None
        self.dp = dp

    @torch.no_grad()
    def reduce(self) -> None:
        """Sum each expert gradient over the ranks holding the same experts, divide by dp_degree."""
        grads = [local_tensor(p.grad) for p in self.params if p.grad is not None]
        if not grads:
            return
        if self.group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(summed.view_as(g))
        foreach_mul_(grads, 1.0 / self.dp)
