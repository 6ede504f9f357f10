"""Your own model (`model=custom`, families/custom): what validate says about bad input, the units
the trace measures, the initial values, and the cache.

The model is the README's example (examples/mynet: a residual MLP and a seeded dataset) through
`--config-dir`; the bad inputs are in tests/helpers/custom_models.py. Each check's reference is
written here: the parameter count and FLOPs by hand, the initial values by the eager build
`torch.manual_seed(seed); Net(...)`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers.cli import run_cli
from helpers.repo import REPO

EXAMPLES = REPO / "examples"
CONF = EXAMPLES / "mynet" / "my_conf"
HELPERS = REPO / "tests"
NO_TP = "~model.tp_plan"
OWN = ("~model.module.dim", "~model.module.depth", "model.blocks=null", NO_TP)


@pytest.fixture(autouse=True)
def _user_setup(monkeypatch, tmp_path):
    """As a user runs it: from examples/ with --config-dir mynet/my_conf, a cache of its own."""
    monkeypatch.chdir(EXAMPLES)
    monkeypatch.setenv("FLEETWISE_EXTRA_CONFIG_DIRS", str(CONF))
    monkeypatch.setenv("FLEETWISE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(HELPERS))


def problems(*overrides: str):
    from fleetwise.launcher.preflight import preflight

    return preflight(["recipe=mynet", *overrides]).problems


BAD = [
    # (overrides, the location of a problem, words of its message)
    (("model.module._target_=nope.Net",), "model.module._target_", "does not import"),
    (("model.module._target_=helpers.custom_models.NotAModule",), "model.module._target_", "torch.nn.Module"),
    (("+model.module.bogus=1",), "model.module", "unexpected keyword argument 'bogus'"),
    (("data.dataset._target_=nope.data.Set",), "data.dataset._target_", "does not import"),
    (
        ("data.dataset._target_=helpers.custom_models.TupleItems", "~data.dataset.n"),
        "data.dataset",
        "items must be dicts of tensors",
    ),
    (("model.label=z",), "model.label", "'z' is not in the dataset's items (x, y)"),
    (("model.loss._target_=helpers.custom_models.per_sample_loss",), "model.loss", "not a scalar"),
    (
        ("+model.tp_plan.trunk=colwise", "+model.tp_plan.nope=rowwise"),
        "model.tp_plan.nope",
        "matches no module",
    ),
    (("+model.tp_plan.trunk=colwise",), "model.tp_plan.trunk", "ModuleList: colwise splits nn.Linear"),
    (("model.blocks=embed",), "model.blocks", "not an nn.ModuleList"),
    (("model.blocks=trunkk",), "model.blocks", "Did you mean 'trunk'"),
    (
        ("strategy=mp", "strategy.mp_degree=3", "hardware.devices_per_node=3"),
        "strategy.mp_degree",
        "128 output features, which do not divide by mp_degree=3",
    ),
    (
        ("model.module._target_=helpers.custom_models.OwnParameter", *OWN),
        "model.module",
        "owns scale but has no reset_parameters()",
    ),
    (
        (
            "model.module._target_=helpers.custom_models.WithLoss",
            *OWN,
            "model.loss=null",
            "model.inputs=null",
            "strategy=pp",
            "strategy.pp_degree=2",
            "hardware.devices_per_node=2",
        ),
        "strategy.pp_degree",
        "model.blocks is not set",
    ),  # fmt: skip
    (("strategy=ps",), "strategy", "out of its scope"),
]


@pytest.mark.parametrize(("overrides", "loc", "words"), BAD, ids=[b[1] + ":" + b[2][:24] for b in BAD])
def test_validate_explains_bad_input(overrides, loc, words):
    found = problems(*overrides)
    assert any(p.loc == loc and words in p.msg and p.hint for p in found), [(p.loc, p.msg) for p in found]


def test_every_problem_of_the_module_at_once():
    found = problems("model.blocks=trunkk", "+model.tp_plan.nope=rowwise", "+model.module.bogus=1")
    # the module's kwargs are checked before it is built: that problem alone, then the rest
    assert [p.loc for p in found] == ["model.module"], found
    found = problems("model.blocks=trunkk", "+model.tp_plan.nope=rowwise")
    assert {"model.blocks", "model.tp_plan.nope"} <= {p.loc for p in found}, found


def test_the_cli_exits_2_without_a_traceback(tmp_path):
    r = run_cli(
        "validate", "--config-dir", str(CONF), "recipe=mynet", "model.module._target_=mynet.net.Nett",
        "model.blocks=trunkk", cwd=EXAMPLES, env={"FLEETWISE_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "model.module._target_" in r.stdout + r.stderr and "Nett" in r.stdout + r.stderr


def _cfg(*overrides: str):
    from fleetwise.config.validate import load_config

    return load_config(["recipe=mynet", *overrides])


def test_units_are_measured_from_the_module():
    from fleetwise.families import model_units

    cfg = _cfg()
    units = model_units(cfg.model)
    features, dim, depth, classes, hidden = 16, 32, 4, 4, 128
    block = 2 * dim + (dim * hidden + hidden) + (hidden * dim + dim)
    assert [u.kind for u in units] == ["embedding", *["block"] * depth, "head"]
    assert sum(u.params for u in units) == features * dim + dim + depth * block + dim * classes + classes
    # forward FLOPs per sample: 2 per multiply-add of each Linear
    assert units[0].fwd_flops == 2 * features * dim
    assert [u.fwd_flops for u in units[1:-1]] == [2 * 2 * dim * hidden] * depth
    assert units[-1].fwd_flops == 2 * dim * classes
    # the tensor-parallel plan splits up (weight, bias) and down (weight)
    assert units[1].params_split == 2 * dim * hidden + hidden
    # a block's output goes to the next stage: dim floats per sample
    assert units[1].boundary_elements == dim
    # saved per sample: at least the LayerNorm input, up's input and output, gelu's output
    assert units[1].acts["none"].whole >= dim + dim + hidden + hidden
    assert cfg.model.num_layers == depth


def test_attention_flops_are_counted_as_the_dry_run_counts_them():
    """F.scaled_dot_product_attention runs the CPU flash-attention kernel here, which torch's FLOP
    registry lacks (FlopCounterMode alone counted 0): the trace uses the dry run's formulas. By hand,
    per sample and block: q's projection 2·4·4·4 FLOPs, QK^T and scores·V 2 · 2·4·4·4."""
    from fleetwise.families import model_units

    cfg = _cfg(
        "model.module._target_=helpers.custom_models.Attentive",
        "~model.module.dim",
        "~model.module.depth",
        NO_TP,
    )
    units = model_units(cfg.model)
    assert [u.fwd_flops for u in units[1:-1]] == [2 * 4 * 4 * 4 + 2 * (2 * 4 * 4 * 4)] * 2


