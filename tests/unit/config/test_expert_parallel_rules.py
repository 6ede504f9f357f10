"""strategy.ep_degree's rules (config/rules/moe.py): every problem at once, each with its config
path, the values and a fix; the CLI exits 2 without a traceback."""

from __future__ import annotations

from helpers.cli import run_cli
from helpers.config import compose

MOE = ("recipe=llama/moe_tiny",)  # 4 experts


def test_an_expert_parallel_data_parallel_layout_is_valid():
    cfg, problems = compose(*MOE, "strategy=dp", "strategy.ep_degree=2", "hardware.devices_per_node=4")
    assert problems == []
    assert cfg.strategy.ep_degree == 2
    _, problems = compose(*MOE, "strategy=dp", "strategy.ep_degree=4", "hardware.devices_per_node=4")
    assert problems == []
    # inside sharding (ZeRO-2/3: the experts FSDP-sharded over the ranks outside their group), and HSDP
    for stage in (2, 3):
        _, problems = compose(
            *MOE, "strategy=sharding", f"strategy.sharding_stage={stage}", "strategy.ep_degree=2",
            "hardware.devices_per_node=4",
        )  # fmt: skip
        assert problems == []
    _, problems = compose(
        *MOE, "strategy=hybrid", "strategy.dp_degree=2", "strategy.sharding_degree=2", "strategy.sharding_stage=3",
        "strategy.ep_degree=4", "hardware.devices_per_node=4",
    )  # fmt: skip
    assert problems == []


def test_every_problem_at_once_with_its_fix():
    _, problems = compose(
        *MOE,
        "strategy=hybrid",
        "strategy.ep_degree=3",
        "strategy.dp_degree=2",
        "strategy.pp_degree=2",
        "strategy.sharding_degree=2",
        "strategy.sharding_stage=1",
        "hardware.devices_per_node=8",
    )
    by_loc = {p.loc: p for p in problems}
    assert set(by_loc) == {
        "model.moe.num_experts",
        "strategy.ep_degree",
        "strategy.sharding_stage",
        "strategy.pp_degree",
    }, problems
    assert (
        "num_experts=4" in by_loc["model.moe.num_experts"].msg
        and "ep_degree=3" in by_loc["model.moe.num_experts"].msg
    )
    assert "2 × 2 = 4" in by_loc["strategy.ep_degree"].msg
    assert "divisor of 4" in by_loc["strategy.ep_degree"].hint
    assert "ZeRO-1" in by_loc["strategy.sharding_stage"].msg
    assert "strategy.sharding_stage=2 or 3" in by_loc["strategy.sharding_stage"].hint
    assert "strategy.pp_degree=1" in by_loc["strategy.pp_degree"].hint
    assert all(p.hint for p in problems)


def test_expert_parallelism_needs_experts_and_a_fixed_layout():
    _, problems = compose(
        "recipe=llama/tiny", "strategy=dp", "strategy.ep_degree=2", "hardware.devices_per_node=2"
    )
    assert [p.loc for p in problems] == ["strategy.ep_degree"]
    assert "without model.moe" in problems[0].msg and "strategy.ep_degree=1" in problems[0].hint
    # tensor parallelism does not join the expert group: experts refuse mp already
    _, problems = compose(
        *MOE, "strategy=hybrid", "strategy.ep_degree=2", "strategy.dp_degree=2", "strategy.mp_degree=2",
        "hardware.devices_per_node=4",
    )  # fmt: skip
    assert "strategy.mp_degree" in [p.loc for p in problems]
    _, problems = compose(
        *MOE, "strategy=dp", "strategy.ep_degree=2", "hardware=h100", "hardware.devices_per_node=2",
        "train.precision=fp16",
    )  # fmt: skip
    assert [p.loc for p in problems] == ["train.precision"], problems
    assert "train.precision=bf16" in problems[0].hint
    _, problems = compose(
        *MOE, "strategy=hybrid", "strategy.ep_degree=2", "strategy.dp_degree=2", "strategy.cp_degree=2",
        "hardware.devices_per_node=4",
    )  # fmt: skip
    # (context parallelism refuses experts itself too)
    assert [p.loc for p in problems] == ["model.moe.num_experts", "strategy.cp_degree"], problems
    assert "strategy.cp_degree=1" in problems[1].hint


def test_validate_exits_2_with_the_problems(tmp_path):
    r = run_cli(
        "validate",
        *MOE,
        "strategy=dp",
        "strategy.ep_degree=8",
        "hardware.devices_per_node=4",
        "--json",
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    import json

    errors = json.loads(r.stdout)["errors"]
    assert {e["loc"] for e in errors} == {"model.moe.num_experts", "strategy.ep_degree"}
