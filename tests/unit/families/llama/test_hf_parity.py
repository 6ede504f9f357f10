"""fleetwise's Llama computes the logits Hugging Face `transformers` computes (the independent
reference): a tiny random `LlamaForCausalLM` / `Qwen3ForCausalLM` is built from a config in the test
(no download), its weights are copied into fleetwise's model by a name table written here, and the
fp32 logits agree to 1e-5 -- tied and untied, grouped-query and multi-head attention, Llama 3.1's
RoPE frequency scaling, Qwen 3's q/k norms.

Every weight, the norms' included, is drawn at random first: with the norms at their initial ones a
swapped or missing norm would go unseen.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 128, 48

# Hugging Face name -> fleetwise name, {i}: the block index
NAMES = {
    "model.embed_tokens.weight": "embed.tok.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.ln1.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.ln2.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.wq.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.wk.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.wv.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.wo.weight",
    "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attn.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attn.k_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down.weight",
}

# scaling with a short original context, so that the test's 48 positions span all three bands of
# Llama 3.1's scaling (wavelengths kept, interpolated, divided by the factor) at head width 16
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    # name: (HF class, HF config kwargs, fleetwise model overrides)
    "llama_gqa_untied_llama3_rope": (
        "Llama",
        {
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rope_scaling": LLAMA3_ROPE,
        },
        {
            "num_kv_heads": 2,
            "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rope_scaling": LLAMA3_ROPE,
        },
    ),
    "llama_mha_tied": (
        "Llama",
        {"num_key_value_heads": 4, "tie_word_embeddings": True, "rope_theta": 10000.0},
        {"num_kv_heads": 4, "tie_word_embeddings": True, "rope_theta": 10000.0},
    ),
    "llama_gqa_tied_llama3_rope": (
        "Llama",
        {
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            "rope_scaling": LLAMA3_ROPE,
        },
        {"num_kv_heads": 1, "tie_word_embeddings": True, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE},
    ),
    # Qwen 3: q/k norms, an explicit head width (32, not 64 / 4), eps 1e-6, θ 1e6
    "qwen3_gqa_qk_norm_head_dim": (
        "Qwen3",
        {"num_key_value_heads": 2, "tie_word_embeddings": False, "rope_theta": 1e6, "head_dim": 32},
        {"num_kv_heads": 2, "tie_word_embeddings": False, "rope_theta": 1e6, "head_dim": 32, "qk_norm": True},
    ),
    "qwen3_mha_qk_norm_tied": (
        "Qwen3",
        {"num_key_value_heads": 4, "tie_word_embeddings": True, "rope_theta": 1e6, "head_dim": 16},
        {"num_kv_heads": 4, "tie_word_embeddings": True, "rope_theta": 1e6, "qk_norm": True},
    ),
}


def hf_model(kind: str, kwargs: dict, eps: float):
    cls_config = getattr(transformers, f"{kind}Config")
    cls_model = getattr(transformers, f"{kind}ForCausalLM")
    kwargs = dict(kwargs)
    theta, scaling = kwargs.pop("rope_theta"), kwargs.pop("rope_scaling", None)
    rope = (
        {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    )
    config = cls_config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=eps,
        rope_parameters=rope,
        attn_implementation="eager",
        **kwargs,
    )
    torch.manual_seed(0)
    model = cls_model(config).float().eval()
    with torch.no_grad():  # every weight random, norms around one (not exactly one)
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def fleetwise_model(overrides: dict, eps: float):
    from fleetwise.families.llama.model import Llama
    from fleetwise.families.llama.schema import LlamaModel

    cfg = LlamaModel(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        seq_len=SEQ,
        intermediate_size=96,
        rms_norm_eps=eps,
        **overrides,
    )
    return Llama(cfg).float().eval()


def copy_weights(hf, ours) -> None:
    """Copy by the name table; every fleetwise parameter gets exactly one Hugging Face tensor."""
    src = hf.state_dict()
    dst = dict(ours.named_parameters())
    filled = set()
    for i in range(2):
        for hf_name, our_name in NAMES.items():
            hf_key, our_key = hf_name.format(i=i), our_name.format(i=i)
            if hf_key in src and our_key in dst:
                assert dst[our_key].shape == src[hf_key].shape, (our_key, hf_key)
                with torch.no_grad():
                    dst[our_key].copy_(src[hf_key])
                filled.add(our_key)
    assert filled == set(dst), set(dst) ^ filled


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(case):
    kind, hf_kwargs, ours_kwargs = CASES[case]
    eps = 1e-6 if kind == "Qwen3" else 1e-5
    hf = hf_model(kind, hf_kwargs, eps)
    ours = fleetwise_model(ours_kwargs, eps)
    copy_weights(hf, ours)
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=tokens).logits
        got = ours(tokens)
    assert got.shape == want.shape == (3, SEQ, VOCAB)
    diff = (got - want).abs().max().item()
    print(f"{case}: max |logit diff| {diff:.2e} (logits up to {want.abs().max().item():.1f})")
    assert diff <= 1e-5, diff
    if hf_kwargs["tie_word_embeddings"]:  # one weight: the head reads the embedding's
        assert "output.weight" not in dict(ours.named_parameters())
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def test_llama3_scaling_changes_the_logits():
    """The scaling case is not vacuous: without the scaling fleetwise's logits differ from
    Hugging Face's scaled model by far more than the tolerance."""
    kind, hf_kwargs, ours_kwargs = CASES["llama_gqa_untied_llama3_rope"]
    hf = hf_model(kind, hf_kwargs, 1e-5)
    ours = fleetwise_model({**ours_kwargs, "rope_scaling": None}, 1e-5)
    copy_weights(hf, ours)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(tokens) - hf(input_ids=tokens).logits).abs().max().item() > 1e-2
