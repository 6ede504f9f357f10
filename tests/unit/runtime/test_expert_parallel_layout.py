"""Where expert parallelism and tensor parallelism put a mixture of experts on a 4D layout, without
starting processes: the expert groups at each pipeline stage and mp rank (runtime/expert_parallel.py
`expert_ranks`), and the tensor-parallel plan that leaves the MoE blocks' MLPs whole
(runtime/parallelize.py `_existing`)."""

from __future__ import annotations

from helpers.config import compose


def test_expert_groups_are_consecutive_data_ranks_at_each_stage_and_mp_rank():
    from fleetwise.config.layout import Layout
    from fleetwise.runtime.expert_parallel import expert_ranks

    # the parity test's layout: pp 2 × sharding 2 × mp 2, ep 2 (edp 1); rank = (pp·2 + sh)·2 + mp
    assert expert_ranks(Layout(pp=2, sharding=2, mp=2), 2) == [[[[0, 2]], [[1, 3]]], [[[4, 6]], [[5, 7]]]]
    # dp 2 × sharding 2 × mp 2 (16 ranks with pp 2), ep 2: data rank = dp·2 + sharding, the groups
    # (data ranks 0, 1) and (2, 3); edp pairs the same place of both groups
    lay = Layout(dp=2, pp=2, sharding=2, mp=2)
    got = expert_ranks(lay, 2)
    for p in range(2):
        for m in range(2):
            for g in range(2):
                for i in range(2):
                    d = g * 2 + i
                    c = lay.coords(got[p][m][g][i])
                    assert (c["pp"], c["mp"], c["dp"] * 2 + c["sharding"]) == (p, m, d)
    # every rank exactly once
    flat = [r for a in got for b in a for c in b for r in c]
    assert sorted(flat) == list(range(lay.world_size))


def test_the_tensor_parallel_plan_leaves_the_moe_blocks_mlps_alone():
    from fleetwise.runtime.modeling import build_meta_model, model_spec
    from fleetwise.runtime.parallelize import _existing

    cfg, problems = compose(
        "recipe=llama/moe_tiny", "strategy=mp", "strategy.mp_degree=2", "hardware.devices_per_node=2"
    )
    assert problems == []
    model = build_meta_model(cfg)
    plan = _existing(model, model_spec(cfg).tp_plan(False))
    mlp = sorted(k for k in plan if ".mlp" in k)
    # block 0 is dense (its gated MLP column/row parallel, its input prepared once); 1-3 are MoE
    assert mlp == ["layers.0.mlp", "layers.0.mlp.down", "layers.0.mlp.gate", "layers.0.mlp.up"], mlp
    assert "layers.*.attn.wq" in plan and "output" in plan
    # a dense model's plan is untouched
    dense, _ = compose(
        "recipe=llama/tiny", "strategy=mp", "strategy.mp_degree=2", "hardware.devices_per_node=2"
    )
    assert "layers.*.mlp.gate" in _existing(build_meta_model(dense), model_spec(dense).tp_plan(False))


def test_experts_are_sharded_along_their_rows_where_the_fsdp_ranks_outnumber_them():
    """Without expert parallelism a MoE block's FSDP unit shards its [E, rows, cols] expert weights
    along the rows (Shard(1)) where more ranks than experts share it and the rows split evenly --
    along the experts, Mixtral's 8 over 64 ranks left ranks 8-63 without any -- and along the
    experts (FSDP's default) everywhere else."""
    from torch.distributed.tensor import Shard

    from fleetwise.runtime.expert_parallel import expert_placement, expert_shard_dim
    from fleetwise.runtime.modeling import build_meta_model

    # Mixtral: 8 experts, w1/w3 [8, 14336, 4096], w2 [8, 4096, 14336]
    assert [expert_shard_dim(8, 14336, n) for n in (1, 4, 8, 16, 64)] == [0, 0, 0, 1, 1]
    assert expert_shard_dim(8, 4096, 64) == 1
    assert expert_shard_dim(8, 14336, 12) == 0  # 14,336 rows do not split over 12 ranks
    assert expert_shard_dim(4, 64, 128) == 0  # nor 64 over 128

    cfg, problems = compose("recipe=llama/moe_tiny")  # 4 experts [4, 64, 64] in blocks 1-3
    assert problems == []
    model = build_meta_model(cfg)
    assert expert_placement(model.layers["0"], 8) is None  # a dense block
    assert expert_placement(model.layers["1"], 4) is None  # 4 ranks, 4 experts: one each
    rule = expert_placement(model.layers["1"], 8)
    block = model.layers["1"]
    for name, p in block.named_parameters():
        expected = Shard(1) if name.startswith("mlp.experts.") else None
        assert rule(p) == expected, name
    assert sum(rule(p) is not None for p in block.parameters()) == 3
