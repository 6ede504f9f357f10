"""Every recipe validates as shipped, and the tiny recipes validate under every strategy."""

import pytest
from helpers.config import compose

from fleetwise.config.compose import group_options

RECIPES = group_options("recipe")


def test_all_required_recipes_exist():
    for name in [
        "gpt/tiny",
        "gpt/gpt2_small",
        "gpt/gpt3_1.3b",
        "gpt/gpt3_6.7b",
        "gpt/gpt3_13b",
        "gpt/gpt3_175b",
        "ernie/tiny",
        "ernie/ernie_base",
        "ernie/ernie_large",
        "ernie/ernie3_titan",
        "resnet/tiny",
        "resnet/resnet50",
        "resnet/resnet101",
        "ctr/tiny",
        "ctr/deepfm_criteo",
        "llama/tiny",
        "llama/llama3_1b",
        "llama/llama3_8b",
        "llama/llama3_70b",
        "llama/llama3_405b",
        "llama/qwen3_8b",
    ]:
        assert name in RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_validates_and_fits_as_shipped(recipe):
    from fleetwise.plan import make_plan

    cfg, problems = compose(f"recipe={recipe}")
    assert problems == [], problems
    assert cfg.recipe == recipe
    plan = make_plan(cfg)
    assert plan.fits, f"{recipe} does not fit: {plan.memory_bytes}"


@pytest.mark.parametrize("group", ["strategy", "hardware", "model", "data", "optim"])
def test_every_option_of_a_group_defines_the_same_keys(group):
    # Hydra's struct mode rejects typos only if every option of a group defines every key of its kind.
    import yaml

    from fleetwise.config.paths import config_dir

    keys = {}
    for opt in group_options(group):
        data = yaml.safe_load((config_dir() / group / f"{opt}.yaml").read_text())
        kind = (
            data.get("name")
            if group == "strategy" and data.get("name") == "ps"
            else data.get("family", "all")
        )
        keys.setdefault(kind, []).append((opt, set(data)))
    for variants in keys.values():
        first = variants[0][1]
        for opt, k in variants[1:]:
            assert k == first, f"{group}/{opt} keys differ: {k ^ first}"


TINY_LAYOUTS = [
    ("strategy=dp",),
    ("strategy=mp", "strategy.mp_degree=4", "strategy.dp_degree=2"),
    ("strategy=pp", "strategy.pp_degree=4", "strategy.dp_degree=2", "train.global_batch_size=32"),
    ("strategy=pp", "strategy.pp_degree=2", "strategy.dp_degree=4", "strategy.schedule=GPipe"),
    (
        "strategy=pp",
        "strategy.pp_degree=2",
        "strategy.dp_degree=4",
        "strategy.schedule=interleaved_1F1B",
        "strategy.virtual_stages=2",
        "train.global_batch_size=32",
    ),
    (
        "strategy=pp",
        "strategy.pp_degree=2",
        "strategy.dp_degree=4",
        "strategy.schedule=ZBV_zero_bubble",
        "strategy.virtual_stages=2",
        "train.global_batch_size=32",
    ),
    ("strategy=sharding", "strategy.sharding_stage=1"),
    ("strategy=sharding", "strategy.sharding_stage=3", "strategy.offload=true"),
    ("strategy=sharding", "strategy.sharding_degree=4", "strategy.dp_degree=2"),
    (
        "strategy=hybrid",
        "strategy.pp_degree=2",
        "strategy.mp_degree=2",
        "strategy.sharding_degree=2",
        "strategy.sharding_stage=2",
    ),
    (
        "strategy=hybrid",
        "strategy.pp_degree=2",
        "strategy.mp_degree=2",
        "strategy.sequence_parallel=true",
        "strategy.recompute=selective",
    ),
    ("strategy=hybrid", "strategy.mp_degree=2", "strategy.recompute=full"),
]


@pytest.mark.parametrize("family", ["gpt", "ernie", "llama"])
@pytest.mark.parametrize("layout", TINY_LAYOUTS, ids=lambda t: " ".join(t))
def test_tiny_transformers_validate_under_every_strategy(family, layout):
    cfg, problems = compose(f"recipe={family}/tiny", *layout)
    assert problems == [], problems
    s = cfg.strategy
    assert s.dp_degree * s.mp_degree * s.pp_degree * s.sharding_degree == cfg.hardware.world_size
    t = cfg.train
    assert t.global_batch_size == t.micro_batch_size * t.accumulate_steps * s.dp_degree * s.sharding_degree


@pytest.mark.parametrize(
    "layout",
    [
        ("strategy=dp",),
        ("strategy=sharding", "strategy.sharding_stage=3"),
        ("strategy=pp", "strategy.pp_degree=2", "strategy.dp_degree=4"),
    ],
)
def test_tiny_resnet_validates_without_tensor_parallel(layout):
    _, problems = compose("recipe=resnet/tiny", *layout)
    assert problems == []


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("strategy.mode=async", "strategy.dispatch=hash_name"),
        ("strategy.num_servers=1", "strategy.num_trainers=4", "train.global_batch_size=128"),
    ],
)
def test_ctr_validates_under_parameter_server(overrides):
    cfg, problems = compose("recipe=ctr/tiny", *overrides)
    assert problems == []
    assert cfg.strategy.name == "ps"


def test_command_line_group_choice_wins_over_the_recipe():
    cfg, problems = compose(
        "recipe=gpt/gpt3_1.3b",
        "strategy=hybrid",
        "strategy.pp_degree=4",
        "hardware=h100",
        "hardware.nodes=2",
        "strategy.dp_degree=auto",
    )
    assert problems == []
    assert (cfg.strategy.name, cfg.hardware.name, cfg.hardware.nodes) == ("hybrid", "h100", 2)
    assert (cfg.strategy.pp_degree, cfg.strategy.dp_degree) == (4, 4)
