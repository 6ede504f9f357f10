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


def test_experts_under_pipeline_and_tensor_parallelism_are_valid():
    """Pipeline stages and tensor parallelism (without sequence parallelism: the experts run
    replicated over the mp ranks) combine with experts, with and without expert parallelism --
    up to the 8-rank layout of the parity test (ep 2 inside ZeRO-3 × 2 × mp 2 × pp 2)."""
    for layout, ranks in (
        (("strategy=hybrid", "strategy.pp_degree=2", "strategy.dp_degree=2", "strategy.ep_degree=2"), 4),
        (("strategy=mp", "strategy.mp_degree=2"), 2),
        (("strategy=hybrid", "strategy.mp_degree=2", "strategy.dp_degree=2", "strategy.ep_degree=2"), 4),
        (
            (
                "strategy=hybrid", "strategy.sharding_degree=2", "strategy.sharding_stage=3", "strategy.ep_degree=2",
                "strategy.mp_degree=2", "strategy.pp_degree=2", "strategy.dp_degree=1",
            ),
            8,
        ),
    ):  # fmt: skip
        _, problems = compose(*MOE, *layout, f"hardware.devices_per_node={ranks}")
        assert problems == [], (layout, problems)


def test_every_problem_at_once_with_its_fix():
    _, problems = compose(
        *MOE,
        "strategy=hybrid",
        "strategy.ep_degree=3",
        "strategy.dp_degree=2",
        "strategy.pp_degree=2",
        "strategy.sharding_degree=2",
        "strategy.sharding_stage=1",
        "strategy.mp_degree=2",
        "strategy.sequence_parallel=true",
        "hardware.devices_per_node=16",
    )
    by_loc = {p.loc: p for p in problems}
    assert set(by_loc) == {
        "model.moe.num_experts",
        "strategy.ep_degree",
        "strategy.sharding_stage",
        "strategy.sequence_parallel",
    }, problems
    assert (
        "num_experts=4" in by_loc["model.moe.num_experts"].msg
        and "ep_degree=3" in by_loc["model.moe.num_experts"].msg
    )
    assert "2 × 2 = 4" in by_loc["strategy.ep_degree"].msg
    assert "divisor of 4" in by_loc["strategy.ep_degree"].hint
    assert "ZeRO-1" in by_loc["strategy.sharding_stage"].msg
    assert "strategy.sharding_stage=2 or 3" in by_loc["strategy.sharding_stage"].hint
    sp = by_loc["strategy.sequence_parallel"]
    assert "mp_degree=2" in sp.msg and "num_experts=4" in sp.msg
    assert "strategy.sequence_parallel=false" in sp.hint
    assert all(p.hint for p in problems)


def test_expert_parallelism_needs_experts_and_a_fixed_layout():
    _, problems = compose(
        "recipe=llama/tiny", "strategy=dp", "strategy.ep_degree=2", "hardware.devices_per_node=2"
    )
    assert [p.loc for p in problems] == ["strategy.ep_degree"]
    assert "without model.moe" in problems[0].msg and "strategy.ep_degree=1" in problems[0].hint
    # the experts replicated over mp ranks see whole sequences: not their sequence shards
    _, problems = compose(
        *MOE, "strategy=mp", "strategy.mp_degree=2", "strategy.sequence_parallel=true",
        "hardware.devices_per_node=2",
    )  # fmt: skip
    assert [p.loc for p in problems] == ["strategy.sequence_parallel"], problems
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
