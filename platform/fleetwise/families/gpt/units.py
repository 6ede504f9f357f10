"""GPT as a chain of planner units: the embedding (tokens and learned positions), the pre-LN
blocks GPT and ERNIE share (`fleetwise.families.transformer.transformer_block`), and the head (final
norm, untied LM head, the loss). A MoE block (model.moe) is the block with its MLP replaced by the
mixture of experts, counted by the term Llama's MoE blocks use (`fleetwise.families.moe.moe_block`).
"""

from __future__ import annotations

from dataclasses import replace

from fleetwise.families.gpt.schema import GPTModel
from fleetwise.families.moe import is_moe_layer, moe_block
from fleetwise.families.transformer import transformer_block
from fleetwise.plan.units import Acts, Unit


def _as_swiglu(dense: Unit, s: int, h: int, f: int) -> Unit:
    """GPT's block with its GELU MLP (fc1 [f, h] + bias, GELU, fc2 [h, f] + bias) counted as a
    SwiGLU MLP of width f instead -- the MLP `moe_block` takes out of a block before it puts the
    experts in, so that what remains is GPT's attention, norms and residuals exactly:
    parameters 3hf instead of 2hf + f + h; saved tensors (gate, silu, up, product: 4sf instead of
    fc1's output and GELU's, 2sf; 2sf instead of sf kept by selective recompute; 2sf instead of sf
    matmul outputs for the weight gradients); 2 elementwise tensors of sf instead of GELU's one;
    aten ops 3·4 + 2 instead of 2·4 + 1 (fc1, fc2: t, addmm, 2 views; GELU); 3 GEMMs and 3 tensors
    instead of 2 GEMMs and 4 tensors."""
    none, sel = dense.saved("none"), dense.saved("selective")
    return replace(
        dense,
        params_split=dense.params_split - (2 * h * f + f) + 3 * h * f,
        params_whole=dense.params_whole - h,
        fwd_flops=dense.fwd_flops + 2 * s * h * f,
        acts={
            **dense.acts,
            "none": replace(none, split=none.split + 2 * s * f),
            "selective": replace(sel, split=sel.split + s * f),
        },
        weight_grad_outputs=replace(dense.weight_grad_outputs, split=dense.weight_grad_outputs.split + s * f),
        fwd_elementwise=dense.fwd_elementwise + s * f,
        fwd_ops=dense.fwd_ops - 9 + 14,
        fwd_gemms=dense.fwd_gemms + 1,
        param_tensors=dense.param_tensors - 1,
    )


def units(m: GPTModel) -> list[Unit]:
    s, h, v = m.seq_len, m.hidden_size, m.padded_vocab_size
    emb = Unit(
        "embedding",
        "embedding",
        params_split=v * h,
        params_whole=s * h,
        mp_allreduces=1,
        boundary_elements=s * h,
        fwd_ops=4,  # arange, 2 lookups, add
        fwd_elementwise=2 * s * h,  # token lookups, the sum with the positions (looked up once per batch)
        param_tensors=2,
        largest_split=v * h,
        largest_whole=s * h,
    )
    head = Unit(
        "head",
        "head",
        params_split=h * v,  # LM head, column-parallel over the vocabulary (untied)
        params_whole=2 * h,  # final layer norm
        fwd_flops=2 * s * h * v,
        # final LN input; LN output (saved by the LM head); log-softmax output (vocab-parallel)
        acts={"none": Acts(fp32=s * v, sp=s * h, whole=s * h + 2 * s)},
        # the gradients of the log-softmax output and of the logits (fp32: the loss upcasts)
        transient=Acts(fp32=2 * s * v),
        transient_tp=Acts(fp32=s * v),
        output_split=s * v,  # the logits
        weight_grad_outputs=Acts(split=s * v, sp=s * h),  # the logits' and the final norm output's
        fwd_ops=10,  # LN, LM head (t, mm, views), log-softmax, NLL
        fwd_gemms=1,
        fwd_elementwise=s * h + 2 * s + s * v,  # LN, log-softmax
        param_tensors=3,  # LN weight and bias, LM head
        largest_split=h * v,
        largest_whole=h,
    )
    # a Unit each (the planner tells the blocks apart by identity: one object per block, as before)
    blocks = [transformer_block(m) for _ in range(m.num_layers)]
    if m.moe.enabled:
        swiglu = _as_swiglu(blocks[0], s, h, m.ffn_hidden_size)
        blocks = [
            moe_block(swiglu, m.moe, s, h, m.ffn_hidden_size, h * h) if is_moe_layer(m.moe, i) else b
            for i, b in enumerate(blocks)
        ]
    return [emb, *blocks, head]


def input_bytes(m: GPTModel) -> int:
    return 2 * 8 * m.seq_len  # int64 token ids and labels
