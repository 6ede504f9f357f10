"""The planner under expert parallelism (strategy.ep_degree): the routed experts' parameters,
gradients and optimizer state per rank divided by ep, the rest unchanged; the experts' all-to-all
bytes per step by hand (the dry run measured the same 786,432 bytes on llama/moe_tiny dp 2 ep 2)."""

from __future__ import annotations

import pytest
from helpers.config import compose

from fleetwise.plan import make_plan

MIXTRAL = (
    "recipe=llama/mixtral_8x7b",
    "strategy=dp",
    "strategy.dp_degree=16",
    "hardware.devices_per_node=8",
    "hardware.nodes=2",
)
# Mixtral 8x7B's routed experts: 32 layers × 8 experts × (w1, w3 [14336, 4096] + w2 [4096, 14336])
MIXTRAL_EXPERTS = 32 * 8 * 3 * 4096 * 14336


def plan(*overrides):
    cfg, problems = compose(*overrides)
    assert problems == [], problems
    return make_plan(cfg)


def test_expert_states_per_rank_divide_by_ep():
    base = plan(*MIXTRAL)
    per_param = {k: base.memory_bytes[k] / base.params for k in ("params", "grads", "optimizer")}
    assert per_param == {
        "params": 6.0,
        "grads": 4.0,
        "optimizer": 8.0,
    }  # bf16 working + fp32 master, fp32 grads, AdamW
    for ep in (2, 8):
        got = plan(*MIXTRAL, f"strategy.ep_degree={ep}")
        assert got.params == base.params  # the model is the same
        assert got.flops_per_step == base.flops_per_step
        for k, b in per_param.items():
            expected = base.memory_bytes[k] - b * MIXTRAL_EXPERTS * (1 - 1 / ep)
            assert got.memory_bytes[k] == pytest.approx(expected, rel=1e-9), (ep, k)
        assert got.memory_bytes["activations"] == base.memory_bytes["activations"]
    assert "ep" not in base.comm_bytes_per_step


def test_all_to_all_bytes_by_hand():
    got = plan("recipe=llama/moe_tiny", "strategy=dp", "strategy.ep_degree=2", "hardware.devices_per_node=2")
    # 4 micro-batches of 2 samples; 3 MoE blocks; 32 tokens × top-2 rows of 64 fp32 elements each,
    # out and back in forward and in backward; half of them leave the rank
    assert got.comm_bytes_per_step["ep"] == 4 * 2 * 3 * (32 * 2 * 64) * 4 * 4 // 2 == 786_432
    recompute = plan(
        "recipe=llama/moe_tiny",
        "strategy=dp",
        "strategy.ep_degree=2",
        "hardware.devices_per_node=2",
        "strategy.recompute=full",
    )
    assert recompute.comm_bytes_per_step["ep"] == 786_432 * 6 // 4  # the forward's two again


def test_expert_states_inside_sharding_split_over_edp_and_their_gradients_go_over_edp():
    """Inside ZeRO-3 the experts are FSDP-sharded over edp = sharding / ep ranks, not over sharding
    (runtime/expert_parallel.py): per rank E / (ep · edp) = E / sharding of them, the dense rest
    / sharding -- so with sharding 16 the states equal ep 1's; the experts' gradients travel over
    "edp", the rest over "sharding"."""
    zero3 = ("strategy=sharding", "strategy.sharding_stage=3", "strategy.sharding_degree=16")
    mixtral = (*MIXTRAL[:1], *zero3, *MIXTRAL[3:])
    base = plan(*mixtral)
    for ep in (2, 8):
        got = plan(*mixtral, f"strategy.ep_degree={ep}")
        for k in ("optimizer", "grads"):
            assert got.memory_bytes[k] == pytest.approx(base.memory_bytes[k], rel=1e-9), (ep, k)
    # DDP: one fp32 all-reduce of this rank's experts (E / ep) over edp = dp / ep ranks
    experts_moe_tiny = 3 * 4 * 3 * 64 * 64  # 3 MoE blocks × 4 experts × (w1, w2, w3) [64, 64]
    for dp, ep in ((4, 2), (8, 2), (8, 4)):
        got = plan("recipe=llama/moe_tiny", "strategy=dp", f"strategy.ep_degree={ep}",
                   f"hardware.devices_per_node={dp}")  # fmt: skip
        edp = dp // ep
        assert got.comm_bytes_per_step["edp"] == int(2 * (edp - 1) / edp * 4 * experts_moe_tiny / ep), (
            dp,
            ep,
        )
        dense = plan(
            "recipe=llama/moe_tiny", "strategy=dp", f"hardware.devices_per_node={dp}"
        ).comm_bytes_per_step
        # (DDP's all-reduce: every parameter but the experts)
        assert got.comm_bytes_per_step["dp"] == int(dense["dp"] - 2 * (dp - 1) / dp * 4 * experts_moe_tiny)


