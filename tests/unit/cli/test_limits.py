"""Adversarial configs that are *accepted* stay cheap, the bounds and checks behind the corpus
cases behave as documented, and what leaves the launcher (params, rank environment, --json) is
clean."""

from __future__ import annotations

import json
import math
import time

import pytest
from helpers.config import compose

from fleetwise.launcher.preflight import preflight

# The largest configs the bounds accept (config/rules/limits.py), each at a different limit.
AT_THE_LIMITS = [
    (  # 256 pipeline stages (the chunk bound), 4096 layers, 2^16 micro-batches
        "strategy=hybrid",
        "strategy.pp_degree=256",
        "hardware.devices_per_node=256",
        "model.num_layers=4096",
        "train.global_batch_size=65536",
        "train.micro_batch_size=1",
    ),
    (  # the same chunks as 8 stages × 32 virtual stages, and a width that does not fit: remedies re-plan
        "strategy=hybrid",
        "strategy.pp_degree=8",
        "strategy.virtual_stages=32",
        "strategy.schedule=interleaved_1F1B",
        "hardware.devices_per_node=8",
        "model.num_layers=4096",
        "model.hidden_size=65536",
        "model.num_attention_heads=64",
        "model.ffn_hidden_size=262144",
        "train.global_batch_size=65536",
        "train.micro_batch_size=1",
    ),
    ("recipe=gpt/gpt3_175b", "hardware.nodes=131072", "train.global_batch_size=1048576"),  # 2^20 ranks
    (
        "recipe=ctr/tiny",
        "strategy.num_servers=1024",
        "strategy.num_trainers=64",
        "train.global_batch_size=4096",
        "model.sparse_tables=[{name:a,num_embeddings:10000000000000},{name:b,num_embeddings:1000000000}]",
    ),
    (
        "recipe=ctr/tiny",
        "strategy.num_trainers=65536",
        "train.global_batch_size=65536",
        "train.micro_batch_size=1",
    ),
    ("recipe=resnet/tiny", "model.layers=[1024,1024,1024,1024]", "strategy=hybrid", "strategy.pp_degree=8"),
]


@pytest.mark.parametrize("overrides", AT_THE_LIMITS, ids=range(len(AT_THE_LIMITS)))
def test_configs_at_the_limits_plan_without_hanging(overrides):
    t = time.perf_counter()
    pf = preflight(list(overrides), enforce_memory=False)
    elapsed = time.perf_counter() - t
    assert not pf.problems, pf.problems
    assert pf.plan.world_size >= 8 and math.isfinite(pf.plan.step_time_s)
    print(f"planned in {elapsed:.2f} s")  # < 2 s on an idle 2-core machine; no tight bound under load
    assert elapsed < 60


def test_expected_unique_ids_match_the_exact_sum_past_the_exact_rows():
    import numpy as np

    from fleetwise.plan.ps import EXACT_ROWS, expected_unique

    def exact(n, draws, alpha):
        p = np.arange(1, n + 1, dtype=np.float64) ** -alpha
        p /= p.sum()
        return float(np.sum(-np.expm1(draws * np.log1p(-p))))

    n = 4 * EXACT_ROWS
    for draws, alpha in [(64, 1.05), (4096, 1.1), (10**6, 2.0)]:
        assert expected_unique(n, draws, alpha) == pytest.approx(exact(n, draws, alpha), rel=1e-6)
    # 10^13 rows: no 74 TiB array, a bounded answer
    assert 0 < expected_unique(10**13, 4096, 1.1) <= 4096


def test_plan_json_is_strict(capsys):
    from fleetwise.cli import main, strict_json

    assert strict_json({"a": [1.0, math.nan, {"b": math.inf}]}) == {"a": [1.0, None, {"b": None}]}
    assert main(["plan", "recipe=gpt/tiny", "--json"]) == 0
    json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON token {c}"))


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_server_addresses_are_accepted(address):
    cfg, problems = compose("recipe=ctr/tiny", f"strategy.server_address='{address}'")
    assert problems == [] and cfg.strategy.server_address == address


def test_a_private_server_address_needs_the_explicit_allowance():
    cfg, problems = compose(
        "recipe=ctr/tiny", "strategy.server_address=10.1.2.3", "strategy.allow_remote_servers=true"
    )
    assert problems == []


def test_the_issues_recipe_examples_get_the_chosen_strategys_layout():
    cfg, problems = compose(
        "recipe=gpt/gpt3_6.7b",
        "strategy=sharding",
        "hardware.nodes=8",
        "strategy.sharding_degree=64",
        "strategy.sharding_stage=3",
    )
    assert problems == [] and (cfg.strategy.mp_degree, cfg.strategy.sharding_degree) == (1, 64)
    cfg, problems = compose(
        "recipe=gpt/gpt3_175b",
        "strategy=dp",
        "strategy.dp_degree=8",
        "hardware.nodes=1",
        "plan.memory_check=off",
    )
    assert problems == [] and (cfg.strategy.mp_degree, cfg.strategy.dp_degree) == (1, 8)
    assert cfg.model.num_layers == 96  # the rest of the recipe still applies
    cfg, _ = compose("recipe=gpt/gpt3_175b", "strategy=hybrid")  # its own strategy: its own degrees
    assert (cfg.strategy.mp_degree, cfg.strategy.pp_degree) == (8, 16)


