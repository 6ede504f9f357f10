"""The model contract (fleetwise.models.contract): every built-in family's model obeys it, and a
module that breaks it is told where, what and how to fix it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from helpers.config import compose
from torch import nn

from fleetwise.families import FAMILIES, family_of
from fleetwise.models.contract import ModelContractError, check_model, contract_problems
from fleetwise.runtime.modeling import build_meta_model, model_spec


class Good(nn.Module):
    """The smallest model that obeys the contract; the tests below break it one way each."""

    first_modules = ("embed",)
    last_modules = ("head",)

    def __init__(self, width: int = 4, blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.layers = nn.ModuleDict({str(i): nn.Linear(width, width) for i in range(blocks)})
        self.head = nn.Linear(width, 10)

    def init_rule(self, module_name, module, attr, shape, generator):
        return torch.zeros(shape)

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        for block in self.layers.values():
            h = block(h)
        return self.head(h) if self.head is not None else h


def _meta(cls, *args):
    with torch.device("meta"):
        return cls(*args)


def _only(problems):
    assert len(problems) == 1, [f"{p.loc}: {p.msg}" for p in problems]
    return problems[0]


# model=custom is no built-in: it has no tiny recipe of its own (a user's module, examples/mynet;
# tests/unit/families/test_custom.py)
@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "custom"])
def test_each_built_in_family_obeys_the_contract(name):
    cfg, problems = compose(f"recipe={name}/tiny")
    assert cfg is not None, problems
    fam, spec = family_of(cfg.model), model_spec(cfg)
    model = build_meta_model(cfg)  # checks the contract itself: it raises on a break
    plan = [*spec.tp_plan(False), *spec.tp_plan(True)] if spec.tp_plan else []
    assert (
        contract_problems(
            model,
            inputs=spec.inputs,
            num_layers=cfg.model.num_layers,
            pipeline=fam.no_pipeline is None,
            tp_paths=plan,
        )
        == []
    )


def test_the_smallest_model_obeys_it():
    assert (
        contract_problems(_meta(Good), inputs=("tokens",), num_layers=2, tp_paths=["layers.*", "head"]) == []
    )


def test_a_module_without_layers():
    class NoLayers(Good):
        def __init__(self):
            super().__init__()
            del self.layers

    p = _only(contract_problems(_meta(NoLayers)))
    assert p.loc == "NoLayers.layers"
    assert p.msg == "missing: NoLayers has no `layers`"
    assert "self.layers = nn.ModuleDict({str(i): Block(...)" in p.hint


def test_layers_that_are_not_a_module_dict():
    class ListLayers(Good):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    p = _only(contract_problems(_meta(ListLayers)))
    assert p.loc == "ListLayers.layers"
    assert p.msg == "is a ModuleList, not an nn.ModuleDict"
    assert "nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})" in p.hint


def test_first_modules_naming_a_missing_attribute():
    class Typo(Good):
        first_modules = ("embedding",)

    p = _only(contract_problems(_meta(Typo)))
    assert p.loc == "Typo.first_modules"
    assert p.msg == "names 'embedding', which Typo does not have. Did you mean 'embed'?"
    assert "its submodules are 'embed', 'head'" in p.hint


def test_first_modules_as_a_bare_string():
    class Bare(Good):
        first_modules = "embed"

    p = _only(contract_problems(_meta(Bare)))
    assert (p.loc, p.msg) == ("Bare.first_modules", "is the string 'embed', not a tuple of names")
    assert "first_modules = ('embed',)" in p.hint


def test_blocks_keyed_by_name_not_index():
    class Named(Good):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})

    p = _only(contract_problems(_meta(Named)))
    assert p.msg == "is keyed 'a', 'b', not by the block indices '0'..'1' in order"


def test_blocks_against_the_config():
    p = _only(contract_problems(_meta(Good), num_layers=3))
    assert p.msg == "holds 2 blocks but the model config says num_layers=3"


def test_state_outside_the_pipeline_split():
    class Extra(Good):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(8, 4)
            self.scale = nn.Parameter(torch.ones(1))

    locs = [p.loc for p in contract_problems(_meta(Extra))]
    assert locs == ["Extra.pos", "Extra.scale"]
    # a model that is never pipelined may keep state anywhere
    assert contract_problems(_meta(Extra), pipeline=False) == []


def test_forward_that_cannot_take_the_inputs():
    class TwoInputs(Good):
        def forward(self, tokens, types):
            return super().forward(tokens)

    problems = contract_problems(_meta(TwoInputs), inputs=("tokens", "types", "extra"))
    assert [p.loc for p in problems] == ["TwoInputs.forward", "TwoInputs.forward"]
    assert problems[0].msg == (
        "forward(tokens, types) cannot be called as forward(batch['tokens'], batch['types'], batch['extra'])"
    )
    assert "cannot be called with one tensor (the hidden states)" in problems[1].msg
    assert "token_types=None" in problems[1].hint


def test_no_init_rule():
    class NoInit(nn.Module):
        first_modules: tuple[str, ...] = ()
        last_modules: tuple[str, ...] = ()

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"0": nn.Linear(2, 2)})

        def forward(self, x):
            return self.layers["0"](x)

    p = _only(contract_problems(_meta(NoInit)))
    assert (p.loc, p.msg) == (
        "NoInit.init_rule",
        "missing: NoInit has neither `init_rule` nor `initial_value`",
    )
    assert "initial_value(name, shape, seed)" in p.hint


def test_a_tensor_parallel_plan_naming_a_missing_module():
    p = _only(contract_problems(_meta(Good), tp_paths=["layers.*", "haed"]))
    assert p.msg == "the tensor-parallel plan names 'haed', which Good does not have. Did you mean 'head'?"


def test_check_model_raises_with_every_problem_and_its_fix():
    class Broken(Good):
        first_modules = ("embedding",)
        last_modules = "head"

        def __init__(self):
            super().__init__()
            del self.layers

    with pytest.raises(ModelContractError) as err:
        check_model(_meta(Broken))
    assert [p.loc for p in err.value.problems] == [
        "Broken.layers",
        "Broken.first_modules",
        "Broken.last_modules",
    ]
    text = str(err.value)
    assert text.startswith("Broken does not satisfy fleetwise's model contract")
    assert text.count("\n  fix: ") == 3


def test_the_contract_imports_no_torch():
    code = "import sys, fleetwise.models.contract; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_model_never_pipelined_needs_no_first_or_last_modules():
    class Flat(Good):
        first_modules = None  # not named at all: the model is never cut into stages

    assert [p.loc for p in contract_problems(_meta(Flat))] == ["Flat.first_modules", "Flat.embed"]
    assert contract_problems(_meta(Flat), pipeline=False) == []


def test_the_runtime_refuses_a_model_that_breaks_it(monkeypatch):
    import fleetwise.runtime.modeling as modeling

    cfg, problems = compose("recipe=gpt/tiny")
    assert cfg is not None, problems
    real = model_spec(cfg)

    class Blockless(Good):
        def __init__(self, _cfg):
            super().__init__()
            del self.layers

    monkeypatch.setattr(modeling, "model_spec", lambda _cfg: dataclasses.replace(real, build=Blockless))
    with pytest.raises(ModelContractError, match=r"Blockless.layers: missing"):
        modeling.build_meta_model(cfg)
