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
    # Hydra's own node: where a job writes and its mode are values too (HYDRA_VALUES), a bad mode
    ["recipe=gpt/tiny", "hydra.run.dir=/tmp/r", "train.steps=2", "hydra.mode=RUN"],
    ["hydra.sweep.dir=/tmp/s", "recipe=ernie/tiny", "hydra.sweep.subdir=a", "hydra/launcher=basic"],
    ["recipe=gpt/tiny", "hydra.mode=SOMETIMES"],
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


APP_CASES = [
    # what the launcher's app composes: the task's overrides, its run dir and Hydra's mode
    (
        [
            "recipe=gpt/tiny",
            "strategy=hybrid",
            "strategy.pp_degree=2",
            "hydra.run.dir=/tmp/r",
            "hydra.mode=RUN",
        ],
        "RUN",
    ),
    # a sweep's mode query (Hydra's get_mode: MULTIRUN, sweeps not validated), a bad key
    (["recipe=gpt/tiny", "train.steps=2,3", "hydra.sweep.dir=/tmp/s"], "MULTIRUN"),
    (["recipe=gpt/tiny", "model.nope=3", "hydra.run.dir=/tmp/r", "hydra.mode=RUN"], "RUN"),
]


@pytest.mark.parametrize("overrides,mode", APP_CASES, ids=lambda o: " ".join(o) if isinstance(o, list) else o)
def test_the_launchers_app_composes_what_hydras_app_loader_does(overrides, mode, tmp_path, monkeypatch):
    """Inside kept_app_compositions (the launcher's `fleetwise train` app): the config Hydra's own
    app loader composes -- built as hydra.main builds it, on conf/ with a user tree searched too --
    or its error, word for word; a composition made inside leaves the app's Hydra in place."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.types import RunMode
    from hydra.version import setbase

    setbase("1.3")  # as hydra.main(version_base="1.3") does before its app composes (runtime.version_base)

    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text(
        (config_dir() / "recipe" / "gpt" / "tiny.yaml").read_text()
    )
    monkeypatch.setenv("FLEETWISE_CONFIG_DIR", str(tmp_path))
    overrides = overrides + composition.search_path_overrides(overrides)  # as run_hydra passes them
    GlobalHydra.instance().clear()
    try:
        app = Hydra.create_main_hydra2("fleetwise train", create_config_search_path(str(config_dir())))
        run_mode = getattr(RunMode, mode)
        hydras = ConfigLoaderImpl.load_configuration
        want = _outcome(lambda: hydras(app.config_loader, "config", overrides, run_mode, True, mode == "RUN"))
        loads = []  # Hydra's own compositions inside: the groups' once (its compose API), then none

        def counted(*args, **kwargs):
            loads.append(args[2])
            return hydras(*args, **kwargs)

        monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)
        composition._GROUPS.clear()  # the first call inside composes (Hydra's compose API), the second keeps
        for calls in (1, 0):
            del loads[:]
            with composition.kept_app_compositions():
                got = _outcome(
                    lambda: app.config_loader.load_configuration(
                        "config", overrides, run_mode, True, mode == "RUN"
                    )
                )
            assert got == want
            assert GlobalHydra.instance().hydra is app
            if want[1] is None and mode == "RUN":  # (else Hydra's own says what is wrong)
                assert len(loads) == calls, loads
        assert ConfigLoaderImpl.load_configuration is counted  # restored on the way out
    finally:
        GlobalHydra.instance().clear()
