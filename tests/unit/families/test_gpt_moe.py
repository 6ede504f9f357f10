"""GPT with a mixture of experts (model.moe, the layer Llama uses): the built model has experts in the
blocks the section names, its parameters per unit equal the planner's (total and active counted by
hand here), the experts start from GPT's initialisation, the balance loss reaches the routers, and a
bad MoE section is refused by the rules Llama's goes through, every problem with its fix."""

from __future__ import annotations

import math

import torch
from helpers.config import compose

from fleetwise.families import model_units
from fleetwise.plan.planner import make_plan

H, FFN, E, F, K, V = 64, 256, 4, 64, 2, 256  # gpt/moe_tiny
ATTENTION = 4 * H * H + 4 * H  # q, k, v, out-projection with biases
NORMS = 2 * 2 * H  # two layer norms, weight and bias
DENSE_BLOCK = ATTENTION + NORMS + 2 * H * FFN + FFN + H  # + fc1, fc2 with biases
MOE_BLOCK = ATTENTION + NORMS + E * H + E * 3 * H * F  # + router [E, h], E SwiGLU experts


def built(*overrides):
    from fleetwise.runtime.modeling import build_model

    cfg, problems = compose("recipe=gpt/moe_tiny", *overrides)
    assert problems == [], problems
    model = build_model(cfg)
    groups = [[model.embed], *([b] for b in model.layers.values()), [model.norm, model.output]]
    counted = [sum(p.numel() for g in group for p in g.parameters()) for group in groups]
    return cfg, model, counted


def test_gpt_moe_tiny_parameters_total_and_active_match_the_planner():
    cfg, model, counted = built()
    units = model_units(cfg.model)
    assert counted == [u.params for u in units]
    assert counted[1:5] == [DENSE_BLOCK, MOE_BLOCK, MOE_BLOCK, MOE_BLOCK]  # first_dense_layers=1
    names = {n for n, _ in model.named_parameters()}
    assert [f"layers.{i}.mlp.router.gate.weight" in names for i in range(4)] == [False, True, True, True]
    assert "layers.0.mlp.fc1.weight" in names and "layers.1.mlp.fc1.weight" not in names
    total = V * H + 32 * H + DENSE_BLOCK + 3 * MOE_BLOCK + 2 * H + H * V  # + positions, final LN, head
    inactive = 3 * (E - K) * 3 * H * F  # a token skips 2 of the 4 experts in each MoE block
    plan = make_plan(cfg)
    assert sum(p.numel() for p in model.parameters()) == total == 283_840
    assert plan.active_params == total - inactive == 210_112
    # FLOPs count the active parameters: a MoE block's forward is its active matrices' (2 a
    # multiply-add per token) plus attention's
    s = cfg.model.seq_len
    moe_unit = units[2]
    active_matrices = 4 * H * H + E * H + K * 3 * H * F
    assert moe_unit.fwd_flops == 2 * s * active_matrices + moe_unit.attn_flops
    # every-other placement and a shared expert: still equal, block by block
    cfg, _, counted = built("model.moe.interval=2", "model.moe.num_shared_experts=1")
    assert counted == [u.params for u in model_units(cfg.model)]
    assert counted[1:5] == [DENSE_BLOCK, MOE_BLOCK + 3 * H * F, DENSE_BLOCK, MOE_BLOCK + 3 * H * F]


def test_experts_start_from_gpt_init_and_the_balance_loss_reaches_the_router():
    cfg, model, _ = built()
    experts = model.layers["1"].mlp.experts
    std = cfg.model.init_std
    assert abs(experts.w1.std().item() - std) < 0.1 * std
    assert abs(experts.w2.std().item() - std / math.sqrt(2 * 4)) < 0.1 * std / math.sqrt(8)
    tokens = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(0))
    model.train()
    logits = model(tokens)
    assert logits.shape == (2, 32, 256) and torch.isfinite(logits).all()
    # the balance loss's own gradient, with the LM's loss out of the way: the routers get one
    (logits * 0).sum().backward()
    assert all(model.layers[i].mlp.router.gate.weight.grad.abs().sum() > 0 for i in "123")


def test_bad_gpt_moe_sections_are_refused_by_the_shared_rules():
    _, problems = compose(
        "recipe=gpt/moe_tiny",
        "model.moe.top_k=5",
        "model.moe.aux_loss_coef=0",
        "strategy=mp",
        "strategy.mp_degree=2",
        "strategy.sequence_parallel=true",
        "hardware.devices_per_node=2",
    )
    by_loc = {p.loc: p for p in problems}
    assert set(by_loc) == {"model.moe.top_k", "model.moe.aux_loss_coef", "strategy.sequence_parallel"}, problems
    assert "at most 4" in by_loc["model.moe.top_k"].hint
    assert "sequence_parallel=false" in by_loc["strategy.sequence_parallel"].hint
    assert all(p.hint for p in problems)
    # sizes the planner cannot represent: checked first, alone (as for Llama)
    _, problems = compose("recipe=gpt/moe_tiny", "model.moe.expert_ffn_size=100000000")
    assert [p.loc for p in problems] == ["model.moe.expert_ffn_size"]


def test_tensor_parallel_plan_leaves_the_experts_whole():
    """GPT with experts under mp (measured by hand: gpt/moe_tiny mp 2 = one process, losses to the
    4th digit, with and without a dense block): the attention is split as for a dense GPT; with no
    dense block the plan names no MLP (runtime/parallelize.py drops a MoE block's MLP entries)."""
    from fleetwise.families import family_of

    for dense, expect_mlp in ((1, True), (0, False)):
        cfg, problems = compose("recipe=gpt/moe_tiny", f"model.moe.first_dense_layers={dense}")
        assert problems == []
        plan = family_of(cfg.model).spec(cfg.model).tp_plan(False)
        assert any(k.startswith("layers.*.attn") for k in plan), plan
        assert any(k.startswith("layers.*.mlp") for k in plan) == expect_mlp, plan
