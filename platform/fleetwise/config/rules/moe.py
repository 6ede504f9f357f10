"""Rules of a mixture of experts (`model.moe`, fleetwise.families.moe) against the rest of the
config: what the engine cannot combine with experts yet, each with what to do instead. The
section's own rules (top_k against num_experts, …) are the family's (`check_moe`, through
rules/model.py).

Tensor parallelism of the experts is not done: mp_degree > 1 with experts is refused (shard the
experts with sharding_degree instead: FSDP splits each [experts, out, in] weight along the experts).
"""

from __future__ import annotations

from collections.abc import Iterator

from fleetwise.config.problems import Problem
from fleetwise.config.rules.context import Context, rule


def _experts(ctx: Context) -> int:
    moe = getattr(ctx.cfg.model, "moe", None)
    return moe.num_experts if moe is not None else 0


@rule
def moe_combinations(ctx: Context) -> Iterator[Problem]:
    e = _experts(ctx)
    if not e:
        return
    experts = f"model.moe.num_experts={e}"
    lay, s = ctx.layout, ctx.collective
    mp = lay.mp if lay is not None else (s.mp_degree if s is not None and isinstance(s.mp_degree, int) else 1)
    if mp > 1:
        yield Problem(
            "strategy.mp_degree",
            f"mp_degree={mp} with {experts}: fleetwise does not split experts over tensor-parallel ranks",
            "set strategy.mp_degree=1 and shard the experts with strategy.sharding_degree (FSDP splits "
            "each expert weight along the experts), or use data/pipeline parallelism",
        )
    if ctx.cfg.train.compile:
        yield Problem(
            "train.compile",
            f"train.compile=true with {experts}: the MoE layer's per-step counts and its expert loop "
            "break torch.compile's full graph of a block",
            "set train.compile=false",
        )
    if getattr(ctx.cfg.model, "init_from", None):
        yield Problem(
            "model.init_from",
            f"model.init_from with {experts}: fleetwise reads Hugging Face weights of dense models only",
            "train the mixture of experts from scratch (model.init_from=null), or set model.moe.num_experts=0",
        )
