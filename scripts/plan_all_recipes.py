"""Print `fleetwise plan --json` (and `validate --json` for a few broken configs) for every recipe
under recipes/, one block per case, so two checkouts can be compared with `diff`:

    PYTHONPATH=<checkout>/platform python scripts/plan_all_recipes.py > plans.txt

Besides each recipe's default layout it plans a few other strategies, so the planner's
per-family branches (pipeline, tensor parallel, ps) are all exercised.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

from fleetwise.cli import main

RECIPES = sorted(p.relative_to("recipes").with_suffix("").as_posix() for p in Path("recipes").rglob("*.yaml"))
TWO = "hardware.devices_per_node=2"
EXTRA = {
    "gpt/tiny": [
        ["strategy=hybrid"],
        ["strategy=pp", TWO, "strategy.recompute=full"],
        ["strategy=mp", TWO, "strategy.recompute=selective", "strategy.sequence_parallel=true"],
    ],
    "ernie/tiny": [["strategy=mp", TWO], ["strategy=pp", TWO], ["model.mask_prob=0.001", "model.seq_len=16"]],
    "resnet/tiny": [["strategy=pp", TWO], ["strategy=mp"], ["model.image_size=16", "model.layers=[1,1]"]],
    "ctr/tiny": [
        ["strategy=ps", "strategy.recompute=full"],
        ["strategy=pp"],
        ["model.sparse_tables.1.name=user_id"],
    ],
    "gpt/gpt3_1.3b": [["strategy=hybrid", "hardware=a100"], ["model.num_attention_heads=7"]],
}


def run(args: list[str]) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return f"exit {code}\n{out.getvalue()}{err.getvalue()}"


for recipe in RECIPES:
    for extra in [[], *EXTRA.get(recipe, [])]:
        for command in ("plan", "validate") if extra else ("plan",):
            args = [command, f"recipe={recipe}", *extra, "--json"]
            print(f"=== {' '.join(args)}")
            print(run(args))
sys.stdout.flush()
