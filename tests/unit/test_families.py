"""One registry entry per model family: every family is complete, torch-free at import, and
nothing outside `fleetwise.families` dispatches on a concrete family."""

from __future__ import annotations

import ast
import subprocess
import sys
import typing

import pytest
from conftest import REPO, compose

from fleetwise.config.model import ModelConfig
from fleetwise.families import FAMILIES, family_of, total_params
from fleetwise.plan import make_plan

PACKAGE = REPO / "platform" / "fleetwise"
SCHEMAS = {f.schema.__name__ for f in FAMILIES.values()} | {"TransformerModel"}
# runtime/ps/ is the CTR family's own engine (CTRNet, SyntheticClicks): its asserts narrow types
ENGINE_OF_ONE_FAMILY = {"runtime/ps/reference.py", "runtime/ps/trainer.py"}


def test_the_model_union_is_the_registry_in_order():
    members = typing.get_args(typing.get_args(ModelConfig)[0])
    assert [m.__name__ for m in members] == [f.schema.__name__ for f in FAMILIES.values()]
    for name, f in FAMILIES.items():
        assert f.schema.model_fields["family"].default == name


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_has_its_conf_a_tiny_recipe_and_plans(name):
    assert (REPO / "conf" / "model" / f"{name}.yaml").is_file()
    cfg, problems = compose(f"recipe={name}/tiny")
    assert cfg is not None, problems
    fam = family_of(cfg.model)
    assert fam.name == name
    units = fam.units(cfg.model)
    assert units[0].kind == "embedding" and {u.kind for u in units} <= {"embedding", "block", "head"}
    assert fam.input_bytes(cfg.model) > 0
    assert make_plan(cfg).params == total_params(cfg.model) > 0


def test_families_import_no_torch():
    # a fresh interpreter: the registry, the config union and the planner stay torch-free
    code = "import sys, fleetwise.families, fleetwise.config.model, fleetwise.plan.planner; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_rank_side_parts_are_imported_only_inside_functions():
    rank_side = ("torch", "fleetwise.models", "fleetwise.data", "fleetwise.runtime")
    wrong = []
    for path in (PACKAGE / "families").glob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            wrong += [f"{path.name} imports {n}" for n in names if n.startswith(rank_side)]
    assert not wrong, wrong


def _dispatches(path) -> list[str]:
    """isinstance(x, <a family schema>) and `x.family ==/in "<name>"` tests in one file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if named & SCHEMAS:
                out.append(f"{path.relative_to(PACKAGE)}:{node.lineno} isinstance on {sorted(named & SCHEMAS)}")
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "family":
            out.append(f"{path.relative_to(PACKAGE)}:{node.lineno} compares .family")
    return out


def test_nothing_outside_families_dispatches_on_a_family():
    files = [
        p
        for p in PACKAGE.rglob("*.py")
        if "families" not in p.relative_to(PACKAGE).parts
        and p.relative_to(PACKAGE).as_posix() not in ENGINE_OF_ONE_FAMILY
    ]
    wrong = [d for p in files for d in _dispatches(p)]
    assert not wrong, wrong


def test_the_dispatch_check_sees_a_planted_dispatch(tmp_path):
    planted = PACKAGE / "plan" / "_planted_for_test.py"
    planted.write_text("def f(m):\n    return isinstance(m, ResNetModel) or m.family == 'gpt'\n")
    try:
        assert len(_dispatches(planted)) == 2
    finally:
        planted.unlink()