def test_the_largest_gradient_transient_splits_the_experts_over_ep():
    """On a CPU AdamW's per-tensor step makes two temporaries of the largest tensor a rank steps:
    Mixtral's expert weight [8, 14336, 4096] whole, an eighth of it under ep 8 -- then the
    embedding [32000, 4096] is the largest."""
    cpu = ("hardware=cpu", "hardware.devices_per_node=16", "hardware.nodes=1", "train.precision=fp32")
    mixtral = (*MIXTRAL[:3], *cpu)
    temporaries = {
        ep: plan(*mixtral, f"strategy.ep_degree={ep}").memory_bytes["step_temporaries"] for ep in (1, 2, 8)
    }
    assert temporaries == {
        1: 2 * 4 * 8 * 14336 * 4096,
        2: 2 * 4 * 4 * 14336 * 4096,
        8: 2 * 4 * 32000 * 4096,
    }


def test_under_tensor_parallelism_the_moe_mlp_is_whole_on_every_mp_rank():
    """mp 2 (no sequence parallelism): attention, the dense block's MLP, embedding and head split over
    the mp ranks; the MoE blocks' router, experts and shared expert whole on each (models/moe.py),
    the experts split by ep only; the MoE MLPs' FLOPs and saved tensors not divided by mp, and a
    MoE block all-reduces one activation per forward over mp (attention's), not two."""
    # llama/moe_tiny by hand: h 64, 8 query heads and 4 kv heads of 8, vocab 256 (embedding and head),
    # block 0 dense (SwiGLU 192), blocks 1-3 MoE (router 4 × 64, experts 3 × 4 × 64 × 64, a shared
    # SwiGLU of 64); fp32 and SGD-free AdamW: 4 bytes per parameter
    h, v = 64, 256
    attention = h * h + 2 * h * 32 + h * h
    split = 2 * v * h + 4 * attention + 3 * h * 192
    experts = 3 * 4 * h * 64
    whole = 4 * 2 * h + h + 3 * (4 * h + experts + 3 * h * 64)
    assert split + whole == 304_448
    moe = ("recipe=llama/moe_tiny",)
    mp2 = plan(*moe, "strategy=mp", "strategy.mp_degree=2", "hardware.devices_per_node=2")
    assert mp2.params == 304_448
    assert mp2.memory_bytes["params"] == 4 * (split / 2 + whole)
    # with ep 2 beside (dp 2 × mp 2): the experts, and only they, halve again
    ep = plan(
        *moe, "strategy=hybrid", "strategy.dp_degree=2", "strategy.mp_degree=2", "strategy.ep_degree=2",
        "hardware.devices_per_node=4",
    )  # fmt: skip
    no_ep = plan(
        *moe, "strategy=hybrid", "strategy.dp_degree=2", "strategy.mp_degree=2", "hardware.devices_per_node=4"
    )
    assert no_ep.memory_bytes["grads"] - ep.memory_bytes["grads"] == 4 * 3 * experts / 2
    one = plan(*moe, "strategy=dp", "hardware.devices_per_node=1")
    # the MoE MLPs' saved tensors stay whole: mp 2 saves more than half of one process's
    assert mp2.memory_bytes["activations"] > 0.8 * one.memory_bytes["activations"]
    # mp traffic: per micro-batch, block 0 all-reduces two (seq, hidden) activations forward and
    # two backward, a MoE block one each way; the embedding one forward, the head one backward
    # (fp32: 4 bytes; 2 samples of 32 tokens; an all-reduce moves 2 (mp - 1) / mp = 1 of its bytes)
    size = 2 * 32 * h * 4
    assert mp2.comm_bytes_per_step["mp"] == 8 * size * (2 * 2 + 3 * 2 + 1 + 1)


def test_what_a_moe_block_saves_without_recompute_by_hand():
    """Mixtral's MoE block (s = 4,096 tokens a sample, top-2: sk = 8,192 rows, h = 4,096, experts of
    width f = 14,336) saves, where the dense block's SwiGLU saved its four [s, f] tensors: the routed
    rows (the experts' input), the experts' output rows and the weighted rows (index_add's source,
    which the dry run held: 64 MiB a layer in bf16, the planner missed it), all [sk, h]; the four
    SwiGLU tensors [sk, f]; the rows' weights [sk] -- whole on every mp rank -- and the router's
    fp32 scores [s, 8], the two chosen weights and their sum, and three int64 index tensors."""
    from fleetwise.families.llama.units import block, units

    cfg, problems = compose(*MIXTRAL)
    assert problems == [], problems
    s, sk, h, f = 4096, 8192, 4096, 14336
    moe = next(u for u in units(cfg.model) if u.name == "moe_block").acts["none"]
    dense = block(cfg.model).acts["none"]  # the same block with its dense SwiGLU of width 14,336
    assert moe.replicated - dense.replicated == sk * h + sk * h + sk * h + 4 * sk * f + sk
    assert moe.split - dense.split == -4 * s * f
    assert moe.fp32 - dense.fp32 == s * 8 + (2 * s + s) + 2 * (2 * s + sk + sk)
    assert (moe.sp, moe.whole, moe.reduced) == (dense.sp, dense.whole, dense.reduced)
