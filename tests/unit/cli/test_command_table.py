"""`fleetwise` is one command table and one prologue for the config commands: every row is listed
by --help, and validate, plan and train read their overrides and flags, and report a bad sweep,
the same way."""

from __future__ import annotations

import json

import pytest

from fleetwise import cli


def test_help_lists_every_command_of_the_table(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.COMMANDS)


@pytest.mark.parametrize("command", ["validate", "plan", "train"])
def test_a_bad_sweep_is_a_config_problem_for_every_config_command(command, capsys):
    assert cli.main([command, "-m", "recipe=gpt/tiny", "strategy=dp,"]) == 2
    assert "<overrides>: cannot parse the sweep" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_json_is_for_the_commands_whose_row_has_it(command, capsys):
    assert cli.main([command, "-m", "strategy=dp,", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["errors"][0]["loc"] == "<overrides>"
    with pytest.raises(SystemExit) as exit_:  # argparse: train prints no JSON
        cli.main(["train", "--json"])
    assert exit_.value.code == 2
