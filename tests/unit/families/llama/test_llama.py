"""The Llama family: the published models' parameter counts, the SwiGLU width rule, the rules of
its `model` section (all problems at once, each with its fix), and the built model against its
planner units."""

from __future__ import annotations

import pytest
from helpers.config import compose

from fleetwise.families import model_units, total_params

# Published exact parameter counts: the "Model size" (safetensors metadata, total parameters) of
# each model card on Hugging Face. The shapes are each model's config.json; `by_hand` recomputes the
# count from them without fleetwise's code.
PUBLISHED = {
    "llama/llama3_1b": 1_235_814_400,  # meta-llama/Llama-3.2-1B: 1.24B params (tied head)
    "llama/llama3_8b": 8_030_261_248,  # meta-llama/Llama-3.1-8B: 8.03B params
    "llama/llama3_70b": 70_553_706_496,  # meta-llama/Llama-3.1-70B: 70.6B params
    "llama/llama3_405b": 405_853_388_800,  # meta-llama/Llama-3.1-405B: 406B params
    "llama/qwen3_8b": 8_190_735_360,  # Qwen/Qwen3-8B: 8.19B params (q/k norms)
}
# (layers, width, heads, kv heads, head width, SwiGLU width, vocabulary, tied, q/k norm) as in each
# model's config.json
SHAPES = {
    "llama/llama3_1b": (16, 2048, 32, 8, 64, 8192, 128256, True, False),
    "llama/llama3_8b": (32, 4096, 32, 8, 128, 14336, 128256, False, False),
    "llama/llama3_70b": (80, 8192, 64, 8, 128, 28672, 128256, False, False),
    "llama/llama3_405b": (126, 16384, 128, 8, 128, 53248, 128256, False, False),
    "llama/qwen3_8b": (36, 4096, 32, 8, 128, 12288, 151936, False, True),
}


def by_hand(layers, h, a, g, d, f, v, tied, qk_norm) -> int:
    attention = h * a * d + 2 * h * g * d + a * d * h
    block = attention + 3 * h * f + 2 * h + (2 * d if qk_norm else 0)
    return layers * block + v * h * (1 if tied else 2) + h


@pytest.mark.parametrize("recipe", list(PUBLISHED))
def test_recipes_have_the_published_shapes_and_parameter_counts(recipe):
    import torch

    from fleetwise.runtime.modeling import build_meta_model

    cfg, problems = compose(f"recipe={recipe}")
    assert problems == [], problems
    m = cfg.model
    shape = (
        m.num_layers,
        m.hidden_size,
        m.num_attention_heads,
        m.num_kv_heads,
        m.head_width,
        m.ffn_hidden_size,  # Llama 3: from ffn_dim_multiplier and multiple_of (Meta's rule)
        m.vocab_size,
        m.tie_word_embeddings,
        m.qk_norm,
    )
    assert shape == SHAPES[recipe]
    assert by_hand(*shape) == PUBLISHED[recipe]
    assert total_params(m) == PUBLISHED[recipe]  # the planner's units
    with torch.device("meta"):
        model = build_meta_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[recipe]


@pytest.mark.parametrize(
    ("hidden", "multiplier", "multiple_of", "width"),
    [
        # Meta's FeedForward: int(2·4h/3), × multiplier (truncated), rounded up to multiple_of
        (4096, 1.3, 1024, 14336),  # Llama 3 8B
        (8192, 1.3, 4096, 28672),  # 70B
        (16384, 1.2, 4096, 53248),  # 405B
        (2048, 1.5, 256, 8192),  # 3.2 1B
        (3072, 1.0, 256, 8192),  # 3.2 3B
        (4096, None, 256, 11008),  # Llama 2 7B (no multiplier)
        (64, None, 64, 192),  # llama/tiny: 170 -> 192
    ],
)
def test_swiglu_width_follows_metas_rule(hidden, multiplier, multiple_of, width):
    from fleetwise.families.llama.schema import LlamaModel

    m = LlamaModel(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=8,
        num_kv_heads=8,
        vocab_size=256,
        seq_len=8,
        ffn_dim_multiplier=multiplier,
        multiple_of=multiple_of,
    )
    assert m.ffn_hidden_size == width
    assert LlamaModel(**{**m.model_dump(), "intermediate_size": 100}).ffn_hidden_size == 100


