"""The dry run's refusals are config rules (config/rules/dryrun.py): checked with every other rule
when `fleetwise dryrun` asks (`dryrun=True`), all at once, exit 2; never for validate, plan or
train. A dry run starts no rendezvous, so the launch section's rules do not apply to it."""

from __future__ import annotations

import pytest

from fleetwise.config.problems import ConfigError
from fleetwise.config.validate import load_config


def _locs(*overrides: str, **mode: bool) -> list[str]:
    try:
        load_config(list(overrides), **mode)
    except ConfigError as err:
        return [p.loc for p in err.problems]
    return []


DRYRUN = {"launching": True, "dryrun": True}


@pytest.mark.parametrize(
    "overrides,loc",
    [
        (("recipe=gpt/tiny", "strategy=sharding", "train.compile=true"), "train.compile"),
        (("recipe=ctr/tiny", "strategy=ps"), "strategy"),
    ],
)
def test_what_the_dry_run_cannot_simulate_is_refused_by_a_rule(overrides, loc):
    assert _locs(*overrides, **DRYRUN)[-1] == loc  # the dry run's rules run last
    assert loc not in _locs(*overrides)  # validate and plan: no such rule
    assert loc not in _locs(*overrides, launching=True)  # train: none either


def test_the_dry_runs_problems_come_with_the_others_at_once():
    locs = _locs("recipe=gpt/tiny", "train.compile=true", "strategy.dp_degree=3", **DRYRUN)
    assert locs == ["strategy", "train.compile"]


def test_the_launch_rules_do_not_apply_to_a_dry_run():
    multi_node = (
        "recipe=gpt/tiny",
        "hardware.nodes=2",
        "hardware.devices_per_node=4",
        "launch.rdzv_endpoint=10.0.0.1:0",
    )
    assert _locs(*multi_node, launching=True) == ["launch.rdzv_endpoint"]  # train needs a fixed port
    assert _locs(*multi_node, **DRYRUN) == []
    assert _locs("recipe=gpt/tiny", "launch.node_rank=5", **DRYRUN) == []
    assert _locs("recipe=gpt/tiny", "launch.node_rank=5") == ["launch.node_rank"]
