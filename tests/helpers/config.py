"""A config as the commands see it: composed and validated, its problems returned, not raised."""

from __future__ import annotations


def compose(*overrides: str):
    """Compose + validate; returns (RunConfig | None, problems)."""
    from fleetwise.config.problems import ConfigError
    from fleetwise.config.validate import load_config

    try:
        return load_config(list(overrides)), []
    except ConfigError as err:
        return None, err.problems


def with_layout(base, strategy: dict, micro_batch_size: int):
    """`base` with a hybrid strategy of `strategy`'s keys (the rest as in base) and a micro-batch
    size: a strategy=auto candidate as a config, unvalidated (check() says whether it is legal)."""
    from fleetwise.config.strategy import HybridStrategy

    data = {**base.strategy.model_dump(), **strategy, "name": "hybrid"}
    return base.model_copy(
        update={
            "strategy": HybridStrategy.model_validate(data),
            "train": base.train.model_copy(
                update={"micro_batch_size": micro_batch_size, "accumulate_steps": None}
            ),
        }
    )


def fastest_fitting(base, budget: float, candidates):
    """A brute force of strategy=auto: every (strategy, micro-batch size) of `candidates` that
    validate accepts, planned; (step time, strategy) of the fastest within `budget` bytes, or None."""
    from fleetwise.config.validate import check, resolve
    from fleetwise.plan import make_plan

    best = None
    for strategy, mb in candidates:
        cfg = with_layout(base, strategy, mb)
        if check(cfg):
            continue
        plan = make_plan(resolve(cfg))
        if plan.memory_bytes["total"] <= budget and (best is None or plan.step_time_s < best[0]):
            best = (plan.step_time_s, strategy)
    return best


def strategy_grid(world: int, dims: tuple[str, ...], micro_batches, **choices):
    """strategy=auto's candidates for a brute force: (strategy, micro-batch size) for every layout of
    `dims` (degrees 1, 2 or 4 whose product is `world`) × `choices` (e.g. ep_degree=(1, 2, 4)) ×
    every value of the keys the search varies for every job, × each of `micro_batches`."""
    import itertools
    import math

    from fleetwise.plan.search import RECOMPUTE, SCHEDULES

    keys = {
        **choices,
        "sharding_stage": (None, 1, 2, 3),
        "sequence_parallel": (False, True),
        "schedule": SCHEDULES,
        "virtual_stages": (1, 2),
        "recompute": RECOMPUTE,
    }
    layouts = [t for t in itertools.product((1, 2, 4), repeat=len(dims)) if math.prod(t) == world]
    for layout, values, mb in itertools.product(layouts, itertools.product(*keys.values()), micro_batches):
        yield {**dict(zip(dims, layout, strict=True)), **dict(zip(keys, values, strict=True))}, mb
