"""Layout-invariant initialisation (fleetwise.models.init): a parameter's initial value depends only
on the seed, its name and its shape, so a rank can draw just its own shards of a meta-built model."""

from __future__ import annotations

import torch
from helpers.config import compose

from fleetwise.models.init import init_weights_, model_name
from fleetwise.runtime.modeling import build_meta_model, build_model


def test_a_parameter_does_not_depend_on_the_rest_of_the_model():
    small, _ = compose("recipe=gpt/tiny", "model.num_layers=2")
    large, _ = compose("recipe=gpt/tiny", "model.num_layers=4")
    a, b = build_model(small).state_dict(), build_model(large).state_dict()
    # the same name and shape -> the same values (the residual projections are scaled by depth)
    assert torch.equal(a["layers.1.attn.wq.weight"], b["layers.1.attn.wq.weight"])
    assert torch.equal(a["embed.tok.weight"], b["embed.tok.weight"])
    assert torch.allclose(
        a["layers.0.attn.wo.weight"] * (2 / 8) ** 0.5 / (2 / 4) ** 0.5, b["layers.0.attn.wo.weight"]
    )
    assert not torch.equal(a["layers.0.attn.wq.weight"], a["layers.1.attn.wq.weight"])  # one stream each
    seed, _ = compose("recipe=gpt/tiny", "model.num_layers=2", "train.seed=7")
    assert not torch.equal(build_model(seed).state_dict()["embed.tok.weight"], a["embed.tok.weight"])


def test_gpt_statistics_follow_gpt2_init():
    cfg, _ = compose("recipe=gpt/tiny")
    m = build_model(cfg)
    std = cfg.model.init_std
    assert abs(m.layers["0"].mlp.fc1.weight.std().item() - std) < 0.1 * std
    wo = m.layers["0"].attn.wo.weight.std().item()
    assert abs(wo - std / (2 * cfg.model.num_layers) ** 0.5) < 0.1 * wo
    assert torch.equal(m.layers["0"].ln1.weight, torch.ones_like(m.layers["0"].ln1.weight))
    assert m.layers["0"].mlp.fc1.bias.abs().max() == 0


def test_a_pipeline_chunk_initialised_alone_equals_the_whole_model():
    from fleetwise.models.pipeline import pipeline_chunk

    cfg, _ = compose("recipe=resnet/tiny")
    whole = build_model(cfg).state_dict()
    meta = build_meta_model(cfg)
    chunk = pipeline_chunk(meta, [2, 3], first=False, last=True)
    chunk.to_empty(device="cpu")
    init_weights_(chunk, cfg.train.seed)
    got = chunk.state_dict()
    assert set(got) < set(whole) and "layers.2.conv1.weight" in got and "stem.0.weight" not in got
    assert all(torch.equal(got[k], whole[k]) for k in got)


def test_ctr_initial_values_equal_its_own_reset():
    from fleetwise.families.ctr.model import CTRNet

    cfg, _ = compose("recipe=ctr/tiny")
    eager = CTRNet(cfg.model, seed=5).state_dict()
    with torch.device("meta"):
        meta = CTRNet(cfg.model, seed=5)
    meta.to_empty(device="cpu")
    init_weights_(meta, 5)
    got = meta.state_dict()
    assert set(got) == set(eager) and all(torch.equal(got[k], eager[k]) for k in eager)


def test_wrapper_segments_are_stripped():
    assert model_name("layers.0._checkpoint_wrapped_module.attn.wq.weight") == "layers.0.attn.wq.weight"
    assert model_name("module.layers.0.ln1.weight") == "layers.0.ln1.weight"
