"""Hugging Face mixtures of experts in and out, in one process: tiny random `MixtralForCausalLM` and
`Qwen3MoeForCausalLM` directories written by transformers itself (the independent reference; per-expert
tensors as on the Hub) -- `model.init_from` fills `model.moe` from config.json, fleetwise's model of
the directory computes transformers' logits (routing included), `checkpoint export --format hf`
writes the input tensors back bit for bit and transformers loads them with equal logits, and what
fleetwise's layer cannot represent is refused at validation, every problem with its fix."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.config import compose
from helpers.hf_models import write_hf_model

transformers = pytest.importorskip("transformers")

MIXTRAL = ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02})
# the first block dense, then every other one MoE: blocks 1 and 3 (first_dense_layers 1, interval 2)
QWEN3_MOE = (
    "Qwen3Moe",
    {
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "head_dim": 16,
        "decoder_sparse_step": 2,
        "norm_topk_prob": True,
    },
)
TOL = 1e-5  # test_hf_parity's


def logits_of(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture(scope="module", params=[MIXTRAL, QWEN3_MOE], ids=["mixtral", "qwen3_moe"])
def moe_dir(request, tmp_path_factory):
    arch, config = request.param
    d = tmp_path_factory.mktemp("hf") / arch.lower()
    return arch, d, write_hf_model(d, arch, **config)  # sharded, with an index


TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))


def test_init_from_fills_model_moe_and_the_ranks_read_transformers_logits(moe_dir):
    from fleetwise.runtime.modeling import build_model

    arch, directory, reference = moe_dir
    cfg, problems = compose("recipe=llama/tiny", f"model.init_from={directory}")
    assert problems == []
    m = cfg.model
    if arch == "Mixtral":
        assert (m.moe.num_experts, m.moe.top_k, m.moe.expert_ffn_size, m.ffn_hidden_size) == (4, 2, None, 96)
        assert (m.moe.first_dense_layers, m.moe.interval, m.moe.normalize_weights) == (0, 1, True)
        assert (m.moe.aux_loss_coef, m.qk_norm) == (0.02, False)
    else:
        assert (m.moe.num_experts, m.moe.top_k, m.moe.expert_ffn_size, m.ffn_hidden_size) == (8, 3, 32, 96)
        assert (m.moe.first_dense_layers, m.moe.interval, m.moe.normalize_weights) == (1, 2, True)
        assert (m.moe.aux_loss_coef, m.qk_norm) == (0.001, True)  # (transformers' default coefficient)
    assert m.moe.num_shared_experts == 0 and m.moe.score_func == "softmax"
    model = build_model(cfg).eval()  # the weights of init_from, read through the ranks' reader
    diff = (logits_of(model, TOKENS) - logits_of(reference, TOKENS)).abs().max().item()
    print(f"{arch}: max |logit diff| vs transformers {diff:.2e}")
    assert diff <= TOL, diff


def test_load_model_computes_transformers_logits_and_routing_matters(tmp_path, moe_dir):
    """fleetwise.load_model of the directory (one file, no index) equals transformers; with two
    experts of one block swapped it does not (the routing is what makes them agree)."""
    import fleetwise

    arch, config = {"Mixtral": MIXTRAL, "Qwen3Moe": QWEN3_MOE}[moe_dir[0]]
    reference = write_hf_model(tmp_path / "hf", arch, shard=None, seed=3, **config)
    model = fleetwise.load_model(tmp_path / "hf")
    want = logits_of(reference, TOKENS)
    assert (logits_of(model, TOKENS) - want).abs().max().item() <= TOL
    experts = model.layers["1"].mlp.experts
    with torch.no_grad():
        experts.w1[[0, 1]] = experts.w1[[1, 0]].clone()
    assert (logits_of(model, TOKENS) - want).abs().max().item() > 1e-2


def _checkpoint(cfg, model, path):
    import torch.distributed.checkpoint as dcp

    from fleetwise.rundir import write_config

    dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=str(path), no_dist=True)
    write_config(path, cfg)
    (path / "fleetwise.json").write_text("{}")


def test_export_of_an_untrained_import_is_the_input_bit_for_bit(tmp_path, moe_dir):
    from safetensors import safe_open

    from fleetwise.cli import main
    from fleetwise.config.validate import load_config
    from fleetwise.runtime.modeling import build_model

    arch, directory, reference = moe_dir
    cfg = load_config(["recipe=llama/tiny", f"model.init_from={directory}"])
    ckpt = tmp_path / "step_00000000"
    _checkpoint(cfg, build_model(cfg), ckpt)
    out = tmp_path / "export"
    assert main(["checkpoint", "export", str(ckpt), "--format", "hf", "--out", str(out)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    source = json.loads((directory / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source["weight_map"])  # per-expert names, as on the Hub
    for name, file in source["weight_map"].items():
        with safe_open(directory / file, "pt") as a, safe_open(out / index["weight_map"][name], "pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == {"Mixtral": "mixtral", "Qwen3Moe": "qwen3_moe"}[arch]
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == f"{arch}ForCausalLM"
    assert torch.equal(logits_of(exported, TOKENS), logits_of(reference, TOKENS))


def test_export_of_a_trained_from_scratch_mixture(tmp_path):
    """A model fleetwise built from scratch (no init_from) is written as Qwen3-MoE (q/k norms, a dense
    first block) and transformers computes fleetwise's logits; llama/moe_tiny's shared expert is
    refused, saying why and what to do."""
    from fleetwise.cli import main
    from fleetwise.runtime.modeling import build_model

    overrides = ("model.qk_norm=true", "model.moe.num_shared_experts=0", "model.moe.interval=2")
    cfg, problems = compose("recipe=llama/moe_tiny", *overrides)
    assert problems == []
    model = build_model(cfg).eval()
    _checkpoint(cfg, model, tmp_path / "ckpt")
    out = tmp_path / "export"
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), "--format", "hf", "--out", str(out)]) == 0
    written = json.loads((out / "config.json").read_text())
    assert (written["mlp_only_layers"], written["num_experts"], written["moe_intermediate_size"]) == (
        [0, 2],
        4,
        64,
    )
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    diff = (logits_of(exported, TOKENS) - logits_of(model, TOKENS)).abs().max().item()
    assert diff <= TOL, diff

    shared, _ = compose("recipe=llama/moe_tiny")
    _checkpoint(shared, build_model(shared), tmp_path / "shared")
    nothing = tmp_path / "not_written"
    assert (
        main(["checkpoint", "export", str(tmp_path / "shared"), "--format", "hf", "--out", str(nothing)]) == 2
    )
    assert not nothing.exists()


def test_what_fleetwise_cannot_represent_is_refused_with_its_fix(tmp_path, capsys):
    """Every problem at once, exit 2: config.json keys fleetwise's layer does not do, and explicit
    model.moe values that disagree with config.json."""
    from fleetwise.cli import main

    arch, config = QWEN3_MOE
    bad = tmp_path / "bad"
    # blocks 0, 2, 3 MoE: not "k dense, then every n-th"; a sliding window
    write_hf_model(bad, arch, shard=None, **{**config, "decoder_sparse_step": 1, "mlp_only_layers": [1]})
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(
        json.dumps({**cfg, "use_sliding_window": True, "router_jitter_noise": 0.1})
    )
    code = main(["validate", "recipe=llama/tiny", f"model.init_from={bad}", "--json"])
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert code == 2 and [e["loc"] for e in errors] == ["model.init_from"] * 3, errors
    msgs = " | ".join(e["msg"] for e in errors)
    assert "router_jitter_noise=0.1" in msgs and "use_sliding_window=True" in msgs
    assert "blocks [0, 2, 3]" in msgs
    assert all(e["hint"] for e in errors)

    good = tmp_path / "good"
    write_hf_model(good, arch, shard=None, **config)
    code = main(
        [
            "validate",
            "recipe=llama/moe_tiny",  # 4 experts of width 64 and a shared one, one dense block
            f"model.init_from={good}",
            "model.moe.load_balance=bias",  # a training choice: accepted
            "--json",
        ]
    )
    errors = {e["loc"]: e for e in json.loads(capsys.readouterr().out)["errors"]}
    assert code == 2
    assert set(errors) == {
        "model.moe.num_experts",
        "model.moe.num_shared_experts",
        "model.moe.expert_ffn_size",
    }
    assert "model.moe.expert_ffn_size=64" in errors["model.moe.expert_ffn_size"]["msg"]
    assert "moe_intermediate_size" in errors["model.moe.expert_ffn_size"]["msg"]
    assert "model.moe.expert_ffn_size=32" in errors["model.moe.expert_ffn_size"]["hint"]

    dense = tmp_path / "dense"
    write_hf_model(dense, "Llama", shard=None)
    _, problems = compose(
        "recipe=llama/moe_tiny", f"model.init_from={dense}", "model.moe.num_shared_experts=0"
    )
    assert [p.loc for p in problems] == ["model.moe.num_experts"]
    assert "model.moe.num_experts=0" in problems[0].hint
