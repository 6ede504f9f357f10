from pathlib import Path

from fleetwise.config.layout import Layout

REPO = Path(__file__).resolve().parents[2]


def test_platform_is_a_source_root_without_init():
    # An __init__.py would make `platform` a package that shadows the standard library module.
    assert not (REPO / "platform" / "__init__.py").exists()
    import platform

    assert hasattr(platform, "python_version")


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
