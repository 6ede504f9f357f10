"""Context parallelism's rules (config/rules/context_parallel.py): every problem at once, each with its
config path, values and fix; the world-size rule counts cp."""

from __future__ import annotations

from helpers.config import compose

CP = ("strategy=hybrid", "strategy.cp_degree=2")


def _problems(*overrides: str) -> dict[str, str]:
    cfg, problems = compose(*overrides)
    assert cfg is None or not problems
    return {p.loc: f"{p.msg} | {p.hint}" for p in problems}


def test_a_good_cp_layout_validates_and_resolves():
    cfg, problems = compose(
        "recipe=gpt/tiny", *CP, "strategy.cp_method=ulysses", "hardware.devices_per_node=4"
    )
    assert problems == []
    s = cfg.strategy
    assert (s.dp_degree, s.cp_degree, s.cp_method) == (2, 2, "ulysses")  # dp auto takes what cp leaves
    cfg, problems = compose("recipe=llama/tiny", *CP, "hardware.devices_per_node=2")
    assert problems == [], problems


def test_every_shape_problem_at_once_with_its_fix():
    got = _problems(
        "recipe=gpt/tiny",
        "strategy=hybrid",
        "strategy.cp_degree=3",
        "strategy.cp_method=ulysses",
        "hardware.devices_per_node=3",
        "model.seq_len=32",
        "model.dropout=0.1",
    )
    assert "2 × cp_degree = 6" in got["model.seq_len"] and "multiple of 6 (e.g. 30)" in got["model.seq_len"]
    assert "cp_degree=2" in got["model.seq_len"]  # a cp that divides
    assert "num_attention_heads=4 does not divide by cp_degree=3" in got["model.num_attention_heads"]
    assert "cp_method=ring" in got["model.num_attention_heads"]
    assert "model.dropout=0" in got["model.dropout"]


def test_llama_kv_heads_must_divide_for_ulysses_only():
    ulysses = _problems(
        "recipe=llama/tiny",
        *CP,
        "strategy.cp_degree=4",
        "strategy.cp_method=ulysses",
        "hardware.devices_per_node=4",
        "model.num_kv_heads=2",
    )
    assert "num_kv_heads=2 does not divide by cp_degree=4" in ulysses["model.num_kv_heads"]
    ring = _problems(
        "recipe=llama/tiny",
        *CP,
        "strategy.cp_degree=4",
        "hardware.devices_per_node=4",
        "model.num_kv_heads=2",
    )
    assert "model.num_kv_heads" not in ring


def test_world_size_counts_cp_and_presets_point_to_hybrid():
    got = _problems(
        "recipe=gpt/tiny",
        "strategy=dp",
        "strategy.dp_degree=2",
        "strategy.cp_degree=2",
        "hardware.devices_per_node=2",
    )
    assert "cp_degree(2)" in got["strategy"] and "world_size(2)" in got["strategy"]
    assert "strategy=hybrid" in got["strategy.cp_degree"]


def test_what_this_stage_does_not_combine_is_refused_with_a_reason():
    got = _problems(
        "recipe=gpt/tiny",
        *CP,
        "strategy.sharding_degree=2",
        "strategy.sharding_stage=1",
        "train.compile=true",
        "hardware.devices_per_node=4",
    )
    # pipeline and tensor (and sequence) parallelism combine: cp 2 × mp 2 × pp 2 validates
    assert "strategy.pp_degree" not in got and "strategy.mp_degree" not in got
    assert (
        _problems(
            "recipe=gpt/tiny",
            *CP,
            "strategy.mp_degree=2",
            "strategy.sequence_parallel=true",
            "strategy.pp_degree=2",
            "hardware.devices_per_node=8",
        )
        == {}
    )
    assert "sharding_stage=2 or 3" in got["strategy.sharding_stage"]
    assert "train.compile=false" in got["train.compile"]
    assert (
        "causal decoders only"
        in _problems("recipe=ernie/tiny", *CP, "hardware.devices_per_node=2")["strategy.cp_degree"]
    )
    moe = _problems("recipe=llama/moe_tiny", *CP, "hardware.devices_per_node=2")
    assert "model.moe.num_experts=0" in moe["model.moe.num_experts"]
    # packed documents run under cp (document masks across the chunks); a pipeline still refuses them
    packed = _problems("recipe=llama/tiny", "data=jsonl", *CP, "hardware.devices_per_node=2")
    assert "data.source" not in packed and "strategy.pp_degree" not in packed, packed
    piped = _problems(
        "recipe=llama/tiny", "data=jsonl", *CP, "strategy.pp_degree=2", "hardware.devices_per_node=4"
    )
    assert "pass between pipeline stages" in piped["strategy.pp_degree"]


def test_a_sharding_stage_shards_over_cp_alone_but_still_needs_something_to_shard_over():
    """sharding_degree 1 with stage 2/3 under cp: FSDP over the cp ranks (no problem); stage 1
    is ZeRO-1's (refused with cp); without cp a stage at sharding 1 still has nothing to shard."""
    assert _problems("recipe=gpt/tiny", *CP, "strategy.sharding_stage=3", "hardware.devices_per_node=2") == {}
    stage1 = _problems("recipe=gpt/tiny", *CP, "strategy.sharding_stage=1", "hardware.devices_per_node=2")
    assert list(stage1) == ["strategy.sharding_stage"] and "ZeRO-1" in stage1["strategy.sharding_stage"]
    alone = _problems(
        "recipe=gpt/tiny", "strategy=hybrid", "strategy.sharding_stage=3", "hardware.devices_per_node=2"
    )
    assert "nothing to shard over" in alone["strategy.sharding_stage"]


def test_tensor_parallelism_combines_and_tightens_the_shapes():
    """cp × mp runs; sequence parallelism splits each cp rank's chunks over mp (seq_len divides by
    2·cp·mp), ulysses splits an mp rank's heads over cp (heads divide by cp·mp) -- all at once."""
    ring = ("recipe=gpt/tiny", *CP, "strategy.mp_degree=2", "hardware.devices_per_node=4")
    assert _problems(*ring, "strategy.sequence_parallel=true") == {}  # seq 32, 4 heads
    assert _problems(*ring, "strategy.cp_method=ulysses") == {}
    got = _problems(
        *ring,
        "strategy.sequence_parallel=true",
        "strategy.cp_method=ulysses",
        "model.seq_len=36",
        "model.hidden_size=48",
        "model.num_attention_heads=6",
    )
    assert "2 × cp_degree × mp_degree 2 (sequence parallel) = 8" in got["model.seq_len"]
    assert "multiple of 8 (e.g. 32)" in got["model.seq_len"]
    heads = got["model.num_attention_heads"]
    assert "num_attention_heads=6 does not divide by cp_degree=2 × mp_degree=2 = 4" in heads
    assert "cp_method=ring" in heads
    # without sequence parallelism the chunks need 2·cp only
    assert "model.seq_len" not in _problems(*ring, "model.seq_len=36")
    kv = _problems(
        "recipe=llama/tiny",
        *CP,
        "strategy.mp_degree=2",
        "strategy.cp_method=ulysses",
        "hardware.devices_per_node=4",
        "model.num_kv_heads=2",
    )
    assert "num_kv_heads=2 does not divide by cp_degree=2 × mp_degree=2 = 4" in kv["model.num_kv_heads"]
