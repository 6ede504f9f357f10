"""The supported torch range (config/rules/torch_version.py): `validate` refuses a torch below it
with exit 2, naming the installed version and the job's features; the dry run is refused above
it; and the range is stated once more in pyproject.toml and in the two doors' CHECKED tables,
which must agree with it.

The installed torch (the CI pin) is swapped for the rule by monkeypatching its reader: the rule
reads the version from the package metadata, never by importing torch."""

from __future__ import annotations

import json
import re
import tomllib

import pytest
from helpers.repo import REPO

from fleetwise import cli
from fleetwise.config.rules import torch_version

PIPELINED = ["recipe=gpt/tiny", "strategy=hybrid", "strategy.pp_degree=2", "strategy.sharding_degree=2",
             "strategy.sharding_stage=1", "strategy.mp_degree=2", "strategy.dp_degree=1",
             "hardware.devices_per_node=8"]  # fmt: skip


def _validate(monkeypatch, capsys, version: str | None, *overrides: str, command: str = "validate"):
    monkeypatch.setattr(torch_version, "installed_torch", lambda: version)
    code = cli.main([command, *overrides, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_torch_below_the_range_is_refused_naming_the_version_and_the_features(monkeypatch, capsys):
    code, out = _validate(monkeypatch, capsys, "2.10.1+cu128", *PIPELINED)
    assert code == 2 and out["valid"] is False
    [problem] = out["errors"]
    assert problem["loc"] == "torch"
    assert "2.10.1+cu128" in problem["msg"] and "2.11 to 2.14" in problem["msg"]
    for feature in ("pipeline parallelism", "tensor parallelism", "ZeRO-1"):
        assert feature in problem["msg"], problem["msg"]
    assert "pip install 'torch>=2.11,<2.15'" in problem["hint"]
    # the other problems of the config are listed beside it (every problem at once)
    code, out = _validate(
        monkeypatch, capsys, "2.6.0", "recipe=gpt/tiny", "strategy=mp", "strategy.mp_degree=3"
    )
    locs = [e["loc"] for e in out["errors"]]
    assert code == 2 and "torch" in locs and any(loc.startswith("strategy.") for loc in locs), out
    torch_msg = next(e["msg"] for e in out["errors"] if e["loc"] == "torch")
    assert "2.6.0" in torch_msg
    # the parameter server names rpc; `plan` refuses as `validate` does
    code, out = _validate(monkeypatch, capsys, "2.9.0", "recipe=ctr/tiny", "strategy=ps", command="plan")
    assert code == 2 and "torch.distributed.rpc" in out["errors"][0]["msg"], out


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1", "2.15.0.dev20260301"])
def test_every_checked_torch_and_a_newer_one_validate(monkeypatch, capsys, version):
    code, out = _validate(monkeypatch, capsys, version, *PIPELINED)
    assert code == 0 and out["valid"] is True, out


def test_the_dry_run_is_refused_above_the_range_and_train_without_torch(monkeypatch, capsys):
    code, out = _validate(monkeypatch, capsys, "2.15.0", *PIPELINED, command="dryrun")
    assert code == 2, out
    [problem] = out["errors"]
    assert problem["loc"] == "torch" and "2.15.0" in problem["msg"] and "dry run" in problem["msg"]
    assert "2.14" in problem["hint"]
    from fleetwise.config.rules.context import Context

    # no torch at all: only commands that run it care (validate and plan need none)
    monkeypatch.setattr(torch_version, "installed_torch", lambda: None)
    cfg = _config()
    assert list(torch_version.torch_version(Context(cfg, None, check=lambda c: [], launching=False))) == []
    [missing] = torch_version.torch_version(Context(cfg, None, check=lambda c: [], launching=True))
    assert missing.msg == "torch is not installed" and "pip install" in missing.hint


def _config():
    from helpers.config import compose

    cfg, problems = compose("recipe=gpt/tiny")
    assert cfg is not None, problems
    return cfg


def test_the_installed_torch_is_read_without_importing_it():
    import subprocess
    import sys

    code = (
        "import sys; from fleetwise.config.rules import torch_version as t; v = t.installed_torch(); "
        "print(v, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    version, imported = out.stdout.split()
    assert imported == "False" and torch_version.minor(version) >= (2, 11), out.stdout


def test_the_range_is_one_range_everywhere():
    """pyproject.toml's dependency, the rule's SUPPORTED, compat's versions and the dry run's
    patches' CHECKED name the same torch versions."""
    from fleetwise import compat
    from fleetwise.dryrun import patches

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    [torch_dep] = [d for d in deps if re.match(r"torch\b", d)]
    low, high = re.fullmatch(r"torch>=(\d+\.\d+),<(\d+\.\d+)", torch_dep.replace(" ", "")).groups()
    supported = torch_version.SUPPORTED
    assert low == supported[0] and torch_version.minor(high) == (2, torch_version.minor(supported[-1])[1] + 1)
    assert [torch_version.minor(v) for v in supported] == [(2, m) for m in range(11, 11 + len(supported))]
    assert supported == compat.TESTED and supported == patches.CHECKED
    assert all(set(v) <= set(supported) for v in compat.CHECKED.values())
    assert f"pip install '{torch_dep}'" == torch_version.INSTALL