def built_and_planned(*overrides):
    """(config, model, planner units, parameters counted in the built model per unit: embedding,
    each block, final norm + head)."""
    from fleetwise.runtime.modeling import build_model

    cfg, problems = compose(*overrides)
    assert problems == [], problems
    model = build_model(cfg)
    groups = [[model.embed], *([b] for b in model.layers.values()), [model.norm, model.output]]
    counted = [sum(p.numel() for g in group for p in g.parameters()) for group in groups]
    return cfg, model, model_units(cfg.model), counted


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("model.num_kv_heads=8",),
        ("model.num_kv_heads=1", "model.qk_norm=true"),
        ("model.tie_word_embeddings=true", "model.head_dim=32", "model.intermediate_size=100"),
    ],
)
def test_built_model_matches_its_units(overrides):
    """Parameters per unit (embedding, each block, head) of the built model equal the planner's."""
    cfg, model, units, counted = built_and_planned("recipe=llama/tiny", *overrides)
    assert counted == [u.params for u in units]
    names = {n for n, _ in model.named_parameters()}
    assert ("output.weight" in names) != cfg.model.tie_word_embeddings
    assert ("layers.0.attn.q_norm.weight" in names) == cfg.model.qk_norm


def test_bad_shapes_are_all_reported_with_fixes():
    cfg, problems = compose(
        "recipe=llama/tiny",
        "model.num_kv_heads=3",  # 8 heads do not group into 3
        "model.hidden_size=66",  # 66 / 8 heads
        "model.rope_scaling={factor:8,low_freq_factor:4,high_freq_factor:1}",
        "strategy=hybrid",
        "strategy.mp_degree=4",  # divides heads (8) and the vocabulary, not kv heads (3)
        "strategy.pp_degree=2",
        "model.tie_word_embeddings=true",
    )
    assert cfg is None
    by_loc = {}
    for p in problems:
        by_loc.setdefault(p.loc, []).append(p)
    assert "model.num_kv_heads" in by_loc
    assert "model.hidden_size" in by_loc
    assert "model.rope_scaling.high_freq_factor" in by_loc
    assert any("num_kv_heads=3" in p.msg for p in by_loc["strategy.mp_degree"])
    assert any("tie_word_embeddings" in p.msg for p in by_loc["strategy.pp_degree"])
    assert all(p.hint for p in problems)


def test_tensor_parallel_must_divide_heads_kv_heads_vocab_and_mlp():
    ok, problems = compose("recipe=llama/tiny", "strategy=mp", "strategy.mp_degree=2")
    assert problems == []
    _, problems = compose("recipe=llama/tiny", "strategy=mp", "strategy.mp_degree=8")  # kv heads 4
    assert [p.loc for p in problems] == ["strategy.mp_degree"]
    assert "num_kv_heads=4" in problems[0].msg and "use an mp_degree that divides 4" in problems[0].hint
    # the vocabulary is not padded: 250 tokens do not split over 4
    _, problems = compose(
        "recipe=llama/tiny",
        "data=synthetic",
        "strategy=mp",
        "strategy.mp_degree=4",
        "model.vocab_size=250",
    )
    assert [p.loc for p in problems] == ["strategy.mp_degree"]
    assert "vocab_size=250" in problems[0].msg and "model.vocab_size=252" in problems[0].hint
    # the SwiGLU width from the multiplier (64 -> int(170 · 1.1) = 187 -> multiple_of 1: 187)
    _, problems = compose(
        "recipe=llama/tiny",
        "strategy=mp",
        "strategy.mp_degree=2",
        "model.ffn_dim_multiplier=1.1",
        "model.multiple_of=1",
    )
    assert [p.loc for p in problems] == ["strategy.mp_degree"] and "187" in problems[0].msg
    # sequence parallel: the sequence splits over mp
    _, problems = compose(
        "recipe=llama/tiny",
        "strategy=mp",
        "strategy.mp_degree=2",
        "strategy.sequence_parallel=true",
        "model.seq_len=33",
    )
    assert [p.loc for p in problems] == ["strategy.sequence_parallel"]


def test_tied_embeddings_train_under_every_strategy_but_a_pipeline():
    for layout in (
        ("strategy=dp",),
        ("strategy=sharding", "strategy.sharding_stage=3"),
        ("strategy=mp", "strategy.mp_degree=2", "strategy.sequence_parallel=true"),
    ):
        _, problems = compose("recipe=llama/tiny", "model.tie_word_embeddings=true", *layout)
        assert problems == [], (layout, problems)
    _, problems = compose("recipe=llama/tiny", "model.tie_word_embeddings=true", "strategy=pp", "strategy.pp_degree=2")
    assert [p.loc for p in problems] == ["strategy.pp_degree"]
    assert "tie_word_embeddings=false" in problems[0].hint


