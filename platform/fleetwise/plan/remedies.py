"""When a plan does not fit: try the usual cures and report what each one would need.

Order follows the memory-sources table of PaddlePaddle's 4D hybrid-parallel guide: shard more
state, recompute activations, offload to the host, then split the model further (mp inside a
node, pp across nodes), and finally smaller micro-batches. Each candidate is a real config, validated and planned again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fleetwise.config.layout import Layout
from fleetwise.config.run import RunConfig
from fleetwise.config.strategy import CollectiveStrategy
from fleetwise.config.validate import check, resolve
from fleetwise.families import family_of
from fleetwise.plan.planner import Plan, make_plan

GIB = 1024**3


@dataclass(frozen=True)
class Remedy:
    overrides: str
    total_bytes: int
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return {"overrides": self.overrides, "total_bytes": self.total_bytes, "fits": self.fits}

    def describe(self) -> str:
        return f"{self.overrides} -> {self.total_bytes / GIB:.1f} GiB" + (" (fits)" if self.fits else "")


def _candidates(cfg: RunConfig) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(overrides text, strategy update, train update)."""
    s = cfg.strategy
    assert isinstance(s, CollectiveStrategy)
    lay = Layout.of(cfg)
    if lay.sharding > 1 and (s.sharding_stage or 0) < 3:
        yield f"strategy.sharding_stage={s.sharding_stage + 1}", {"sharding_stage": s.sharding_stage + 1}, {}
    if lay.sharding == 1 and lay.dp > 1:
        yield (
            f"strategy=hybrid strategy.sharding_degree={lay.dp} strategy.dp_degree=1 strategy.sharding_stage=3",
            {"sharding_degree": lay.dp, "dp_degree": 1, "sharding_stage": 3},
            {},
        )
    if s.recompute != "full":
        yield "strategy.recompute=full", {"recompute": "full"}, {}
    if lay.sharding > 1 and not s.offload and cfg.hardware.device_type == "cuda" and s.sharding_stage != 1:
        yield "strategy.offload=true", {"offload": True}, {}
    for dim, donor in (("mp", "dp"), ("mp", "sharding"), ("pp", "dp"), ("pp", "sharding")):
        if dim == "mp" and family_of(cfg.model).tensor_parallel is None:
            continue
        have, give = getattr(lay, dim), getattr(lay, donor)
        if give % 2 == 0:
            update = {f"{dim}_degree": have * 2, f"{donor}_degree": give // 2}
            if donor == "sharding" and give // 2 == 1:
                update["sharding_stage"] = None
            text = " ".join(f"strategy.{k}={v if v is not None else 'null'}" for k, v in update.items())
            yield text, update, {}
    if cfg.train.micro_batch_size > 1:
        mb = cfg.train.micro_batch_size // 2
        yield f"train.micro_batch_size={mb}", {}, {"micro_batch_size": mb, "accumulate_steps": None}


def remedies(cfg: RunConfig, limit: int = 4) -> list[Remedy]:
    """Cheapest ways to make `cfg` fit, each with the memory it would need (fitting ones first)."""
    if not isinstance(cfg.strategy, CollectiveStrategy):
        return []
    found: list[Remedy] = []
    for text, s_update, t_update in _candidates(cfg):
        strategy = cfg.strategy.model_copy(update=s_update)
        if any(k.endswith("_degree") for k in s_update) and cfg.strategy.name != "hybrid":
            strategy = _as_hybrid(strategy)
            text = "strategy=hybrid " + text if "strategy=hybrid" not in text else text
        candidate = cfg.model_copy(
            update={
                "strategy": strategy,
                "train": cfg.train.model_copy(update={"accumulate_steps": None, **t_update}),
            }
        )
        if check(candidate):
            continue
        plan: Plan = make_plan(resolve(candidate))
        found.append(Remedy(text, plan.memory_bytes["total"], plan.fits))
    found.sort(key=lambda r: not r.fits)  # stable: cheapest fitting cure first
    return found[:limit]


def _as_hybrid(strategy: CollectiveStrategy) -> CollectiveStrategy:
    from fleetwise.config.strategy import HybridStrategy

    data = strategy.model_dump()
    data["name"] = "hybrid"
    return HybridStrategy.model_validate(data)
