"""The dry run's pipeline shortcut (dryrun/parent.py `stand_ins`, dryrun/fake.py `MetaRelay`):
which stages must run, and how the relay answers for the alike middle stages that do not.
The shortcut against every stage running is in tests/integration/test_dryrun.py."""

from __future__ import annotations

import json

import pytest
from helpers.config import compose

from fleetwise import rundir
from fleetwise.config.layout import Layout
from fleetwise.dryrun.parent import default_ranks, stand_ins, with_pipelines

PP6 = ("recipe=gpt/tiny", "strategy=pp", "strategy.pp_degree=6", "hardware.devices_per_node=6")


def _cfg(*overrides):
    cfg, problems = compose(*overrides)
    assert cfg is not None, problems
    return cfg


def test_only_the_ends_and_their_neighbours_run_when_the_middle_chunks_are_alike():
    cfg = _cfg(*PP6, "model.num_layers=7", "strategy.layer_split=[2,1,1,1,1,1]")  # the middle chunks alike
    got = stand_ins(cfg)
    assert got is not None and (got["forward"], got["backward"], got["pp_ranks"]) == (1, 4, [0, 1, 4, 5])
    layout = Layout.of(cfg)
    assert with_pipelines(layout, [3], got["pp_ranks"]) == [0, 1, 3, 4, 5]
    assert with_pipelines(layout, [3]) == [0, 1, 2, 3, 4, 5]
    # the default roles: the first stage, the last, and stage 1 for the alike middle ones
    assert default_ranks(layout, got) == [0, 1, 5] and default_ranks(layout) == [0, 1, 2, 3, 4, 5]
    # zero bubble V: rank r holds chunks r and 2pp-1-r, so ranks 0 and 1 hold chunks 0, 1, 10, 11
    zbv = stand_ins(
        _cfg(
            *PP6,
            "model.num_layers=12",
            "strategy.schedule=ZBV_zero_bubble",
            "strategy.virtual_stages=2",
            "train.global_batch_size=24",
        )
    )
    assert zbv is not None and (zbv["backward"], zbv["pp_ranks"]) == (10, [0, 1])
    # middle chunks that differ, or too few chunks to leave any out: every stage runs
    assert stand_ins(_cfg(*PP6, "model.num_layers=7", "strategy.layer_split=[1,1,2,1,1,1]")) is None
    assert stand_ins(_cfg(*PP6, "model.num_layers=8", "strategy.layer_split=[2,2,1,1,1,1]")) is None
    assert (
        stand_ins(
            _cfg("recipe=gpt/tiny", "strategy=pp", "strategy.pp_degree=4", "hardware.devices_per_node=4")
        )
        is None
    )


def test_the_relay_answers_a_stage_that_does_not_run_from_an_alike_one_that_does(tmp_path):
    from fleetwise.dryrun.fake import MetaRelay, NotAlike

    def relay(folder, running, sends):
        folder.mkdir()
        plan = {"running": running, "forward": 1, "backward": 4}
        (folder / rundir.STAND_INS_FILE).write_text(json.dumps(plan))
        sender = MetaRelay(folder)
        for (src, dst), meta in sends.items():
            sender.put(src, dst, meta)
        return MetaRelay(folder, timeout_s=0.2)

    sends = {(0, 1): "M", (1, 2): "M", (5, 4): "G", (4, 3): "G", (2, 3): "from 2"}
    r = relay(tmp_path / "a", [0, 1, 2, 4, 5], sends)
    assert r.get(0, 1) == "M"  # a running stage's own metadata
    assert r.get(2, 3) == "from 2"
    assert r.get(3, 2) == "G"  # stage 3 does not run: stage 4 sends on what it receives
    assert r.get(3, 4) == "M"  # forward: stage 1 does
    # stage 1 does not map its metadata to itself: it cannot answer for stage 3
    r = relay(tmp_path / "b", [0, 1, 4, 5], {**sends, (0, 1): "E"})
    with pytest.raises(NotAlike, match="stage 1 received 'E'"):
        r.get(3, 4)
    assert r.get(3, 2) == "G"
    # without a stand-ins file every stage runs: a missing one is waited for, not answered for
    folder = tmp_path / "c"
    MetaRelay(folder).put(4, 3, "G")
    with pytest.raises(TimeoutError):
        MetaRelay(folder, timeout_s=0.2).get(3, 2)
