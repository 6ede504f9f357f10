"""`strategy=mp` and `strategy=pp` used to be refused on the tiny recipes at the default 8 ranks;
with `max` degrees they train with no further override."""

import pytest
from helpers.cli import run_cli
from helpers.runs import read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("recipe", "strategy", "mesh"), [("gpt/tiny", "mp", (4, 2)), ("resnet/tiny", "pp", (4, 2))]
)
def test_the_default_layout_trains(tmp_path, recipe, strategy, mesh):
    run_dir = tmp_path / "run"
    r = run_cli(
        "train",
        f"recipe={recipe}",
        f"strategy={strategy}",
        "train.steps=2",
        "tracking.enabled=false",
        f"run.dir={run_dir}",
        cwd=tmp_path,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    from fleetwise import rundir

    s = rundir.read_config(run_dir).strategy
    assert (getattr(s, f"{strategy}_degree"), s.dp_degree) == mesh
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]