def test_strategy_auto_searches_only_the_layouts_llama_allows():
    """8 CPU ranks, 2 kv heads and a tied head: every layout the search ranks splits the kv heads
    evenly (mp 1 or 2) and has no pipeline; the winner is one of them and validates."""
    from fleetwise.launcher.auto import resolve_auto

    tiny = ["recipe=llama/tiny", "model.num_kv_heads=2", "model.tie_word_embeddings=true", "hardware.devices_per_node=8"]
    out = resolve_auto(["strategy=auto", *tiny], progress=False)
    assert out.problems == []
    ranked = out.result.ranked
    assert ranked and out.result.legal >= len(ranked)
    assert {c.strategy["mp_degree"] for c in ranked} <= {1, 2}
    assert {c.strategy["pp_degree"] for c in ranked} == {1}
    cfg, problems = compose(*tiny, *out.layout_overrides)
    assert problems == [] and cfg.strategy.mp_degree in (1, 2)


# Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1): the model card's 46.7B parameters, 12.9B active a
# token (Mistral's announcement); exactly, from its config.json, by hand below
MIXTRAL_TOTAL, MIXTRAL_ACTIVE = 46_702_792_704, 12_879_925_248


def test_mixtral_has_the_published_total_and_active_parameter_counts():
    import torch

    from fleetwise.runtime.modeling import build_meta_model

    cfg, problems = compose("recipe=llama/mixtral_8x7b")
    assert problems == [], problems
    layers, h, heads, kv, d, f, v, experts, k = 32, 4096, 32, 8, 128, 14336, 32000, 8, 2
    m = cfg.model
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.head_width, m.ffn_hidden_size)
    assert shape == (layers, h, heads, kv, d, f)
    assert (m.vocab_size, m.moe.num_experts, m.moe.top_k) == (v, experts, k)
    attention = 2 * h * heads * d + 2 * h * kv * d
    block = attention + h * experts + 2 * h  # + router + two norms
    assert layers * (block + experts * 3 * h * f) + 2 * v * h + h == MIXTRAL_TOTAL
    assert layers * (block + k * 3 * h * f) + 2 * v * h + h == MIXTRAL_ACTIVE
    units = model_units(m)
    assert total_params(m) == MIXTRAL_TOTAL
    assert sum(u.active_params for u in units) == MIXTRAL_ACTIVE
    with torch.device("meta"):
        model = build_meta_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == MIXTRAL_TOTAL
    # FLOPs count the active parameters: 2 per multiply-add of every active matrix, plus attention
    s = m.seq_len
    matmuls = MIXTRAL_ACTIVE - 2 * layers * h - h - v * h  # less the norms and the embedding lookup
    assert sum(u.fwd_flops for u in units) == 2 * s * matmuls + layers * 4 * s * s * heads * d
    from fleetwise.plan.planner import make_plan

    assert make_plan(cfg).active_params == MIXTRAL_ACTIVE


def test_qwen3_30b_a3b_has_the_published_parameter_count():
    """Qwen/Qwen3-30B-A3B's config.json, by hand: 30,532,122,624 parameters (the model card's 30.5B)."""
    import torch

    from fleetwise.runtime.modeling import build_meta_model

    cfg, problems = compose("recipe=llama/qwen3_30b_a3b")
    assert problems == [], problems
    layers, h, heads, kv, d, v, experts, k, f = 48, 2048, 32, 4, 128, 151936, 128, 8, 768
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.head_width) == (layers, h, heads, kv, d)
    assert (m.vocab_size, m.moe.num_experts, m.moe.top_k, m.moe.expert_ffn_size) == (v, experts, k, f)
    assert (m.moe.num_shared_experts, m.tie_word_embeddings, m.qk_norm) == (0, False, True)
    assert (m.rope_theta, m.rms_norm_eps) == (1e6, 1e-6)
    attention = 2 * h * heads * d + 2 * h * kv * d + 2 * d  # q, o; k, v; q and k norms (one head wide)
    block = attention + h * experts + experts * 3 * h * f + 2 * h  # + router, experts, two norms
    total = layers * block + 2 * v * h + h  # + embedding, untied head, final norm
    assert total == 30_532_122_624
    assert total_params(m) == total
    with torch.device("meta"):
        model = build_meta_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == total
    from fleetwise.plan.planner import make_plan

    active = layers * (attention + h * experts + k * 3 * h * f + 2 * h) + 2 * v * h + h
    assert make_plan(cfg).active_params == active == 3_353_032_704  # the card's 3.3B


