"""Rules of a mixture of experts (`model.moe`, fleetwise.families.moe) against the rest of the
config: what the engine cannot combine with experts yet, each with what to do instead. The
section's own rules (top_k against num_experts, …) are the family's (`check_moe`, through
rules/model.py).

Tensor parallelism with experts (mp_degree > 1): the experts are not split over the mp ranks
(models/moe.py says why). Without sequence parallelism every mp rank holds the same tokens at the
MoE layer and computes the same routing and experts; sequence parallelism (each mp rank routing
its own sequence shard, the experts' gradients then summed over mp) is not built: refused.

Expert parallelism (`strategy.ep_degree`, runtime/expert_parallel.py): groups of ep_degree
consecutive data-parallel ranks (sharding × dp) at each pipeline stage and mp rank, of a DDP job
or of an FSDP one (ZeRO-2/3: the experts FSDP-sharded over the ranks outside their group,
torchtitan's "edp"). Unlike torchtitan, mp does not join the expert group. ZeRO-1, context
parallelism and fp16's loss scaling are refused with ep_degree > 1, each with what to do instead.
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
    if mp > 1 and s is not None and s.sequence_parallel:
        yield Problem(
            "strategy.sequence_parallel",
            f"sequence_parallel=true with mp_degree={mp} and {experts}: fleetwise's MoE layer routes "
            "whole sequences on every tensor-parallel rank, not sequence shards",
            "set strategy.sequence_parallel=false (the experts then run replicated over the mp ranks), "
            "or strategy.mp_degree=1",
        )
    if ctx.cfg.train.compile:
        yield Problem(
            "train.compile",
            f"train.compile=true with {experts}: the MoE layer's per-step counts and its expert loop "
            "break torch.compile's full graph of a block",
            "set train.compile=false",
        )


@rule
def expert_parallel(ctx: Context) -> Iterator[Problem]:
    s = ctx.collective
    ep = s.ep_degree if s is not None else 1
    if ep == 1:
        return
    e = _experts(ctx)
    loc = "strategy.ep_degree"
    if not e:
        yield Problem(
            loc,
            f"ep_degree={ep} without model.moe: expert parallelism splits the routed experts, and this model has none",
            "set strategy.ep_degree=1, or give the model experts (model.moe.num_experts)",
        )
        return
    if e % ep:
        yield Problem(
            "model.moe.num_experts",
            f"num_experts={e} does not split over ep_degree={ep} ranks (each rank holds num_experts/ep_degree)",
            f"set strategy.ep_degree to a divisor of {e}, or model.moe.num_experts to a multiple of {ep}",
        )
    if ctx.cfg.train.precision == "fp16":
        # GradScaler unscales each device's gradients in one multi-tensor call, which refuses the
        # experts' DTensor gradients beside the dense plain ones (runtime/parallelize.py replicate_rest)
        yield Problem(
            "train.precision",
            f"train.precision=fp16 with ep_degree={ep}: fp16's loss scaling does not handle the "
            "expert-parallel gradients yet",
            "set train.precision=bf16 (no loss scaling) or fp32, or strategy.ep_degree=1",
        )
    lay = ctx.layout
    if lay is None:
        return
    data = lay.sharding * lay.dp
    if data % ep:
        yield Problem(
            loc,
            f"ep_degree={ep} does not divide the data-parallel ranks sharding_degree × dp_degree = "
            f"{lay.sharding} × {lay.dp} = {data}: the expert groups are carved out of them",
            f"set strategy.ep_degree to a divisor of {data}",
        )
    if lay.sharding > 1 and s.sharding_stage == 1:
        # runtime/zero1.py keeps whole gradient buffers per parameter and knows no DTensor shard
        yield Problem(
            "strategy.sharding_stage",
            f"sharding_stage=1 (ZeRO-1) with ep_degree={ep}: fleetwise's distributed optimizer does not "
            "hold expert-parallel experts",
            "set strategy.sharding_stage=2 or 3 (FSDP shards the experts over the ranks outside their "
            "group), or strategy.ep_degree=1",
        )
    if lay.cp > 1:
        yield Problem(
            "strategy.cp_degree",
            f"cp_degree={lay.cp} with ep_degree={ep}: fleetwise does not combine context-parallel ranks "
            "with expert groups yet",
            "set strategy.cp_degree=1 and use strategy.dp_degree or strategy.sharding_degree for the "
            f"data-parallel ranks (strategy=dp strategy.ep_degree={ep}), or set strategy.ep_degree=1",
        )
