"""dryrun/parent.py `compare`: the planner's communication beside the dry run's, group by group --
every group either side names is compared or shown as missing on the other, none dropped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fleetwise.dryrun.parent import compare


def _compare(planned: dict[str, int], measured: dict[str, int]) -> dict[str, dict]:
    plan = SimpleNamespace(stages=[], memory_bytes={"total": 100}, comm_bytes_per_step=planned)
    report = {
        "coords": {"pp": 0},
        "memory_bytes": {"peak": 100},
        "flops_per_step": 0,
        "comm_bytes_per_step": measured,
    }
    return compare(plan, report)["comm_bytes_per_step"]


def test_every_group_is_compared_and_one_on_one_side_only_shows():
    # DDP over dp x sharding counts as dp; the expert groups as the dry run names them before they
    # have a name (a c10d number, "5") do not match the planner's "ep": both show, as missing
    comm = _compare(
        {"dp": 1000, "mp": 300, "pp": 0, "ep": 40},
        {"dp+sharding": 990, "mp": 300, "5": 40, "world": 8},
    )
    assert comm["dp"] == {"planner": 1000, "dryrun": 990, "rel": pytest.approx(10 / 990)}
    assert comm["mp"] == {"planner": 300, "dryrun": 300, "rel": 0.0}
    assert comm["ep"] == {"planner": 40, "dryrun": 0, "rel": None, "missing": "dryrun"}
    assert comm["5"] == {"planner": 0, "dryrun": 40, "rel": -1.0, "missing": "planner"}
    assert comm["world"] == {"planner": 0, "dryrun": 8, "rel": -1.0, "missing": "planner"}
    # nothing the dry run counted is dropped
    assert sum(v["dryrun"] for v in comm.values()) == 990 + 300 + 40 + 8


def test_a_named_group_is_compared_like_the_others():
    comm = _compare(
        {"dp": 500, "ep": 40, "edp": 64, "cp": 12},
        {"dp": 250, "dp+cp": 250, "ep": 40, "edp": 60, "cp": 12, "sharding+cp": 0},
    )
    assert comm["dp"] == {"planner": 500, "dryrun": 500, "rel": 0.0}
    assert comm["ep"] == {"planner": 40, "dryrun": 40, "rel": 0.0}
    assert comm["edp"] == {"planner": 64, "dryrun": 60, "rel": pytest.approx(4 / 60)}
    assert comm["cp"] == {"planner": 12, "dryrun": 12, "rel": 0.0}
    assert not any("missing" in v for v in comm.values())
    assert set(comm) == {"dp", "sharding", "mp", "pp", "ep", "edp", "cp"}
