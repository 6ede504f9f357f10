"""Every named strategy runs on every tiny recipe with no further override (issue: a newcomer's
first hour): `mp` and `pp` take the largest degree the model allows (`max`) and dp the rest."""

import pytest
from helpers.config import compose

from fleetwise.config.validate import fill_max
from fleetwise.plan import make_plan

TINY = ("gpt/tiny", "ernie/tiny", "resnet/tiny", "ctr/tiny")
COLLECTIVE = ("dp", "mp", "pp", "sharding", "hybrid")


@pytest.mark.parametrize("recipe", TINY)
@pytest.mark.parametrize("strategy", COLLECTIVE)
def test_every_collective_strategy_validates_and_plans_on_every_tiny_recipe(recipe, strategy):
    cfg, problems = compose(f"recipe={recipe}", f"strategy={strategy}")
    assert problems == [], [p.to_dict() for p in problems]
    s = cfg.strategy
    assert s.sharding_degree * s.dp_degree * s.mp_degree * s.pp_degree == cfg.hardware.world_size
    assert make_plan(cfg).world_size == cfg.hardware.world_size


@pytest.mark.parametrize(
    ("recipe", "mp", "pp"),
    [("gpt/tiny", 4, 4), ("ernie/tiny", 4, 4), ("resnet/tiny", 1, 4), ("ctr/tiny", 1, 1)],
)
def test_max_degree_is_the_largest_the_model_allows(recipe, mp, pp):
    """4 heads and 4 layers cap mp and pp at 4 of 8 ranks (dp 2); ResNet has no tensor-parallel
    plan and the CTR MLP cannot be pipelined, so they get 1 and dp takes every rank."""
    tp, _ = compose(f"recipe={recipe}", "strategy=mp")
    assert (tp.strategy.mp_degree, tp.strategy.dp_degree) == (mp, 8 // mp)
    pipe, _ = compose(f"recipe={recipe}", "strategy=pp")
    assert (pipe.strategy.pp_degree, pipe.strategy.dp_degree) == (pp, 8 // pp)


def test_max_respects_the_degrees_the_user_fixed():
    cfg, problems = compose("recipe=gpt/tiny", "strategy=pp", "strategy.dp_degree=4")
    assert problems == [] and (cfg.strategy.pp_degree, cfg.strategy.dp_degree) == (2, 4)
    cfg, problems = compose(
        "recipe=gpt/tiny", "strategy=hybrid", "strategy.mp_degree=max", "strategy.pp_degree=2"
    )
    assert problems == [] and (cfg.strategy.mp_degree, cfg.strategy.pp_degree, cfg.strategy.dp_degree) == (
        4,
        2,
        1,
    )


def test_max_is_decided_by_the_validation_rules():
    """A model with 6 heads on 8 ranks: 8 and 4 don't divide 6, so mp max is 2 -- found by the
    same rule that refuses `strategy.mp_degree=4`, not by a copy of it."""
    bad, problems = compose(
        "recipe=gpt/tiny",
        "strategy=mp",
        "strategy.mp_degree=4",
        "model.num_attention_heads=6",
        "model.hidden_size=48",
    )
    assert bad is None and any(p.loc == "strategy.mp_degree" for p in problems)
    cfg, problems = compose(
        "recipe=gpt/tiny", "strategy=mp", "model.num_attention_heads=6", "model.hidden_size=48"
    )
    assert problems == [] and cfg.strategy.mp_degree == 2
    assert fill_max(cfg) is cfg  # resolved configs carry numbers only


@pytest.mark.parametrize("recipe", ("gpt/tiny", "ernie/tiny", "resnet/tiny"))
def test_ps_on_a_dense_model_is_an_explained_opt_in(recipe):
    _, problems = compose(f"recipe={recipe}", "strategy=ps")
    assert [p.loc for p in problems] == ["strategy.dense_fallback"]
    cfg, problems = compose(f"recipe={recipe}", "strategy=ps", "strategy.dense_fallback=true")
    assert problems == []
