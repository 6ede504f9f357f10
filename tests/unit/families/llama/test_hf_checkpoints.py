"""Hugging Face model directories in and out, in one process: `model.init_from=DIR` fills the model
section from config.json (a disagreeing explicit value is a problem naming both), bad directories
are refused at validation naming file and tensor (exit 2, nothing started), `fleetwise.load_model`
of an HF directory computes transformers' logits, and `checkpoint export --format hf` of an untrained
import gives the input tensors back bit for bit, loadable by transformers with equal logits. The
reference models are built by transformers in the test (no download)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.hf_models import write_hf_model

from fleetwise.config.problems import ConfigError

transformers = pytest.importorskip("transformers")


def logits_of(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "llama"
    return d, write_hf_model(d)  # sharded, with an index; GQA, Llama 3.1 RoPE scaling


def test_init_from_fills_the_model_section(llama_dir):
    from fleetwise.config.validate import load_config

    directory, _ = llama_dir
    cfg = load_config(["recipe=llama/tiny", f"model.init_from={directory}"])
    m = cfg.model
    hf = json.loads((directory / "config.json").read_text())
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads) == (4, 64, 8, 4)
    assert (m.ffn_hidden_size, m.vocab_size, m.rms_norm_eps) == (96, 256, hf["rms_norm_eps"])
    assert m.rope_theta == 500000.0 and m.rope_scaling.original_max_position_embeddings == 16
    assert (m.tie_word_embeddings, m.qk_norm, m.init_from) == (False, False, str(directory.resolve()))


def test_explicit_values_that_disagree_are_problems_naming_both(llama_dir):
    from fleetwise.config.validate import load_config

    directory, _ = llama_dir
    with pytest.raises(ConfigError) as err:
        load_config(
            [
                "recipe=llama/tiny",
                f"model.init_from={directory}",
                "model.num_layers=3",
                "model.rms_norm_eps=0.1",
            ]
        )
    problems = {p.loc: p for p in err.value.problems}
    assert set(problems) == {"model.num_layers", "model.rms_norm_eps"}  # no tensor-by-tensor echo
    assert "model.num_layers=3" in problems["model.num_layers"].msg
    assert "num_hidden_layers=4" in problems["model.num_layers"].msg
    assert "config.json" in problems["model.num_layers"].msg
    assert "model.num_layers=4" in problems["model.num_layers"].hint


@pytest.mark.parametrize(
    ("arch", "config"),
    [
        ("Llama", {}),  # GQA, untied, Llama 3.1 RoPE
        ("Llama", {"num_key_value_heads": 8, "tie_word_embeddings": True}),  # MHA, tied
        ("Qwen3", {"head_dim": 16, "tie_word_embeddings": True}),  # q/k norms, head width set apart
    ],
)
def test_load_model_of_an_hf_directory_computes_transformers_logits(tmp_path, arch, config):
    import fleetwise

    reference = write_hf_model(tmp_path / "hf", arch, shard=None, **config)  # one file, no index
    model = fleetwise.load_model(tmp_path / "hf")
    assert not model.training
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    diff = (logits_of(model, tokens) - logits_of(reference, tokens)).abs().max().item()
    assert diff <= 1e-5, diff


def test_bad_directories_are_refused_naming_file_and_tensor(tmp_path, llama_dir, capsys):
    from safetensors.torch import load_file, save_file

    from fleetwise.cli import main

    directory, _ = llama_dir

    def problems_of(d):
        code = main(["validate", "recipe=llama/tiny", f"model.init_from={d}", "--json"])
        out = json.loads(capsys.readouterr().out)
        assert code == 2 and not out["valid"]
        return out["errors"]

    (tmp_path / "empty").mkdir()
    [e] = problems_of(tmp_path / "empty")
    assert e["loc"] == "model.init_from" and "has no config.json" in e["msg"] and e["hint"]

    other = tmp_path / "mistral"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    [e] = problems_of(other)
    assert "MistralForCausalLM" in e["msg"] and str(other / "config.json") in e["msg"]
    assert "LlamaForCausalLM" in e["hint"]

    # one file, a tensor left out and another of the wrong shape
    single = write_hf_model(tmp_path / "single", shard=None)
    assert single is not None
    weights = load_file(tmp_path / "single" / "model.safetensors")
    del weights["model.layers.2.mlp.up_proj.weight"]
    weights["model.norm.weight"] = torch.ones(63)
    save_file(weights, tmp_path / "single" / "model.safetensors", metadata={"format": "pt"})
    errors = problems_of(tmp_path / "single")
    assert [e["loc"] for e in errors] == ["model.init_from"] * 2
    assert "model.layers.2.mlp.up_proj.weight" in errors[0]["msg"]
    assert (
        "model.safetensors: tensor model.norm.weight has shape [63], the model needs [64]" in errors[1]["msg"]
    )

    # a quantised tensor: the weights are read as floats only
    write_hf_model(tmp_path / "quant", shard=None)
    weights = load_file(tmp_path / "quant" / "model.safetensors")
    weights["model.layers.1.self_attn.q_proj.weight"] = weights["model.layers.1.self_attn.q_proj.weight"].to(
        torch.int8
    )
    save_file(weights, tmp_path / "quant" / "model.safetensors", metadata={"format": "pt"})
    [e] = problems_of(tmp_path / "quant")
    assert "tensor model.layers.1.self_attn.q_proj.weight is I8" in e["msg"] and "unquantised" in e["hint"]

    # an index naming a shard that is not there
    broken = tmp_path / "broken"
    write_hf_model(broken)
    next(broken.glob("model-00002-of-*.safetensors")).unlink()
    [e] = problems_of(broken)
    assert "model.safetensors.index.json" in e["msg"] and "model-00002-of-" in e["msg"]
    assert directory.is_dir()

    # a file named .safetensors that is not one (a truncated download)
    (tmp_path / "single" / "model.safetensors").write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a')
    [e] = problems_of(tmp_path / "single")
    assert "model.safetensors is not a safetensors file" in e["msg"] and "replace" in e["hint"]


def test_export_of_an_untrained_import_is_the_input_bit_for_bit(tmp_path, llama_dir):
    """A checkpoint of the imported model (written by DCP as the ranks write theirs) exported back:
    the same tensors, bit for bit; transformers loads the directory and computes the same logits."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    from fleetwise.cli import main
    from fleetwise.config.validate import load_config
    from fleetwise.rundir import write_config
    from fleetwise.runtime.modeling import build_model

    directory, reference = llama_dir
    cfg = load_config(["recipe=llama/tiny", f"model.init_from={directory}"])
    model = build_model(cfg)  # the weights of init_from, read through the ranks' reader
    ckpt = tmp_path / "step_00000000"
    dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=str(ckpt), no_dist=True)
    write_config(ckpt, cfg)
    (ckpt / "fleetwise.json").write_text("{}")
    out = tmp_path / "export"
    assert main(["checkpoint", "export", str(ckpt), "--format", "hf", "--out", str(out)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    source = json.loads((directory / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source["weight_map"])
    for name, file in source["weight_map"].items():
        with safe_open(directory / file, "pt") as a, safe_open(out / index["weight_map"][name], "pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    assert torch.equal(logits_of(exported, tokens), logits_of(reference, tokens))
    # no checkpoint there, or one of another family: refused, exit 2, nothing written
    assert main(["checkpoint", "export", str(tmp_path / "nowhere"), "--format", "hf", "--out", str(out)]) == 2
    gpt = load_config(["recipe=gpt/tiny", "model.num_layers=1"])
    gpt_ckpt = tmp_path / "gpt" / "step_00000000"
    state = {f"model.{k}": v for k, v in build_model(gpt).state_dict().items()}
    dcp.save(state, checkpoint_id=str(gpt_ckpt), no_dist=True)
    write_config(gpt_ckpt, gpt)
    (gpt_ckpt / "fleetwise.json").write_text("{}")
    nothing = tmp_path / "not_written"
    assert main(["checkpoint", "export", str(gpt_ckpt), "--format", "hf", "--out", str(nothing)]) == 2
    assert not nothing.exists()
