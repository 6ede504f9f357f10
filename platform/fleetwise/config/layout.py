"""The parallel layout of a job: four resolved degrees and all the mesh arithmetic around them
(like torchtitan's ParallelDims): deriving an `auto` degree, the world-size rule, rank
coordinates, the sub-meshes each engine uses and the DeviceMesh itself. The validator, the planner
and the runtime all ask a `Layout`; none of them redoes this arithmetic.

Mesh order, outermost first: (dp, pp, sharding, mp). Following the 4D-hybrid guide (PaddlePaddle
Fleet's hybrid parallel documentation; Narayanan et al., SC'21, section 3): tensor parallel (mp)
and sharding move the most bytes, so they are innermost and their groups are consecutive ranks
inside one machine; pipeline traffic is light and may cross machines; data parallel is outermost.
A rank's coordinates are therefore
    rank = ((dp_i * pp + pp_i) * sharding + sh_i) * mp + mp_i.

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

MESH_DIMS = ("dp", "pp", "sharding", "mp")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    sharding: int = 1
    mp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.sharding * self.mp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different samples (dp replicas × sharding group)."""
        return self.dp * self.sharding

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.dp, self.pp, self.sharding, self.mp)

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

    def as_dict(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "sharding": self.sharding, "mp": self.mp}

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank."""
        out = {}
        for name, size in reversed(list(zip(MESH_DIMS, self.shape, strict=True))):
            out[name] = rank % size
            rank //= size
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        """The global rank at mesh coordinates (the inverse of `coords`)."""
        rank = 0
        for name, size in zip(MESH_DIMS, self.shape, strict=True):
            rank = rank * size + coords.get(name, 0)
        return rank

    def data_rank(self, rank: int) -> int:
        """Which slice of each global batch a rank reads: its index among the ranks that read
        different samples (dp replica × sharding member); mp and pp peers read the same."""
        c = self.coords(rank)
        return c["dp"] * self.sharding + c["sharding"]

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """FSDP2's mesh: replicate across dp, shard across sharding (HSDP), or shard only."""
        return ("dp", "sharding") if self.dp > 1 else ("sharding",)

    @staticmethod
    def grad_sync_dims(engine: str) -> tuple[str, ...]:
        """DDP's gradient all-reduce: across dp replicas. (ZeRO-1 is no DDP: runtime/zero1.py
        reduce-scatters over `sharding` and all-reduces the shards over `dp` itself.)"""
        return ("dp",)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The job's 4D DeviceMesh, named by MESH_DIMS (called collectively by every rank)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"layout {self.as_dict()} needs {self.world_size} ranks, the job has {dist.get_world_size()}"
            )
        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)

    # --- from a config ----------------------------------------------------------------------
    @classmethod
    def of(cls, cfg: RunConfig) -> Layout:
        """The layout of a resolved (validated) collective config."""
        s = cfg.strategy
        assert isinstance(s, CollectiveStrategy)
        return cls(
            dp=int(s.dp_degree), pp=int(s.pp_degree), sharding=int(s.sharding_degree), mp=int(s.mp_degree)
        )

    @classmethod
    def resolve(cls, strategy: CollectiveStrategy, world_size: int) -> tuple[Layout | None, list[Problem]]:
        """Derive the one `auto` degree (if any) and check sharding × dp × mp × pp = world_size;
        every factor is named in the error."""
        degrees = {name: strategy.degree(name) for name in DEGREE_NAMES}
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
        ), []

    def span(self, dim: str) -> int:
        """How many consecutive ranks one group of `dim` spans (its stride × size).

        A group whose span exceeds the devices of a node crosses the network.
        """
        idx = MESH_DIMS.index(dim)
        span = 1
        for size in self.shape[idx:]:
            span *= size
        return span


def _fmt_degrees(degrees: dict[str, int | str]) -> str:
    return " × ".join(f"{k}({v})" for k, v in degrees.items())
