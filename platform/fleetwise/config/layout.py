"""The parallel layout of a job: four resolved degrees and the arithmetic around them.

Mesh order, outermost first: (dp, pp, sharding, mp). Following the 4D-hybrid guide (seeds/001):
tensor parallel (mp) and sharding move the most bytes, so they are innermost and their groups are
consecutive ranks inside one machine; pipeline traffic is light and may cross machines; data
parallel is outermost. A rank's coordinates are therefore
    rank = ((dp_i * pp + pp_i) * sharding + sh_i) * mp + mp_i.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def span(self, dim: str) -> int:
        """How many consecutive ranks one group of `dim` spans (its stride × size).

        A group whose span exceeds the devices of a node crosses the network.
        """
        idx = MESH_DIMS.index(dim)
        span = 1
        for size in self.shape[idx:]:
            span *= size
        return span