def test_second_derivation_reads_the_cache(monkeypatch):
    from fleetwise.families.custom import derive

    derive._MEMO.clear()  # traced in this test's cache folder
    first = derive.derived(_cfg().model)
    derive._MEMO.clear()
    monkeypatch.setattr(derive, "_derive", lambda *_: pytest.fail("traced again"))
    again = derive.derived(_cfg().model)
    assert again.units == first.units and again.chain == first.chain == (("embed",), ("head",))
    # a second `plan` is as fast as a built-in one: a cached derivation imports neither the
    # user's module nor torch
    code = (
        "import sys; from fleetwise.launcher.preflight import preflight; "
        "pf = preflight(['recipe=mynet']); assert not pf.problems, pf.problems; "
        "print(pf.plan.params, 'torch' in sys.modules, 'mynet.net' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=EXAMPLES)
    assert out.stdout.split() == ["34340", "False", "False"], out.stderr[-2000:]


def test_initial_values_are_the_eager_builds():
    """fleetwise builds on meta and replays each module's reset_parameters; the result is exactly
    what the user's own constructor gives under the seed -- in every layout (the parity tests)."""
    import sys

    sys.path.insert(0, str(EXAMPLES))
    from mynet.net import Net

    from fleetwise.runtime.modeling import build_model

    cfg = _cfg("train.seed=7")
    ours = build_model(cfg).state_dict()
    torch.manual_seed(7)
    eager = Net(features=16, dim=32, depth=4, classes=4).state_dict()
    assert list(ours) == list(eager)  # the user's own parameter names
    for name, value in eager.items():
        assert torch.equal(ours[name], value), name


def test_a_hugging_face_model_starts_from_its_own_init_weights(monkeypatch):
    """README: a transformers model (examples/tinylm) is accepted and initialised by its own
    `_init_weights`, module by module in module order from one stream seeded by train.seed; the
    reference is transformers' eager model re-set that way here (normal(0, 0.02) weights, norms at
    one), not fleetwise's replay."""
    transformers = pytest.importorskip("transformers")
    from omegaconf import OmegaConf

    from fleetwise.runtime.modeling import build_model

    conf = EXAMPLES / "tinylm" / "my_conf"
    monkeypatch.setenv("FLEETWISE_EXTRA_CONFIG_DIRS", str(conf))
    from fleetwise.config.validate import load_config

    ours = build_model(
        load_config(["recipe=hf_llama", "train.seed=7", "hardware.devices_per_node=1"])
    ).state_dict()
    shape = OmegaConf.to_container(OmegaConf.load(conf / "recipe" / "hf_llama.yaml").model.module.config)
    shape.pop("_target_")
    eager = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**shape))
    torch.manual_seed(7)
    with torch.no_grad():
        for module in eager.modules():
            if [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                eager._init_weights(module)
    want = eager.state_dict()
    assert list(ours) == list(want)
    for name, value in want.items():
        assert torch.equal(ours[name], value), name


def test_blocks_read_like_the_module_list():
    from fleetwise.families.custom.model import BlockList

    blocks = BlockList({str(i): torch.nn.Linear(2, 2) for i in range(3)})
    assert list(blocks) == [blocks["0"], blocks["1"], blocks["2"]]
    assert blocks[-1] is blocks["2"] and blocks[1] is blocks["1"] and len(blocks) == 3
    assert blocks[:2] == [blocks["0"], blocks["1"]]


def test_forward_that_returns_the_loss():
    """No model.loss: forward(**batch) returns the loss (here a dict with `loss`, as Hugging Face
    models return an object with one); the trainer's loss is that tensor."""
    import numpy as np
    from helpers.custom_models import WithLoss

    from fleetwise.runtime.modeling import build_model, build_source, model_spec

    cfg = _cfg(
        "model.module._target_=helpers.custom_models.WithLoss", *OWN, "model.loss=null", "model.inputs=null"
    )
    spec, model = model_spec(cfg), build_model(cfg)
    batch = build_source(cfg).batch(np.arange(8))
    assert spec.inputs == ("x", "y")
    loss = spec.loss(model(*[batch[k] for k in spec.inputs]), batch[spec.label])
    torch.manual_seed(cfg.train.seed)
    eager = WithLoss()(batch["x"], batch["y"])["loss"]
    assert loss.shape == () and torch.equal(loss, eager)


@pytest.mark.parametrize("cfg_flag,imports_target", [(True, False), (False, True)])
def test_printing_the_config_calls_nothing(tmp_path, cfg_flag, imports_target):
    """README: `validate --cfg` and `plan --cfg` call nothing -- a recipe with `_target_` is code, and
    printing it must not run it. A fresh process with an empty cache; the case without --cfg shows the
    check sees the import when there is one."""
    flag = ", '--cfg', 'job'" if cfg_flag else ""
    code = (
        "import sys; from fleetwise.cli import main; "
        f"rcs = [main(['validate', 'recipe=mynet'{flag}]), main(['plan', 'recipe=mynet'{flag}])]; "
        "print(rcs, 'mynet.net' in sys.modules, 'torch' in sys.modules)"
    )
    env = {**os.environ, "FLEETWISE_CACHE_DIR": str(tmp_path / "empty")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=EXAMPLES, env=env)
    assert out.stdout.splitlines()[-1] == f"[0, 0] {imports_target} {imports_target}", out.stderr[-2000:]


def test_validate_names_a_foreign_target_and_does_not_import_it(tmp_path, monkeypatch, capsys):
    """A recipe is code: `validate` imports only what a recipe names inside its own project
    (examples/mynet beside my_conf), fleetwise, torch or transformers. A `_target_` anywhere else is
    named in a notice with its file, found without importing it (its package's __init__ would
    leave a marker), and the config is still validated; `plan` imports it."""
    from fleetwise.cli import main

    pkg = tmp_path / "elsewhere" / "foreignpkg"
    pkg.mkdir(parents=True)
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, **kw):\n"
        "        super().__init__()\n"
        "        self.trunk = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])\n"
        "        self.head = nn.Linear(16, 4)\n"
        "    def forward(self, x):\n"
        "        for b in self.trunk:\n"
        "            x = b(x)\n"
        "        return self.head(x)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    foreign = ["recipe=mynet", "model.module._target_=foreignpkg.Net", NO_TP]

    pipeline = ("strategy=hybrid", "strategy.pp_degree=2", "strategy.virtual_stages=2")
    pipeline += ("strategy.schedule=interleaved_1F1B", "hardware.devices_per_node=2")
    assert main(["validate", *foreign, *pipeline]) == 0
    out, err = capsys.readouterr()
    assert (
        "notice" in err and "model.module._target_=foreignpkg.Net" in err and str(pkg / "__init__.py") in err
    )
    assert "did not import" in err and "not imported (foreignpkg.Net)" in " ".join(out.split())
    assert not marker.exists() and "foreignpkg" not in sys.modules
    # still validated: a wrong degree is reported as for any config
    assert main(["validate", *foreign, "strategy.dp_degree=3"]) == 2
    assert "dp_degree(3)" in "".join(capsys.readouterr())
    assert not marker.exists()
    # the README's own example: its module lives beside its config tree, no notice
    assert main(["validate", "recipe=mynet"]) == 0
    assert "notice" not in capsys.readouterr().err
    # plan imports and traces it
    assert main(["plan", *foreign]) == 0 and marker.exists()


