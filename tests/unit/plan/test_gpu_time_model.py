"""The GPU time model behind strategy=auto's ranking: GEMM efficiency by size, memory-bound
elementwise cost, overlap rules per engine, offload's cost (shipped a100 profile, no GPU needed)."""

from __future__ import annotations

import pytest
from helpers.config import compose

from fleetwise.plan import make_plan

GPT13 = ["recipe=gpt/gpt3_1.3b", "hardware=a100"]


def _plan(*overrides):
    cfg, problems = compose(*overrides, "plan.memory_check=off")
    assert problems == [], problems
    return make_plan(cfg)


def test_small_gemms_run_further_below_peak_than_large_ones():
    hw = compose(*GPT13)[0].hardware
    assert hw.gemm_fraction(2e8) < hw.gemm_fraction(2e10) < hw.gemm_fraction(1e12) <= 1
    # a tiny model's step is charged far below the 1.3B model's MFU on the same device
    tiny = _plan("recipe=gpt/tiny", "hardware=a100", "strategy=dp", "hardware.devices_per_node=8")
    assert tiny.mfu < 0.05 < 0.3 < _plan(*GPT13).mfu


def test_ddp_under_accumulation_hides_its_all_reduce_only_behind_the_last_backward():
    common = [*GPT13, "strategy=dp", "hardware.inter_node_gbps=1", "hardware.intra_node_gbps=1"]
    one = _plan(*common, "train.global_batch_size=8", "train.micro_batch_size=1")  # 1 micro-batch
    many = _plan(*common, "train.global_batch_size=64", "train.micro_batch_size=1")  # 8 micro-batches
    for plan in (one, many):
        n = plan.batch["num_microbatches"]
        window = (2 / 3) * plan.time_s["compute"] / n
        assert plan.time_s["comm_dp"] > window  # slow links: more to hide than the window
        assert plan.time_s["comm_hidden"] == pytest.approx(window)


def test_fsdp_without_a_pipeline_hides_behind_the_whole_step_and_with_one_behind_a_micro_batch():
    flat = _plan(*GPT13, "strategy.sharding_degree=8", "strategy.sharding_stage=3")
    assert flat.time_s["comm_hidden"] == pytest.approx(
        min(flat.time_s["comm_sharding"], flat.time_s["compute"])
    )
    piped = _plan(
        *GPT13, "strategy=hybrid", "strategy.pp_degree=2", "strategy.sharding_degree=4", "strategy.sharding_stage=2",
        "hardware.intra_node_gbps=1",
    )  # fmt: skip
    n = piped.batch["num_microbatches"]
    assert piped.time_s["comm_hidden"] == pytest.approx(piped.time_s["compute"] / n)


def test_offload_and_selective_recompute_cost_time_on_a_gpu():
    base = [*GPT13, "strategy.sharding_degree=8", "strategy.sharding_stage=3"]
    plain, offloaded = _plan(*base), _plan(*base, "strategy.offload=true")
    assert offloaded.time_s["offload"] > 0 == plain.time_s["offload"]
    assert offloaded.step_time_s == pytest.approx(plain.step_time_s + offloaded.time_s["offload"])
    assert _plan(*base, "strategy.recompute=selective").step_time_s > plain.step_time_s


@pytest.mark.parametrize(
    "overrides",
    [
        ["recipe=gpt/tiny", "strategy=dp"],  # cpu: an optimizer step, nothing hidden
        [*GPT13, "strategy.sharding_degree=8", "strategy.sharding_stage=3", "strategy.offload=true"],
        [
            "recipe=gpt/gpt3_175b", "hardware=a100", "hardware.nodes=128", "strategy=hybrid",
            "strategy.mp_degree=8", "strategy.pp_degree=16",
        ],
    ],
    ids=["cpu_dp", "a100_zero3_offload", "a100_175b_pp16_mp8"],
)  # fmt: skip
def test_the_step_time_breakdown_adds_up_to_the_step(overrides):
    """`plan` prints the step as the sum of its parts (render.step_time_sum): compute (GEMMs, host
    ops, elementwise, gradient accumulation) + bubble + exposed communication + update + offload."""
    from fleetwise.plan.records import step_parts
    from fleetwise.plan.render import step_time_sum

    plan = _plan(*overrides)
    t = plan.time_s
    comm = sum(v for k, v in t.items() if k.startswith("comm_") and k != "comm_hidden")
    total = t["compute"] + t["bubble"] + comm - t["comm_hidden"] + t["update"] + t["offload"]
    assert total == pytest.approx(plan.step_time_s, rel=1e-9)
    # the additive parts strategy=auto's "vs #1" compares (plan/search.py explain)
    parts = step_parts(t)
    assert sum(parts.values()) == pytest.approx(plan.step_time_s, rel=1e-9)
    assert "compute" not in parts and "comm_hidden" not in parts and parts["gemm"] > 0
    # host ops, elementwise and accumulation are parts of compute; what is left is the GEMMs
    assert t["host_ops"] + t["elementwise"] + t["grad_accumulate"] < t["compute"]
    text = step_time_sum(t)
    assert text.startswith("compute ") and "GEMMs" in text
    assert ("hidden behind compute" in text) == (t["comm_hidden"] > 0)
