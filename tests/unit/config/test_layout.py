"""The parallel layout (config/layout.py): rank coordinates, sub-meshes, the degrees it resolves."""

from fleetwise.config.layout import Layout


def test_rank_coordinates_put_mp_innermost_and_dp_outermost():
    lay = Layout(dp=2, pp=2, sharding=2, mp=2)
    assert lay.world_size == 16
    assert lay.coords(0) == {"dp": 0, "pp": 0, "sharding": 0, "mp": 0}
    assert lay.coords(1) == {"dp": 0, "pp": 0, "sharding": 0, "mp": 1}
    assert lay.coords(2) == {"dp": 0, "pp": 0, "sharding": 1, "mp": 0}
    assert lay.coords(4) == {"dp": 0, "pp": 1, "sharding": 0, "mp": 0}
    assert lay.coords(8) == {"dp": 1, "pp": 0, "sharding": 0, "mp": 0}
    # consecutive-rank span of each dimension's groups: mp 2, sharding 4, pp 8, dp 16
    assert [lay.span(d) for d in ("mp", "sharding", "pp", "dp")] == [2, 4, 8, 16]
    assert lay.data_parallel_size == 4


def test_rank_of_inverts_coords_and_data_rank_numbers_the_sample_readers():
    lay = Layout(dp=2, pp=2, sharding=3, mp=2)
    assert [lay.rank_of(lay.coords(r)) for r in range(lay.world_size)] == list(range(lay.world_size))
    readers = {lay.data_rank(r) for r in range(lay.world_size)}
    assert readers == set(range(lay.data_parallel_size))
    # mp and pp peers of a rank read the same samples
    c = lay.coords(5)
    assert {lay.data_rank(lay.rank_of({**c, "mp": m, "pp": p})) for m in (0, 1) for p in (0, 1)} == {
        lay.data_rank(5)
    }


def test_engine_sub_meshes():
    assert Layout(dp=2, sharding=2).fsdp_dims == ("dp", "sharding")  # HSDP
    assert Layout(sharding=4).fsdp_dims == ("sharding",)
    assert Layout().grad_sync_dims("ddp") == ("dp",)


def test_context_parallel_sits_between_sharding_and_mp_and_shares_gradients():
    lay = Layout(dp=2, sharding=2, cp=2, mp=2)
    assert lay.world_size == 16 and lay.dims == ("dp", "pp", "sharding", "cp", "mp")
    assert lay.coords(1) == {"dp": 0, "pp": 0, "sharding": 0, "cp": 0, "mp": 1}
    assert lay.coords(2) == {"dp": 0, "pp": 0, "sharding": 0, "cp": 1, "mp": 0}
    assert lay.coords(4) == {"dp": 0, "pp": 0, "sharding": 1, "cp": 0, "mp": 0}
    assert [lay.rank_of(lay.coords(r)) for r in range(16)] == list(range(16))
    # cp peers read the same samples (each keeps its chunks of them)
    assert lay.data_parallel_size == 4 and lay.data_rank(0) == lay.data_rank(2)
    # FSDP shards over sharding × cp (flattened), replicates over dp; DDP averages over dp × cp
    assert lay.fsdp_dims == ("dp", "sharding_cp")
    assert Layout(cp=4).fsdp_dims == ("sharding_cp",)
    assert lay.grad_sync_dims("ddp") == ("dp", "cp")
    assert Layout(cp=2).grad_sync_dims("ddp") == ("cp",)  # dp 1: the cp group itself
    # cp 1: the mesh and the plan's mesh keep their four dims
    assert Layout(dp=2).dims == ("dp", "pp", "sharding", "mp") and "cp" not in Layout(dp=2).as_dict()
    assert lay.as_dict()["cp"] == 2


def test_resolve_counts_cp_in_the_world_size():
    from fleetwise.config.strategy import HybridStrategy

    lay, problems = Layout.resolve(HybridStrategy(cp_degree=2, dp_degree="auto"), 8)
    assert problems == [] and lay == Layout(dp=4, cp=2)
    lay, (p,) = Layout.resolve(HybridStrategy(cp_degree=4, dp_degree=3), 8)
    assert lay is None and "cp_degree(4)" in p.msg and "world_size(8)" in p.msg


def test_resolve_derives_the_auto_degree_and_names_every_factor():
    from fleetwise.config.strategy import HybridStrategy

    lay, problems = Layout.resolve(HybridStrategy(mp_degree=2, pp_degree=2, dp_degree="auto"), 16)
    assert problems == [] and lay == Layout(dp=4, pp=2, mp=2)
    lay, problems = Layout.resolve(HybridStrategy(mp_degree=2, pp_degree=3), 8)
    assert lay is None
    (p,) = problems
    assert "mp_degree(2)" in p.msg and "pp_degree(3)" in p.msg and "world_size(8)" in p.msg
