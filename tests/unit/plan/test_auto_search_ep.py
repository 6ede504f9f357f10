"""strategy=auto with expert parallelism (plan/search.py): ep degrees are searched for a mixture of
experts, only in combinations validate accepts; the pruned search's winner is the brute force's; a
user's ep_degree stays fixed; a dense model's search and overrides know no ep."""

from __future__ import annotations

import pytest
from helpers.config import compose, fastest_fitting, strategy_grid, with_layout

from fleetwise.config.validate import check
from fleetwise.launcher.auto import resolve_auto
from fleetwise.plan import make_plan

# llama/moe_tiny (4 experts) on 4 ranks, on a 7.09 MB device: dp 4 without ep (8.76 MB) and with ep 2
# (7.58 MB) do not fit at 4 samples a micro-batch, ep 4 (6.99 MB: each rank 1 of the 4 experts) does,
# and is faster than the pipelines that fit
MOE = [
    "recipe=llama/moe_tiny",
    "hardware.devices_per_node=4",
    "auto.headroom=0",
    "hardware.memory_per_device_gib=0.0066",
]


def test_ep_is_searched_for_experts_only_in_legal_layouts_and_a_fixed_one_stays():
    out = resolve_auto(["strategy=auto", *MOE], progress=False)
    r = out.result
    assert {c.strategy["ep_degree"] for c in r.ranked} == {1, 2, 4}
    for c in r.ranked:
        assert check(with_layout(out.base, c.strategy, c.micro_batch_size)) == [], c.layout_text()
        s = c.strategy
        if s["ep_degree"] > 1:  # what ep combines with (config/rules/moe.py): pp and mp, not cp or ZeRO-1
            assert s["cp_degree"] == 1 and s["sharding_stage"] != 1
        assert not (s["mp_degree"] > 1 and s["sequence_parallel"])  # experts see whole sequences
    assert r.winner.strategy["ep_degree"] == 4 and "ep4" in r.winner.layout_text()
    # the winner's printed overrides, typed in, give its plan
    assert "strategy.ep_degree=4" in out.override_text
    cfg, problems = compose(*MOE, *r.winner.overrides())
    assert problems == [] and make_plan(cfg).step_time_s == pytest.approx(r.winner.plan.step_time_s)
    fixed = resolve_auto(["strategy=auto", *MOE, "strategy.ep_degree=2"], progress=False).result
    assert fixed.ranked and {c.strategy["ep_degree"] for c in fixed.ranked} == {2}
    dense = resolve_auto(
        ["strategy=auto", "recipe=llama/tiny", "hardware.devices_per_node=4"], progress=False
    )
    assert {c.strategy["ep_degree"] for c in dense.result.ranked} == {1}
    assert "ep_degree" not in dense.override_text


def test_the_winner_with_ep_is_the_fastest_of_a_brute_force_search():
    """Every combination of every searched key (ep 1/2/4 included) that validate accepts and
    fits: the fastest is the search's winner, and here it has ep."""
    out = resolve_auto(["strategy=auto", *MOE], progress=False)
    base, budget = out.base, out.result.budget_bytes
    dims = ("dp_degree", "sharding_degree", "mp_degree", "pp_degree")
    candidates = strategy_grid(4, dims, (1, 2, 4, 8, 16), ep_degree=(1, 2, 4))
    best = fastest_fitting(base, budget, candidates)
    winner = out.result.winner
    assert winner.plan.step_time_s == pytest.approx(best[0], rel=1e-9)
    assert winner.strategy["ep_degree"] == best[1]["ep_degree"] == 4