def test_an_error_about_a_recipe_value_says_it_came_from_the_recipe():
    (p,) = preflight(["recipe=gpt/gpt3_175b", "hardware.nodes=1"]).problems
    assert "set by recipe gpt/gpt3_175b" in p.msg and "strategy.mp_degree=8" in p.msg
    # Values the user typed are not blamed on the recipe.
    (p,) = preflight(["recipe=gpt/gpt3_175b", "hardware.nodes=1", "strategy.mp_degree=8"]).problems
    assert "strategy.pp_degree=16" in p.msg and "strategy.mp_degree=8" not in p.msg


def test_credentials_stay_out_of_rank_environments_and_params():
    from fleetwise.config.compose import _compose
    from fleetwise.launcher.job_tracking import REDACTED, redact_params
    from fleetwise.launcher.sweeps import env_interpolated
    from fleetwise.launcher.torchrun import rank_environment

    env = {
        "PATH": "/bin",
        "MLFLOW_TRACKING_PASSWORD": "hunter2-secret",
        "MLFLOW_TRACKING_URI": "http://u:p@host",
        "AWS_SECRET_ACCESS_KEY": "k",
        "HF_TOKEN": "t",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    assert rank_environment(env) == {
        "PATH": "/bin",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
    dcfg = _compose(["run.name=${oc.env:FW_TEST_NAME,dflt}"], hydra_cfg=True)
    paths = env_interpolated(dcfg)
    assert paths == {"run.name"}
    params = {"run.name": "dflt", "data.path": "/data/hunter2-secret/x", "train.steps": "3"}
    assert redact_params(params, paths, env) == {
        "run.name": REDACTED,
        "data.path": REDACTED,
        "train.steps": "3",
    }


def test_ranks_are_checked_against_this_machines_cores_and_memory():
    from fleetwise.launcher.preflight import capacity_problem

    pf = preflight(["recipe=gpt/tiny", "hardware.devices_per_node=16", "train.global_batch_size=32"])
    assert capacity_problem(pf.cfg, pf.plan, cores=2, available=24 << 30) is None  # the 4D test's 16 ranks
    loc, msg, hint = capacity_problem(pf.cfg, pf.plan, cores=1, available=24 << 30)
    assert loc == "hardware.devices_per_node" and "16 ranks" in msg and "oversubscribe" in hint
    _, msg, _ = capacity_problem(pf.cfg, pf.plan, cores=64, available=1 << 30)
    assert "GiB are available" in msg
    ps = preflight(["recipe=ctr/tiny", "strategy.num_trainers=64", "train.global_batch_size=2048"])
    assert capacity_problem(ps.cfg, ps.plan, cores=2, available=24 << 30)[0] == "strategy.num_trainers"


# Extreme floats: the ends of the double range, the smallest subnormal, a signed zero, inf and nan.
# (Without the hardware bounds, the largest one gave the issue's OverflowError traceback.)
EXTREMES = (1.7976931348623157e308, -1e308, 5e-324, -0.0, math.inf, math.nan)
FLOAT_BASES = (
    ("recipe=gpt/tiny", "strategy=hybrid", "strategy.pp_degree=2", "hardware.devices_per_node=2"),
    ("recipe=resnet/tiny",),
    ("recipe=ctr/tiny",),
)


def _float_paths(model, prefix: str = "") -> list[str]:
    """Every float-valued setting of a parsed config (nested sections, dicts of floats), by walking
    the pydantic annotations: what a user can set to any number Hydra parses."""
    import typing

    from pydantic import BaseModel

    def floats(annotation) -> bool:
        return annotation is float or any(floats(a) for a in typing.get_args(annotation))

    paths = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        path = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            paths += _float_paths(value, path + ".")
        elif isinstance(value, dict) and floats(info.annotation):
            paths += [f"{path}.{k}" for k, v in value.items() if isinstance(v, int | float)]
        elif floats(info.annotation) and not isinstance(value, bool) and isinstance(value, int | float | None):
            paths.append(path)
    return paths


@pytest.mark.filterwarnings("error::RuntimeWarning")  # numpy's overflow/divide notes reach the user too
@pytest.mark.parametrize("base", FLOAT_BASES, ids=lambda b: b[0])
def test_no_float_the_schema_accepts_gives_a_traceback(base, monkeypatch, capsys):
    """Every float setting at every extreme value, through the whole `plan --json` path (validation,
    plan, remedies, rendering) in-process, Hydra's composition replaced by the mutated config: exit
    0 or 2, never an exception, and every refusal names the field."""
    import copy

    from fleetwise.cli import main
    from fleetwise.config import compose as composing
    from fleetwise.config.compose import compose_partial

    data, problems = compose_partial(list(base))
    assert not problems
    cfg, _ = compose(*base)
    paths = _float_paths(cfg)
    assert len(paths) >= 8, paths
    current = {}
    monkeypatch.setattr(composing, "_compose_partial", lambda overrides: (copy.deepcopy(current["data"]), []))
    crashed = []
    for path in paths:
        for value in EXTREMES:
            mutated = copy.deepcopy(data)
            node = mutated
            *parents, leaf = path.split(".")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
            current["data"] = mutated
            try:
                code = main(["plan", "--json"])
            except BaseException as exc:  # noqa: BLE001 - what the test looks for
                crashed.append(f"{path}={value}: {type(exc).__name__}: {exc}")
                continue
            out = capsys.readouterr().out
            if code == 2:
                assert path in out or path.rsplit(".", 1)[0] in out, (path, value, out[-500:])
            elif code != 0:
                crashed.append(f"{path}={value}: exit {code}")
    assert not crashed, "\n".join(crashed[:20])
