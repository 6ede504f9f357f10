"""The parallel layout of a job: five resolved degrees and all the mesh arithmetic around them
(like torchtitan's ParallelDims): deriving an `auto` degree, the world-size rule, rank
coordinates, the sub-meshes each engine uses and the DeviceMesh itself. The validator, the planner
and the runtime all ask a `Layout`; none of them redoes this arithmetic.

Mesh order, outermost first: (dp, pp, sharding, cp, mp). Following the 4D-hybrid guide (PaddlePaddle
Fleet's hybrid parallel documentation; Narayanan et al., SC'21, section 3): tensor parallel (mp)
and sharding move the most bytes, so they are innermost and their groups are consecutive ranks
inside one machine; pipeline traffic is light and may cross machines; data parallel is outermost.
Context parallelism (cp) moves keys/values (ring) or activations (ulysses) every layer, so it sits
next to mp, outside it (torchtitan's order: pp, dp_replicate, dp_shard, cp, tp). A rank's
coordinates are therefore
    rank = (((dp_i * pp + pp_i) * sharding + sh_i) * cp + cp_i) * mp + mp_i,
the same ranks as before context parallelism when cp = 1.

cp ranks read the same samples (each keeps its chunks of every sequence) and share parameter
shards like data-parallel ranks: FSDP shards over sharding × cp (one flattened dim), DDP
all-reduces over dp × cp.

Nothing here imports torch at module level (the planner must not); `build_mesh` imports it when
a rank calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleetwise.config.problems import Problem
from fleetwise.config.strategy import DEGREE_NAMES, CollectiveStrategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from fleetwise.config.run import RunConfig

MESH_DIMS = ("dp", "pp", "sharding", "cp", "mp")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    sharding: int = 1
    mp: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.sharding * self.cp * self.mp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different samples (dp replicas × sharding group)."""
        return self.dp * self.sharding

    @property
    def sizes(self) -> tuple[int, int, int, int, int]:
        """The size of every dim of MESH_DIMS (cp 1 included)."""
        return (self.dp, self.pp, self.sharding, self.cp, self.mp)

    @property
    def dims(self) -> tuple[str, ...]:
        """The dims of the job's DeviceMesh: MESH_DIMS, less cp when it is 1 (a size-1 dim would make
        a process group per rank for nothing, and the meshes of layouts without cp stay as they were)."""
        return MESH_DIMS if self.cp > 1 else tuple(d for d in MESH_DIMS if d != "cp")

    @property
    def shape(self) -> tuple[int, ...]:
        """The DeviceMesh's shape, one size per name in `dims`."""
        return tuple(n for d, n in zip(MESH_DIMS, self.sizes, strict=True) if d in self.dims)

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def mp_enabled(self) -> bool:
        return self.mp > 1

    @property
    def sharding_enabled(self) -> bool:
        return self.sharding > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def grad_ranks(self) -> int:
        """Ranks holding the same parameters with different gradients: dp × sharding × cp."""
        return self.dp * self.sharding * self.cp

    def as_dict(self) -> dict[str, int]:
        """The degrees by mesh dim name; `cp` only when context parallel (a plan's mesh keeps the
        four keys it always had)."""
        out = {"pp": self.pp, "dp": self.dp, "sharding": self.sharding, "mp": self.mp}
        return out | ({"cp": self.cp} if self.cp > 1 else {})

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank, by the names of `dims` (no "cp" when cp is 1)."""
        out = {}
        for name, size in reversed(list(zip(self.dims, self.shape, strict=True))):
            out[name] = rank % size
            rank //= size
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        """The global rank at mesh coordinates (the inverse of `coords`)."""
        rank = 0
        for name, size in zip(MESH_DIMS, self.sizes, strict=True):
            rank = rank * size + coords.get(name, 0)
        return rank

    def data_rank(self, rank: int) -> int:
        """Which slice of each global batch a rank reads: its index among the ranks that read
        different samples (dp replica × sharding member); mp and pp peers read the same."""
        c = self.coords(rank)
        return c["dp"] * self.sharding + c["sharding"]

    @property
    def fsdp_shard_dims(self) -> tuple[str, ...]:
        """The dims FSDP2 shards over: sharding, and cp beside it (cp ranks hold the same parameters;
        runtime/mesh.py flattens the two into one dim "sharding_cp")."""
        return ("sharding", "cp") if self.cp > 1 else ("sharding",)

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """FSDP2's mesh: replicate across dp, shard across sharding (× cp) (HSDP), or shard only;
        a flattened shard dim is named by its dims joined with "_"."""
        shard = "_".join(self.fsdp_shard_dims)
        return ("dp", shard) if self.dp > 1 else (shard,)

    def grad_sync_dims(self, engine: str) -> tuple[str, ...]:
        """DDP's gradient all-reduce: across dp replicas and cp ranks (each cp rank's gradient is that
        of its chunks' mean loss: their average is the whole sequence's). (ZeRO-1 is no DDP:
        runtime/zero1.py reduce-scatters over `sharding` and all-reduces the shards over `dp`.)"""
        if self.cp == 1:
            return ("dp",)
        return ("dp", "cp") if self.dp > 1 else ("cp",)  # (dp 1: the cp group itself, not a copy of it)

    @property
    def ddp_dim(self) -> str:
        """The dim whose traffic DDP's all-reduce is (the plan's comm entry): cp when it is the group."""
        return "cp" if self.cp > 1 and self.dp == 1 else "dp"

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The job's 4D DeviceMesh, named by MESH_DIMS (called collectively by every rank)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"layout {self.as_dict()} needs {self.world_size} ranks, the job has {dist.get_world_size()}"
            )
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.dims)

    # --- from a config ----------------------------------------------------------------------
    @classmethod
    def of(cls, cfg: RunConfig) -> Layout:
        """The layout of a resolved (validated) collective config."""
        s = cfg.strategy
        assert isinstance(s, CollectiveStrategy)
        return cls(
            dp=int(s.dp_degree),
            pp=int(s.pp_degree),
            sharding=int(s.sharding_degree),
            mp=int(s.mp_degree),
            cp=s.cp_degree,
        )

    @classmethod
    def resolve(cls, strategy: CollectiveStrategy, world_size: int) -> tuple[Layout | None, list[Problem]]:
        """Derive the one `auto` degree (if any) and check sharding × dp × mp × pp × cp = world_size;
        every factor is named in the error (cp_degree is a number: never the derived one)."""
        degrees = {name: strategy.degree(name) for name in DEGREE_NAMES}
        if strategy.cp_degree > 1:
            degrees["cp_degree"] = strategy.cp_degree
        autos = [k for k, v in degrees.items() if v == "auto"]
        fixed = math.prod(v for v in degrees.values() if v != "auto")
        ws = f"world_size({world_size}) = hardware.nodes × hardware.devices_per_node"
        if len(autos) > 1:
            return None, [
                Problem(
                    "strategy",
                    f"{len(autos)} degrees are 'auto' ({', '.join(autos)}); at most one can be derived",
                    f"give all but one of {', '.join('strategy.' + a for a in autos)} a number",
                )
            ]
        if autos:
            name = autos[0]
            if world_size % fixed:
                return None, [
                    Problem(
                        f"strategy.{name}",
                        f"cannot derive {name}: {_fmt_degrees(degrees)} must equal {ws}, "
                        f"but {world_size} is not divisible by {fixed}",
                        f"choose degrees whose product divides {world_size}, or give the job a multiple of "
                        f"{fixed} devices (e.g. hardware.devices_per_node={fixed} with hardware.nodes=1)",
                    )
                ]
            degrees[name] = world_size // fixed
        product = math.prod(int(v) for v in degrees.values())
        if product != world_size:
            non_one = [k for k, v in degrees.items() if v != 1] or ["dp_degree"]
            fix = ", or ".join(
                f"strategy.{k}={world_size // (product // int(degrees[k]))}"
                for k in non_one
                if world_size % (product // int(degrees[k])) == 0
            )
            return None, [
                Problem(
                    "strategy",
                    f"{_fmt_degrees(degrees)} = {product} != {ws} = {world_size}",
                    (f"set {fix}; " if fix else "") + "or set one degree to auto; or change the hardware to "
                    f"{product} devices (e.g. hardware.devices_per_node={product} with hardware.nodes=1)",
                )
            ]
        return cls(
            dp=int(degrees["dp_degree"]),
            pp=int(degrees["pp_degree"]),
            sharding=int(degrees["sharding_degree"]),
            mp=int(degrees["mp_degree"]),
            cp=strategy.cp_degree,
        ), []

    def span(self, dim: str) -> int:
        """How many consecutive ranks one group of `dim` spans (its stride × size).

        A group whose span exceeds the devices of a node crosses the network.
        """
        idx = MESH_DIMS.index(dim)
        span = 1
        for size in self.sizes[idx:]:
            span *= size
        return span


def _fmt_degrees(degrees: dict[str, int | str]) -> str:
    return " × ".join(f"{k}({v})" for k, v in degrees.items())
