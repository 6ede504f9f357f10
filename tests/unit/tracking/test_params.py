"""Params, tags and the store location: pure functions, no MLflow store."""

import subprocess

import pytest
from helpers.repo import REPO

from fleetwise.tracking import params as params_mod
from fleetwise.tracking import store
from fleetwise.tracking.params import error_tag, flatten_config, git_commit
from fleetwise.tracking.store import clean_key, tracking_uri


def test_flatten_config_dotted_keys_json_scalars_and_lists():
    cfg = {
        "strategy": {"name": "hybrid", "pp_degree": 2, "sharding_degree": None, "offload": False},
        "model": {"num_layers": 4, "layer_split": [0, 2, 4], "extra": {}},
        "optim": {"lr": 1e-4, "betas": (0.9, 0.95)},
        "recipe": "gpt/tiny",
    }
    assert flatten_config(cfg) == {
        "strategy.name": "hybrid",
        "strategy.pp_degree": "2",
        "strategy.sharding_degree": "null",
        "strategy.offload": "false",
        "model.num_layers": "4",
        "model.layer_split": "[0, 2, 4]",
        "model.extra": "{}",
        "optim.lr": "0.0001",
        "optim.betas": "[0.9, 0.95]",
        "recipe": "gpt/tiny",
    }


def test_flatten_config_accepts_pydantic_and_omegaconf():
    from helpers.config import compose
    from omegaconf import OmegaConf

    cfg, problems = compose("recipe=gpt/tiny", "strategy=hybrid")
    assert not problems
    flat = flatten_config(cfg)
    assert flat["strategy.name"] == "hybrid"
    assert flat["model.num_layers"] == str(cfg.model.num_layers)
    assert all(isinstance(v, str) for v in flat.values())
    dc = OmegaConf.create({"a": {"b": [1, {"c": 2}]}, "d": "${a.b}"})
    assert flatten_config(dc) == {"a.b": '[1, {"c": 2}]', "d": '[1, {"c": 2}]'}


def test_long_values_are_cut_to_mlflow_limits_and_keys_cleaned():
    import mlflow.utils.validation as v

    # The limits are copied (store.py) so preparing params never imports mlflow: keep them honest.
    assert store.MAX_PARAM_VALUE == v.MAX_PARAM_VAL_LENGTH
    assert store.MAX_TAG_VALUE == v.MAX_TAG_VAL_LENGTH
    assert store.MAX_METRICS_PER_BATCH == v.MAX_METRICS_PER_BATCH
    assert store.MAX_PARAMS_TAGS_PER_BATCH == v.MAX_PARAMS_TAGS_PER_BATCH
    assert store.MAX_KEY == v.MAX_ENTITY_KEY_LENGTH

    flat = flatten_config({"data": {"files": ["x" * 50] * 500}})
    assert len(flat["data.files"]) == v.MAX_PARAM_VAL_LENGTH
    assert flat["data.files"].endswith("[truncated]")
    for raw in ("a b/c:d", "weird*key", "/lead", "a//b", "..", "x" * 300):
        key = clean_key(raw)
        assert v.validate_param_and_metric_name(key) and not v.path_not_unique(key), (raw, key)
        assert len(key) <= 250


def test_error_tag_keeps_head_and_tail_of_a_long_traceback():
    tb = "RuntimeError: rank 3 failed at step 7\n" + "".join(
        f'  File "x.py", line {i}\n' for i in range(2000)
    )
    tb += "torch.OutOfMemoryError: CUDA out of memory\n"
    tag = error_tag(tb)
    assert len(tag) <= 5000
    assert tag.startswith("RuntimeError: rank 3 failed at step 7")
    assert tag.rstrip().endswith("CUDA out of memory")
    assert "characters cut; the full text is in error.txt" in tag
    assert error_tag("short\n") == "short"


@pytest.mark.slow  # starts processes
def test_git_commit_in_a_checkout_and_none_elsewhere_without_spawning_git(tmp_path, monkeypatch):
    repo = REPO
    sha = git_commit(repo)
    expected = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True
    ).stdout.strip()
    assert sha == expected and len(sha) == 40

    def no_git(*args, **kwargs):
        raise AssertionError("git was spawned outside a checkout")

    monkeypatch.setattr(params_mod.subprocess, "run", no_git)
    assert git_commit(tmp_path) is None


def test_tracking_uri_defaults_to_sqlite_in_cwd_and_honours_the_env(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert tracking_uri() == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert tracking_uri().startswith("sqlite:////")  # four slashes: an absolute path
    assert store.artifact_root(tracking_uri()) == tmp_path.resolve() / "mlartifacts"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://10.0.0.5:5000")
    assert tracking_uri() == "http://10.0.0.5:5000"
    assert store.artifact_root(tracking_uri()) is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///rel/db.sqlite")
    assert tracking_uri() == f"sqlite:///{tmp_path.resolve()}/rel/db.sqlite"


@pytest.mark.parametrize("key", list(store.HTTP_DEFAULTS))
def test_http_timeouts_are_short_unless_the_user_set_them(monkeypatch, key):
    import os

    monkeypatch.setenv(key, "x")  # so that teardown restores the variable's original state
    monkeypatch.delenv(key)
    store.configure_http()
    assert os.environ[key] == store.HTTP_DEFAULTS[key]
    monkeypatch.setenv(key, "42")
    store.configure_http()
    assert os.environ[key] == "42"
