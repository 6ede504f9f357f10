"""Your own model trained for real (model=custom): the README's example (examples/mynet) under
ZeRO-3 on 2 ranks and under data parallelism of 2 × a pipeline of 2 stages × tensor parallelism of 2
(its `blocks` and `tp_plan`) with every block recomputed on 8 ranks, each step's loss equal to a plain single-process PyTorch loop written here
(the user's own class under `torch.manual_seed`, torch.optim.SGD, no fleetwise code); and the
planner held against the dry run for it, at 2 and 8 ranks. And a Hugging Face model through the same
door (examples/tinylm: `transformers.AutoModelForCausalLM.from_config`, no `loss` key) under dp 2
and ZeRO-3 on 2 ranks against a loop of transformers' own model and loss, loaded back by
`fleetwise.load_model`."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers.cli import run_cli
from helpers.repo import REPO
from helpers.runs import read_metrics

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples"
CONF = str(EXAMPLES / "mynet" / "my_conf")
STEPS, GLOBAL, MICRO, LR, SEED = 4, 16, 4, 0.2, 42
COMMON = (
    "--config-dir", CONF, "recipe=mynet", "optim=sgd", f"optim.lr={LR}", "optim.momentum=0",
    "optim.weight_decay=0", "optim.schedule=constant", "optim.warmup_steps=0", f"train.steps={STEPS}",
    f"train.global_batch_size={GLOBAL}", f"train.micro_batch_size={MICRO}", f"train.seed={SEED}",
    "tracking.enabled=false", "train.log_interval=1",
)  # fmt: skip


def plain_losses() -> list[float]:
    """The user's own loop: their model as their constructor makes it, full-batch SGD."""
    sys.path.insert(0, str(EXAMPLES))
    from mynet.data import Blobs
    from mynet.net import Net

    torch.manual_seed(SEED)
    net = Net(features=16, dim=32, depth=4, classes=4)
    data = Blobs(n=1024)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        idx = torch.arange(step * GLOBAL, (step + 1) * GLOBAL) % len(data)
        x, y = data.x[idx], data.y[idx]
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train(tmp_path, name: str, *layout: str) -> list[float]:
    run_dir = tmp_path / name
    r = run_cli(
        "train", *COMMON, *layout, f"run.dir={run_dir}", cwd=EXAMPLES,
        env={"FLEETWISE_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return [rec["train/loss"] for rec in read_metrics(run_dir)]


def test_every_layout_equals_the_plain_loop(tmp_path):
    want = plain_losses()
    assert want[-1] < want[0]  # it learns
    zero3 = _train(
        tmp_path, "zero3", "strategy=sharding", "strategy.sharding_degree=2", "strategy.sharding_stage=3",
        "hardware.devices_per_node=2",
    )  # fmt: skip
    assert zero3 == pytest.approx(want, rel=1e-5, abs=1e-6)
    # the 3D mix: data x pipeline x tensor parallel (its tp_plan), every block recomputed
    mix = _train(
        tmp_path, "dp2_pp2_mp2", "strategy=hybrid", "strategy.pp_degree=2", "strategy.mp_degree=2",
        "strategy.dp_degree=2", "strategy.recompute=full", "hardware.devices_per_node=8",
    )  # fmt: skip
    assert mix == pytest.approx(want, rel=1e-5, abs=1e-6)


LAYOUTS = {
    "dp2": ("strategy=dp", "hardware.devices_per_node=2"),
    "zero2_w8": ("strategy=sharding", "strategy.sharding_stage=2", "hardware.devices_per_node=8"),
    # ZeRO-3 of a model without a loss peak of its own (no vocabulary-wide head): the peak is a
    # block's backward, which the planner left out for ZeRO-3 (plan/memory/phases.py; was -31%)
    "zero3_w8": (
        "strategy=sharding",
        "strategy.sharding_stage=3",
        "hardware.devices_per_node=8",
        "--ranks",
        "0",
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planner_matches_the_dry_run(tmp_path, name):
    r = run_cli(
        "dryrun", "--config-dir", CONF, "recipe=mynet", "model.module.dim=128", "train.global_batch_size=32",
        *LAYOUTS[name], "--json", cwd=EXAMPLES, env={"FLEETWISE_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    for x in json.loads(r.stdout)["ranks"]:
        cmp = x["planner"]
        print(
            f"\n{name} rank {x['rank']}: memory {cmp['memory_bytes']['rel']:+.2%}, flops {cmp['flops_per_step']['rel']:+.2%}"
        )
        assert abs(cmp["memory_bytes"]["rel"]) <= 0.05, cmp["memory_bytes"]
        assert abs(cmp["flops_per_step"]["rel"]) <= 0.01, cmp["flops_per_step"]


HF_CONF = str(EXAMPLES / "tinylm" / "my_conf")
HF_STEPS, HF_GLOBAL, HF_LR = 3, 8, 2.0
HF_COMMON = (
    "--config-dir", HF_CONF, "recipe=hf_llama", "optim=sgd", f"optim.lr={HF_LR}", "optim.momentum=0",
    "optim.weight_decay=0", "optim.schedule=constant", "optim.warmup_steps=0", "optim.grad_clip=null",
    f"train.steps={HF_STEPS}", f"train.global_batch_size={HF_GLOBAL}", "train.micro_batch_size=2",
    f"train.seed={SEED}", "tracking.enabled=false", "train.log_interval=1", "hardware.devices_per_node=2",
)  # fmt: skip


def hf_plain_loop():
    """transformers' model and loss, no fleetwise code: built eagerly, then every module that owns
    tensors set by the model's own `_init_weights` in module order from one stream seeded by the
    job's seed (README "Your own model": how fleetwise starts a Hugging Face model), full-batch SGD."""
    import transformers
    from omegaconf import OmegaConf

    sys.path.insert(0, str(EXAMPLES))
    from tinylm.data import CountingTokens

    recipe = OmegaConf.load(EXAMPLES / "tinylm" / "my_conf" / "recipe" / "hf_llama.yaml")
    shape = {k: v for k, v in recipe.model.module.config.items() if k != "_target_"}
    net = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**shape))
    torch.manual_seed(SEED)
    with torch.no_grad():
        for module in net.modules():
            if [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                net._init_weights(module)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    data = CountingTokens(**{k: v for k, v in recipe.data.dataset.items() if k != "_target_"})
    opt = torch.optim.SGD(net.parameters(), lr=HF_LR)
    losses = []
    for step in range(HF_STEPS):
        ids = data.ids[step * HF_GLOBAL : (step + 1) * HF_GLOBAL]
        opt.zero_grad()
        loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, initial, net.state_dict()


def test_a_hugging_face_model_equals_transformers_own_loop(tmp_path):
    import fleetwise

    want, initial, final = hf_plain_loop()
    for name, layout in {
        "dp2": ("strategy=dp",),
        "zero3": ("strategy=sharding", "strategy.sharding_degree=2", "strategy.sharding_stage=3"),
    }.items():
        run_dir = tmp_path / name
        r = run_cli(
            "train", *HF_COMMON, *layout, "checkpoint.enabled=true", f"run.dir={run_dir}", cwd=EXAMPLES,
            env={"FLEETWISE_CACHE_DIR": str(tmp_path / "cache")},
        )  # fmt: skip
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        got = [rec["train/loss"] for rec in read_metrics(run_dir)]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), name
    # what a user gets back: transformers' own class, holding the loop's final weights, moved from the start
    loaded = fleetwise.load_model(run_dir).state_dict()
    params = [k for k in final if "rotary" not in k]
    worst = max((loaded[k] - final[k]).abs().max().item() for k in params)
    moved = min((final[k] - initial[k]).abs().max().item() for k in params)
    print(f"HF model: losses {got}, load_model vs loop {worst:.2e}, smallest move {moved:.2e}")
    assert worst < 1e-5 and moved > 1e-4, (worst, moved)  # measured 3.0e-7 and 1.1e-3
