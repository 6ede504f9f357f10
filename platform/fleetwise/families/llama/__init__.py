"""Llama: a decoder-only causal LM of Llama 3's shape (RMSNorm, rotary positions with Llama 3.1's
frequency scaling, SwiGLU, grouped-query attention, no biases), optionally with tied embeddings
(Llama 3.2 1B/3B) and Qwen 3's q/k norms.

The family in one package: `schema` (the `model` section and its rules), `units` (the planner's
view), `model` (the nn.Module), `tp_plan` (its tensor-parallel plan); the data is the token source
the transformer families share (`fleetwise.families.transformer.token_source`). The rank-side parts
are imported when a rank asks for them (`spec`, `source`), so importing this package never imports
torch.

Hugging Face checkpoints in and out: `hf` (config.json <-> this section, the safetensors headers;
torch-free) and `weights` (each rank reads its slices; export streams tensor by tensor). Its
parameter names follow GPT's (`embed.tok`, `layers.N.attn.wq`, …); `hf.expected_tensors` maps
Hugging Face's `LlamaForCausalLM` / `Qwen3ForCausalLM` names onto them (and `MixtralForCausalLM` /
`Qwen3MoeForCausalLM`'s, each expert's tensor a slice of the stacked experts: `hf_moe`), and nothing else is needed: the
rotary embedding uses Hugging Face's rotate-half layout (no q/k permutation), the vocabulary is not
padded, and a tied model has no `output.weight` (its head reads `embed.tok.weight`), as a tied
checkpoint has no `lm_head.weight`.
"""

from __future__ import annotations

from functools import partial

from fleetwise.families.llama.hf import prefill
from fleetwise.families.llama.schema import LlamaModel, check, check_tensor_parallel, limits, no_pipeline
from fleetwise.families.llama.units import input_bytes, units
from fleetwise.families.moe import moe_notes, tp_plan_of
from fleetwise.families.record import Family, ModelSpec
from fleetwise.families.transformer import (
    TOKEN_SOURCES,
    causal_lm_source,
    token_chance_loss,
    token_data_profile,
    tokens_per_sample,
)


def spec(m: LlamaModel) -> ModelSpec:
    from fleetwise.families.llama.model import Llama
    from fleetwise.families.llama.tp_plan import llama_plan
    from fleetwise.models.transformer import lm_loss

    load = None
    if m.init_from is not None:
        from fleetwise.families.llama.weights import load_hf_

        load = partial(load_hf_, m=m)
    return ModelSpec(
        Llama,
        lm_loss,
        ("tokens",),
        # (a MoE block's experts are not split over mp ranks: families/moe.py tp_plan_of)
        tp_plan_of(partial(llama_plan, qk_norm=m.qk_norm, tied=m.tie_word_embeddings), m.moe, m.num_layers),
        load_weights=load,
        # packed documents (data=jsonl): data/jsonl.py; documents: context parallel's document ids
        optional_inputs=("positions", "documents"),
    )


def plan_notes(m: LlamaModel) -> list[str]:
    a, g = m.num_attention_heads, m.num_kv_heads
    attention = (
        f"grouped-query attention: {a} query heads share {g} kv heads" if g != a else "multi-head attention"
    )
    tied = ", LM head tied to the embedding" if m.tie_word_embeddings else ""
    return [
        f"{attention}; SwiGLU width {m.ffn_hidden_size}{tied}",
        *moe_notes(m.moe, m.num_layers, m.ffn_hidden_size),
    ]


FAMILY = Family(
    name="llama",
    schema=LlamaModel,
    units=units,
    input_bytes=input_bytes,
    spec=spec,
    source=causal_lm_source,
    check=check,
    prefill=prefill,
    limits=limits,
    tokens_per_sample=tokens_per_sample,
    plan_notes=plan_notes,
    data_sources=(*TOKEN_SOURCES, "jsonl"),  # jsonl: fine-tuning documents (data/jsonl.py)
    data_profile=token_data_profile,
    tensor_parallel=check_tensor_parallel,
    no_pipeline=no_pipeline,
    chance_loss=token_chance_loss,
    exports_hf=True,
)