def test_the_mlflow_run_records_the_targets_and_their_kwargs():
    """What the launcher logs as MLflow params (launcher/job_tracking.py: the validated config,
    flattened): a custom run says which class and dataset it trained, with their arguments."""
    from fleetwise.tracking.params import flatten_config

    params = flatten_config(_cfg().model_dump(mode="json"))
    assert {k: params.get(k) for k in (
        "model.module._target_", "model.module.dim", "model.module.depth", "model.blocks",
        "model.loss._target_", "data.dataset._target_", "data.dataset.n",
    )} == {
        "model.module._target_": "mynet.net.Net", "model.module.dim": "32", "model.module.depth": "4",
        "model.blocks": "trunk", "model.loss._target_": "mynet.net.loss", "data.dataset._target_": "mynet.data.Blobs",
        "data.dataset.n": "1024",
    }  # fmt: skip


def test_strategy_auto_searches_your_model_with_its_tp_plan_and_chain():
    """strategy=auto on a custom model: the candidates use what the model allows (mp through its
    tp_plan, pp through its chain of blocks), the ranked ones fit, the winner is the fastest of them
    (the search's pruning against a brute force is tests/unit/plan/test_auto_search.py's)."""
    from fleetwise.launcher.auto import resolve_auto

    r = resolve_auto(["recipe=mynet", "strategy=auto", "hardware.devices_per_node=4"], progress=False).result
    degrees = {(c.strategy["mp_degree"], c.strategy["pp_degree"]) for c in r.ranked}
    assert {(2, 1), (1, 2), (4, 1)} <= degrees, sorted(degrees)
    assert r.ranked and all(c.memory <= r.budget_bytes for c in r.ranked)  # ranked: the fitting ones
    assert r.winner.plan.step_time_s == min(c.plan.step_time_s for c in r.ranked)
