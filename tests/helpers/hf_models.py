"""Tiny Hugging Face causal LMs written to a directory by `transformers` itself (random weights, no
download): the independent reference for fleetwise's Llama import and export."""

from __future__ import annotations

from pathlib import Path

# Llama 3.1's RoPE scaling with a short original context, so that 32 positions at head width 8
# span its three frequency bands
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# byte tokens (data=bundled) and llama/tiny's width; 4 layers for two pipeline stages
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
}


def write_hf_model(directory: Path, arch: str = "Llama", *, shard: str | None = "40KB", seed: int = 0, **config):
    """A random `<arch>ForCausalLM` (Llama, Qwen3, Mixtral, Qwen3Moe) saved to `directory` (sharded with an index
    when `shard` is a size); every weight drawn at random, the norms' included (a swapped norm
    would go unseen at ones). Returns the transformers model, in eval mode."""
    import torch
    import transformers

    cfg_cls = getattr(transformers, f"{arch}Config")
    model_cls = getattr(transformers, f"{arch}ForCausalLM")
    kwargs = {**TINY, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE, **config}
    if arch != "Llama":  # (Qwen 3's and Qwen 3 MoE's models use none)
        kwargs.pop("rope_scaling")
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return model.eval()
