"""Parameter-server placement (no torch): dispatch, slicing, sparse row sharding, bytes per server."""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest
from helpers.config import compose

from fleetwise.families import total_params
from fleetwise.families.ctr.units import parameter_shapes as ctr_parameter_shapes
from fleetwise.plan.planner import make_plan
from fleetwise.plan.ps import dispatch, placement, slice_rows, stable_hash


def ps_cfg(*overrides: str):
    cfg, problems = compose("recipe=ctr/tiny", *overrides)
    assert cfg is not None, problems
    return cfg


def test_round_robin_deals_blocks_in_model_order():
    assert dispatch(["a", "b", "c", "d", "e"], 2, "round_robin") == [0, 1, 0, 1, 0]
    cfg = ps_cfg("strategy.slice_var_up=false")
    place = placement(cfg)
    assert [b.server for b in place.dense] == [i % 2 for i in range(len(place.dense))]
    # the 4 distributed tables (embedding + first order each) are not dense variables
    assert [b.name for b in place.dense] == [n for n, _ in ctr_parameter_shapes(cfg.model)][8:]


@pytest.mark.slow  # starts processes
def test_hash_name_is_crc32_and_the_same_in_every_process():
    keys = ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight.block1"]
    assert dispatch(keys, 3, "hash_name") == [zlib.crc32(k.encode()) % 3 for k in keys]
    # Python's own hash() is salted per process; the placement must not be
    code = "from fleetwise.plan.ps import stable_hash; print(stable_hash('mlp.0.weight'))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed}
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {str(stable_hash("mlp.0.weight"))}


def test_only_variables_above_the_threshold_are_sliced_into_row_blocks():
    assert slice_rows((32, 36), 2, 8192, True) == [(0, 32)]  # 1152 elements: whole
    assert slice_rows((32, 36), 2, 1000, True) == [(0, 16), (16, 32)]
    assert slice_rows((33, 36), 4, 1000, True) == [(0, 9), (9, 18), (18, 27), (27, 33)]
    assert slice_rows((3, 1000), 4, 1000, True) == [(0, 1), (1, 2), (2, 3)]  # at most one block per row
    assert slice_rows((32, 36), 2, 1000, False) == [(0, 32)]
    assert slice_rows((100,), 2, 50, True) == [(0, 50), (50, 100)]  # vectors by element
    place = placement(ps_cfg("strategy.slice_min_elements=64"))
    sliced = [b for b in place.dense if b.sliced]
    assert {b.name for b in sliced} == {"mlp.0.weight", "mlp.2.weight"}
    # round robin over blocks: the two halves of a sliced variable land on different servers
    for name in ("mlp.0.weight", "mlp.2.weight"):
        assert sorted(b.server for b in sliced if b.name == name) == [0, 1]
    assert [b.key for b in sliced if b.name == "mlp.0.weight"] == [
        "mlp.0.weight.block0",
        "mlp.0.weight.block1",
    ]


def test_blocks_cover_every_dense_parameter_exactly_once():
    for overrides in [
        (),
        ("strategy.dispatch=hash_name", "strategy.slice_min_elements=64", "strategy.num_servers=3"),
    ]:
        cfg = ps_cfg(*overrides)
        place = placement(cfg)
        shapes = dict(ctr_parameter_shapes(cfg.model))
        for name in place.dense_names:
            blocks = sorted((b for b in place.dense if b.name == name), key=lambda b: b.index)
            assert blocks[0].row_start == 0 and blocks[-1].row_stop == shapes[name][0]
            assert all(a.row_stop == b.row_start for a, b in zip(blocks, blocks[1:], strict=False))
        dense = sum(b.numel for b in place.dense)
        sparse = sum(t.num_rows * t.width for t in place.tables)
        assert dense + sparse == total_params(cfg.model)


def test_sparse_rows_are_sharded_by_id_modulo_servers():
    place = placement(ps_cfg("strategy.num_servers=3"))
    user = next(t for t in place.tables if t.name == "user_id")
    assert [user.rows_on(s, 3) for s in range(3)] == [1667, 1667, 1666]  # 5000 rows
    assert user.width == 9 and user.field == 0


def test_non_distributed_tables_are_dense_variables_on_the_servers():
    cfg = ps_cfg(
        "model.sparse_tables=[{name:u,num_embeddings:50},{name:c,num_embeddings:10,distributed:false}]"
    )
    place = placement(cfg)
    assert [t.name for t in place.tables] == ["u"]
    assert {"embeddings.c.weight", "first_order.c.weight"} <= set(place.dense_names)
    assert "embeddings.u.weight" not in place.dense_names


@pytest.mark.parametrize(
    "optim,sparse,factor,sparse_factor", [("adagrad", "adagrad", 1, 1), ("adamw", "sgd", 2, 0)]
)
def test_plan_reports_exact_bytes_per_server(optim, sparse, factor, sparse_factor):
    cfg = ps_cfg(f"optim={optim}", f"strategy.sparse_optimizer={sparse}", "strategy.dispatch=hash_name")
    plan = make_plan(cfg)
    place = placement(cfg)
    per_server = plan.ps["server_bytes_per_server"]
    assert per_server == [place.server_bytes(s) for s in range(2)]
    assert plan.ps["server_bytes"] == max(per_server)
    dense = total_params(cfg.model) - plan.ps["sparse_params"]
    assert sum(per_server) == 4 * (dense * (1 + factor) + plan.ps["sparse_params"] * (1 + sparse_factor))
    # hand count for server 1: every table's odd rows (width 9) ...
    rows_1 = 2500 + 1500 + 50 + 150
    blocks_1 = sum(b.numel for b in place.dense if b.server == 1)
    assert per_server[1] == 4 * (rows_1 * 9 * (1 + sparse_factor) + blocks_1 * (1 + factor))


def test_pulled_rows_are_a_small_fraction_of_the_criteo_tables():
    plan = make_plan(ps_cfg("recipe=ctr/deepfm_criteo"))
    ps = plan.ps
    # per trainer per step: at most 26 fields × (micro-batch × accumulate) ids
    assert ps["rows_pulled_per_step"] <= 26 * 512 * plan.batch["accumulate_steps"]
    assert ps["sparse_bytes_pulled_per_step"] < ps["sparse_table_bytes"] / 1000
    assert max(ps["server_bytes_per_server"]) / min(ps["server_bytes_per_server"]) < 1.01


@pytest.mark.parametrize(
    "overrides,loc",
    [
        (("recipe=gpt/tiny", "strategy=ps", "strategy.dense_fallback=true"), "strategy"),
        (("recipe=ctr/tiny", "hardware=a100"), "hardware"),
        (("recipe=ctr/tiny", "checkpoint.resume=auto", "run.dir=/nonexistent/run"), "checkpoint.resume"),
        (("recipe=ctr/tiny", "fault.on_nonfinite=skip"), "fault.on_nonfinite"),
    ],
)
def test_ps_jobs_the_runtime_cannot_train_are_refused_at_launch_only(overrides, loc):
    from fleetwise.config.problems import ConfigError
    from fleetwise.config.validate import load_config

    load_config(list(overrides))  # validate / plan accept it
    with pytest.raises(ConfigError) as err:
        load_config(list(overrides), launching=True)
    assert [p.loc for p in err.value.problems] == [loc]
    assert err.value.problems[0].hint.startswith(
        ("train it with", "use hardware=cpu", "set checkpoint.resume=none", "set fault.on_nonfinite")
    )
