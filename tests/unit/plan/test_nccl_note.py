"""What a GPU plan says it assumes of NCCL (#39 finding 11): every mesh dimension that does not span
the world becomes a communicator of its own, created at start-up, whose buffers live outside
PyTorch's allocator -- not in the memory total, only in the profile's device overhead."""

from __future__ import annotations

from helpers.config import compose

from fleetwise.config.layout import Layout
from fleetwise.plan import make_plan
from fleetwise.plan.planner import nccl_communicators


def _note(plan) -> str | None:
    return next((n for n in plan.notes if n.startswith("NCCL:")), None)


def test_each_mesh_dimension_below_the_world_is_a_communicator():
    # hand-counted: the world's, plus each dimension whose size is not the world's (size 1 too)
    assert nccl_communicators(Layout(dp=8)) == {"world": 8, "pp": 1, "sharding": 1, "mp": 1}
    assert nccl_communicators(Layout(dp=2, pp=2, sharding=2, mp=2)) == {
        "world": 16, "dp": 2, "pp": 2, "sharding": 2, "mp": 2,
    }  # fmt: skip
    assert nccl_communicators(Layout()) == {"world": 1}


def test_a_gpu_plan_states_its_communicators_and_where_their_memory_is():
    cfg, problems = compose("recipe=gpt/gpt3_1.3b", "hardware=h100", "strategy=sharding")
    assert problems == []
    note = _note(make_plan(cfg))
    assert note.startswith(
        "NCCL: 4 communicator(s) per rank at start-up (world 8 rank(s); mesh dp 1, pp 1, mp 1)"
    )
    assert "not in the memory total" in note and "hardware.device_overhead_gib (2.4 GiB" in note
    hybrid, _ = compose(
        "recipe=gpt/gpt3_1.3b", "hardware=a100", "hardware.nodes=2", "strategy=hybrid",
        "strategy.pp_degree=2", "strategy.mp_degree=2", "strategy.sharding_degree=2", "strategy.sharding_stage=1",
    )  # fmt: skip
    assert (
        "NCCL: 5 communicator(s) per rank at start-up (world 16 rank(s); mesh dp 2, pp 2, sharding 2, mp 2)"
        in (_note(make_plan(hybrid)))
    )
    one, _ = compose("recipe=gpt/tiny", "hardware=h200", "hardware.devices_per_node=1")
    assert _note(make_plan(one)).startswith("NCCL: 1 communicator(s) per rank at start-up (world 1 rank(s));")
    cpu, _ = compose("recipe=gpt/tiny")
    assert _note(make_plan(cpu)) is None  # gloo: no NCCL buffers
