"""One registry entry per model family: every family is complete, torch-free at import, and
nothing outside `fleetwise.families` dispatches on a concrete family."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import typing

import pytest
from helpers.config import compose
from helpers.repo import REPO

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


# model=custom is no built-in: it has no tiny recipe of its own (a user's module, examples/mynet;
# tests/unit/families/test_custom.py)
@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "custom"])
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
    # the rules allow mp_degree > 1 exactly when the rank side has a tensor-parallel plan
    assert (fam.tensor_parallel is None) == (fam.spec(cfg.model).tp_plan is None)


def test_families_import_no_torch():
    # a fresh interpreter: the registry, the config union and the planner stay torch-free
    code = "import sys, fleetwise.families, fleetwise.config.model, fleetwise.plan.planner; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# a family package's rank-side modules: they import torch, and the family's functions import them
RANK_SIDE_MODULES = ("model.py", "tp_plan.py", "data.py", "weights.py")  # weights: Llama's HF tensors


def test_rank_side_parts_are_imported_only_inside_functions():
    rank_side = ("torch", "fleetwise.models", "fleetwise.data", "fleetwise.runtime")
    torch_free = ("fleetwise.models.contract",)  # the model contract: named by the family record
    wrong = []
    for path in (PACKAGE / "families").rglob("*.py"):
        if path.name in RANK_SIDE_MODULES and path.parent != PACKAGE / "families":
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            where = path.relative_to(PACKAGE / "families")
            wrong += [
                f"{where} imports {n}"
                for n in names
                if (n.startswith(rank_side) and n not in torch_free)
                or (n.startswith("fleetwise.families.") and n.rpartition(".")[2] + ".py" in RANK_SIDE_MODULES)
            ]
    assert not wrong, wrong


def _dispatches(path, root=PACKAGE) -> list[str]:
    """isinstance(x, <a family schema>) and `x.family ==/in "<name>"` tests in one file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "isinstance"
            and len(node.args) == 2
        ):
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if named & SCHEMAS:
                out.append(
                    f"{path.relative_to(root)}:{node.lineno} isinstance on {sorted(named & SCHEMAS)}"
                )
        if (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Attribute)
            # `cfg.model.family == "gpt"`, or the registry's record: `family.name != "custom"`
            and (node.left.attr == "family" or node.left.attr == "name" and _names_a_family(node.left.value))
            # against a family's name (a string), not e.g. a socket address family
            and any(
                isinstance(c, ast.Constant) and isinstance(c.value, str)
                for comp in node.comparators
                for c in ast.walk(comp)
            )
        ):
            out.append(f"{path.relative_to(root)}:{node.lineno} compares .{node.left.attr}")
    return out


def _names_a_family(node: ast.AST) -> bool:
    """`family`, `fam`, `family_of(...)`, `self.family`: an expression holding a Family record."""
    if isinstance(node, ast.Call):
        node = node.func
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name in ("family", "fam", "family_of")


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
    planted = tmp_path / "plan" / "planted.py"  # outside the source tree: the check reads any file
    planted.parent.mkdir()
    planted.write_text(
        "def f(m, family):\n"
        "    return isinstance(m, ResNetModel) or m.family == 'gpt'\n"
        "def g(family, cfg):\n"
        "    return family.name != 'custom' or family_of(cfg.model).name in ('llama',)\n"
    )
    assert _dispatches(planted, root=tmp_path) == [
        "plan/planted.py:2 isinstance on ['ResNetModel']",
        "plan/planted.py:2 compares .family",
        "plan/planted.py:4 compares .name",
        "plan/planted.py:4 compares .name",
    ]