def test_moe_tiny_matches_its_units_and_keeps_its_first_block_dense():
    _, model, units, counted = built_and_planned("recipe=llama/moe_tiny", "model.moe.interval=2")
    assert counted == [u.params for u in units]
    # blocks 1 and 3 are MoE (first_dense_layers=1, interval=2): a router [4, 64], 4 experts of
    # width 64 (3 matrices each), a shared expert of width 64; a token uses 2 of the 4 experts
    names = {n for n, _ in model.named_parameters()}
    assert [f"layers.{i}.mlp.router.gate.weight" in names for i in range(4)] == [False, True, False, True]
    moe_params = 4 * 64 + 4 * 3 * 64 * 64 + 3 * 64 * 64
    dense = units[1].params
    assert units[2].params - dense == moe_params - 3 * 64 * 192
    assert units[2].params - units[2].active_params == 2 * 3 * 64 * 64


def test_bad_moe_configs_are_all_reported_with_fixes():
    _, problems = compose(
        "recipe=llama/moe_tiny",
        "model.moe.top_k=5",  # of 4 experts
        "model.moe.first_dense_layers=4",  # of 4 blocks
        "model.moe.aux_loss_coef=0",
        "strategy=mp",
        "strategy.mp_degree=2",
        "strategy.sequence_parallel=true",
        "train.compile=true",
    )
    by_loc = {p.loc: p for p in problems}
    assert set(by_loc) == {
        "model.moe.top_k",
        "model.moe.first_dense_layers",
        "model.moe.aux_loss_coef",
        "strategy.sequence_parallel",
        "train.compile",
    }, problems
    assert "top_k=5" in by_loc["model.moe.top_k"].msg and "at most 4" in by_loc["model.moe.top_k"].hint
    assert "strategy.sequence_parallel=false" in by_loc["strategy.sequence_parallel"].hint
    assert all(p.hint for p in problems)
    _, problems = compose("recipe=llama/moe_tiny", "model.moe.num_experts=100000")
    assert [p.loc for p in problems] == ["model.moe.num_experts"]


def test_hugging_face_export_refuses_experts_it_cannot_express(tmp_path):
    """Export writes Mixtral and Qwen3-MoE (tests/unit/families/llama/test_hf_moe.py): llama/moe_tiny's
    shared expert and dense block without q/k norms are neither, and the exporter says so and what
    to do instead."""
    from fleetwise.families.llama.weights import WeightsError, write_hf_dir

    cfg, _ = compose("recipe=llama/moe_tiny")
    with pytest.raises(WeightsError, match="num_shared_experts=1.*dense blocks without q/k norms.*--format torch"):
        write_hf_dir(cfg.model, tmp_path / "out", {}, read=None)


def test_rms_norms_save_an_fp32_copy_of_their_input_whatever_the_precision():
    """RMSNorm normalises `x.float()` (as Hugging Face's): in a bf16 FSDP job (16-bit residual
    stream) each norm saves its input's fp32 copy and the per-token rsqrt in fp32, and only the
    normalised input in bf16; the q/k norms likewise per head. Counted at 2 bytes, Qwen 3 8B (4
    layers, its recipe's layout) planned 3,781,166,080 B against the dry run's 3,911,769,300 B
    (-3.34%); Mixtral at 64 ranks missed 64 MiB a layer."""
    from fleetwise.families.llama.units import block
    from fleetwise.plan import make_plan

    cfg, problems = compose("recipe=llama/qwen3_8b", "model.num_layers=4")
    assert problems == [], problems
    m = cfg.model
    s, h, q, kv = m.seq_len, m.hidden_size, m.num_attention_heads * m.head_width, m.num_kv_heads * m.head_width
    none = block(m).saved("none")
    assert none.sp == 2 * s * h  # the two normalised inputs, in the residual's dtype
    assert none.sp32 == 2 * (s * h + s)  # their fp32 inputs and rsqrt
    assert none.fp32 == s * (q + kv) + s * (m.num_attention_heads + m.num_kv_heads)  # q/k norms'
    assert abs(make_plan(cfg).memory_bytes["total"] / 3_911_769_300 - 1) < 0.005
