"""The tiny recipes visibly learn in their default step count: the final loss is at least 30%
below the loss of a model that learned nothing (ln of the vocabulary or the classes), and the
summary says so. ERNIE and ResNet read real bundled data (the standard library's text, scikit-
learn's digits); GPT's synthetic text has a learnable successor map, and CTR's synthetic clicks a
planted teacher (ctr/tiny runs on the parameter server: 2 servers, 2 trainers). Llama reads the
standard library's text like ERNIE, and so does its mixture of experts (llama/moe_tiny), whose
experts' counts are checked too."""

import math

import pytest
from helpers.cli import run_cli
from helpers.runs import read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("recipe", "chance"),
    [
        ("gpt/tiny", math.log(256)),
        ("ernie/tiny", math.log(256)),
        ("resnet/tiny", math.log(10)),
        ("ctr/tiny", math.log(2)),
        ("llama/tiny", math.log(256)),
        ("llama/moe_tiny", math.log(256)),
    ],
)
def test_a_tiny_recipe_learns_by_default(tmp_path, recipe, chance):
    run_dir = tmp_path / "run"
    ranks = () if recipe.startswith("ctr") else ("hardware.devices_per_node=2",)
    r = run_cli(
        "train",
        f"recipe={recipe}",
        *ranks,
        "tracking.enabled=false",
        f"run.dir={run_dir}",
        cwd=tmp_path,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    records = read_metrics(run_dir)
    losses = [m["train/loss"] for m in records]
    assert len(losses) == 30
    assert losses[0] > 0.95 * chance  # it starts from nothing ...
    assert losses[-1] < 0.7 * chance, losses  # ... and ends well below chance
    assert f"chance {chance:.4f}: -" in r.stdout
    if recipe == "llama/moe_tiny":
        # blocks 1-3 route each of the step's 16 × 32 tokens to 2 of their 4 experts (block 0 is
        # dense), dropping none; the balance losses (3 blocks × 0.01 × 1 at perfect balance) keep
        # the experts near balance
        for m in records:
            for layer in (1, 2, 3):
                assert sum(m[f"moe/layer{layer}/tokens_expert{e}"] for e in range(4)) == 16 * 32 * 2
            assert "moe/layer0/load_max_over_mean" not in m and m["moe/dropped_tokens"] == 0
        assert 0.03 <= records[-1]["moe/aux_loss"] < 0.04, records[-1]
        assert 1 <= records[-1]["moe/load_max_over_mean"] < 1.5, records[-1]
