"""Composition keeps the group choices' Hydra composition per process and applies value overrides
to a copy (config/compose.py). Held against Hydra's own `compose` of the same overrides, run here
directly: the whole config, the hydra node included, or the same error, word for word."""

from __future__ import annotations

import os
import time

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from fleetwise.config import compose as composition
from fleetwise.config.paths import config_dir

CASES = [
    ["recipe=gpt/tiny"],
    ["recipe=gpt/tiny", "strategy=hybrid", "strategy.pp_degree=2", "train.steps=3"],
    # a value before the group it belongs to, a hydra.* override among them
    ["strategy.pp_degree=2", "recipe=ernie/tiny", "model.num_layers=3", "hydra.run.dir=/tmp/x"],
    ["recipe=gpt/tiny", "+train.foo=1", "train.steps=5", "data.path=null", "train.steps="],
    ["recipe=resnet/tiny", "optim=sgd", "optim.lr=0.5", "train.precision=bf16"],
    # errors: an unknown key, a list where a float goes, a sweep outside --multirun, an unknown
    # section, a group under another package, an unknown group option after a good value
    ["recipe=gpt/tiny", "model.nope=3"],
    ["recipe=gpt/tiny", "optim.lr=[1,2]"],
    ["recipe=gpt/tiny", "strategy.pp_degree=1,2"],
    ["recipe=gpt/tiny", "nope.x=1"],
    ["recipe=gpt/tiny", "strategy@x.y=hybrid"],
    ["train.steps=4", "recipe=gpt/nope"],
    ["recipe=gpt/tiny", "train.steps=4", "model.hidden_size=abc"],
]


def _hydra(overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3", job_name="fleetwise"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def _outcome(fn):
    try:
        return OmegaConf.to_container(fn(), resolve=False), None
    except Exception as exc:  # noqa: BLE001
        return None, (type(exc).__name__, str(exc))


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o))
def test_a_composition_is_hydras_own(overrides):
    searched = overrides + composition.search_path_overrides(overrides)
    for _ in range(2):  # the first call composes the groups, the second takes them from memory
        assert _outcome(lambda: composition._compose(overrides, hydra_cfg=True)) == _outcome(
            lambda: _hydra(searched)
        )


def test_a_value_changes_only_its_copy_and_an_edited_tree_composes_again(tmp_path, monkeypatch):
    recipe = tmp_path / "recipe" / "mine.yaml"
    recipe.parent.mkdir()
    recipe.write_text(
        (config_dir() / "recipe" / "gpt" / "tiny.yaml").read_text().replace("num_layers: 4", "num_layers: 3")
    )
    monkeypatch.setenv("FLEETWISE_CONFIG_DIR", str(tmp_path))
    a = composition._compose(["recipe=mine", "model.num_layers=5"])
    assert a.model.num_layers == 5
    assert composition._compose(["recipe=mine"]).model.num_layers == 3  # the kept one unchanged
    recipe.write_text(recipe.read_text().replace("num_layers: 3", "num_layers: 7"))
    os.utime(recipe, ns=(time.time_ns(), time.time_ns() + 1_000_000))  # even within one mtime tick
    assert composition._compose(["recipe=mine"]).model.num_layers == 7
    monkeypatch.chdir(tmp_path)  # the kept composition was made elsewhere: hydra.runtime.cwd is this call's
    assert composition._compose(["recipe=mine"], hydra_cfg=True).hydra.runtime.cwd == os.getcwd()
