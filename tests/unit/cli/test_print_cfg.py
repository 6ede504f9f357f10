"""`--cfg job` prints the config the job runs with: a `strategy=X` other than the recipe's drops the
recipe's strategy keys (Mixtral's `recompute: full` under `strategy=sharding`), as validate does."""

from __future__ import annotations

import yaml
from helpers.cli import cli_in_process

from fleetwise.config.validate import load_config


def test_cfg_job_shows_the_strategy_the_job_runs_with(capsys):
    for overrides in (
        ["recipe=llama/mixtral_8x7b", "strategy=sharding", "strategy.sharding_stage=3"],
        ["recipe=llama/mixtral_8x7b"],  # the recipe's own strategy: its keys stay
    ):
        code, out, _ = cli_in_process(capsys, "plan", *overrides, "--cfg", "job")
        assert code == 0
        printed = yaml.safe_load(out)["strategy"]
        used = load_config(overrides).strategy
        assert printed["name"] == used.name and printed["recompute"] == used.recompute
    assert printed["recompute"] == "full"
    assert load_config(["recipe=llama/mixtral_8x7b", "strategy=sharding"]).strategy.recompute == "none"