# A fifth family in one package, laid out like the built-in ones: schema, planner units, the
# nn.Module (obeying the model contract), the data source, and the record in __init__.py. Nothing
# else in fleetwise changes; the package lives in a temporary folder on sys.path and registers
# itself, then a fresh interpreter validates, plans and builds it (the `model` union is built once
# per process, from the registry).
TOY_PACKAGE = {
    "__init__.py": """
from fleetwise.families import register
from fleetwise.families.record import Family, ModelSpec
from toyfam.schema import ToyModel
from toyfam.units import input_bytes, units


def spec(m):
    import torch

    from toyfam.model import ToyNet

    return ModelSpec(ToyNet, lambda out, y: torch.nn.functional.mse_loss(out.squeeze(-1), y), ("x",))


def source(m, d):
    from toyfam.data import Source

    return Source(m, d)


FAMILY = register(
    Family(name="toy", schema=ToyModel, units=units, input_bytes=input_bytes, spec=spec, source=source)
)
""",
    "schema.py": """
from typing import Literal

from pydantic import Field

from fleetwise.config.base import Section


class ToyModel(Section):
    family: Literal["toy"] = "toy"
    width: int = Field(ge=1)
    num_layers: int = Field(2, ge=1)
""",
    "units.py": """
from fleetwise.plan.units import Acts, Unit


def units(m):
    w = m.width
    linear = dict(params_whole=w * w + w, fwd_flops=2 * w * w, acts={"none": Acts(whole=w)})
    return [
        Unit("embedding", "embedding", **linear),
        *[Unit(f"block{i}", "block", **linear) for i in range(m.num_layers)],
        Unit("head", "head", params_whole=w + 1, fwd_flops=2 * w, acts={"none": Acts(whole=w)}),
    ]


def input_bytes(m):
    return 4 * m.width + 4
""",
    "model.py": """
import torch
from torch import nn


class ToyNet(nn.Module):
    first_modules = ("embed",)  # the model contract: fleetwise.models.contract
    last_modules = ("head",)

    def __init__(self, m):
        super().__init__()
        self.embed = nn.Linear(m.width, m.width)
        self.layers = nn.ModuleDict({str(i): nn.Linear(m.width, m.width) for i in range(m.num_layers)})
        self.head = nn.Linear(m.width, 1)

    def init_rule(self, mname, module, attr, shape, g):  # see fleetwise.models.init
        return torch.randn(shape, generator=g) * 0.1

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for block in self.layers.values():
            h = block(h)
        return self.head(h) if self.head is not None else h
""",
    "data.py": """
import torch


class Source:
    def __init__(self, m, d):
        self.width, self.seed = m.width, d.seed

    def batch(self, indices):
        g = torch.Generator().manual_seed(self.seed + int(indices[0]))
        x = torch.randn(len(indices), self.width, generator=g)
        return {"x": x, "labels": x.sum(-1)}
""",
}

TOY_DRIVER = """
import json, numpy as np, torch
import toyfam  # registers the family before anything builds the config union
from fleetwise.config.compose import compose_config
from fleetwise.config.validate import validate
from fleetwise.plan import make_plan
from fleetwise.runtime.modeling import build_model, build_source, model_spec

data = compose_config(["recipe=gpt/tiny"])
data["model"] = {"family": "toy", "width": 8}
cfg = validate(data)
plan = make_plan(cfg)
model, spec = build_model(cfg), model_spec(cfg)
batch = build_source(cfg).batch(np.arange(4))
loss = spec.loss(model(batch["x"]), batch["labels"])
data["model"] = {"family": "toy", "width": 0}
try:
    validate(data)
    bad = []
except Exception as exc:
    bad = [p.loc for p in exc.problems]
print(json.dumps({"plan_params": plan.params, "torch_params": sum(p.numel() for p in model.parameters()),
                  "loss_finite": bool(torch.isfinite(loss)), "bad": bad}))
"""


def test_a_fifth_family_is_one_package(tmp_path):
    import os

    (tmp_path / "toyfam").mkdir()
    for name, text in TOY_PACKAGE.items():
        (tmp_path / "toyfam" / name).write_text(text.lstrip())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", TOY_DRIVER], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["plan_params"] == got["torch_params"] == 3 * (8 * 8 + 8) + 8 + 1
    assert got["loss_finite"]
    assert got["bad"] == ["model.width"]  # its schema's rules reach the user like any family's


def test_register_refuses_once_the_union_is_built():
    from fleetwise.families import register

    with pytest.raises(RuntimeError, match="after fleetwise.config.model"):
        register(FAMILIES["gpt"])
