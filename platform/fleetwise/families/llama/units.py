"""Llama as a chain of planner units: the token embedding, the pre-norm blocks and the head (final
RMSNorm, LM head, loss), counted from families/llama/model.py as torch runs it.

What autograd saves (fp32 elements per sample; s tokens, h width, a query and g kv heads of width d,
f the SwiGLU width):
- an RMSNorm saves its input (pow and the normalising mul) and the per-token rsqrt, both fp32 (it
  normalises an fp32 copy, whatever the precision), and the normalised input in the input's dtype
  (read by the weight's mul); its output is saved by the matmuls that read it;
- attention: SDPA saves q, k and v after RoPE (k and v at the kv heads' width: enable_gqa copies
  nothing), its output and log-sum-exp; RoPE's muls save only the cos/sin tables, which are per
  batch, not per sample (2·s·d a block and micro-batch, left out); with q/k norms, each norm saves
  its input, rsqrt and normalised input per head;
- SwiGLU: gate's output (silu's input), silu's output and up's output (their product's operands),
  and the product (down's input).
"""

from __future__ import annotations

from dataclasses import replace

from fleetwise.families.llama.schema import LlamaModel
from fleetwise.families.moe import is_moe_layer, moe_block
from fleetwise.plan.units import Acts, Unit


def block(m: LlamaModel) -> Unit:
    s, h, f, d = m.seq_len, m.hidden_size, m.ffn_hidden_size, m.head_width
    a, g = m.num_attention_heads, m.num_kv_heads
    q, kv = a * d, g * d  # widths of the query and of the key/value projections
    # q, k, v, gate and up are column-parallel, o and down row-parallel; the norms are replicated
    split = 2 * h * q + 2 * h * kv + 3 * h * f
    whole = 2 * h + (2 * d if m.qk_norm else 0)
    # the q/k norms' normalised inputs (split), their inputs' fp32 copies and rsqrt (fp32)
    qk_norm, qk_norm32 = (s * (q + kv), s * (q + kv) + s * (a + g)) if m.qk_norm else (0, 0)
    none = Acts(
        # q, k, v after RoPE, SDPA's output and log-sum-exp; the q/k norms'; SwiGLU's four
        split=2 * s * q + 2 * s * kv + a * s + qk_norm + 4 * s * f,
        fp32=qk_norm32,
        # each norm's normalised input (read by the weight's mul; sequence parallel shards them) ...
        sp=2 * s * h,
        # ... and its input and rsqrt, fp32 whatever the precision: RMSNorm normalises an fp32 copy
        # (a 2-byte count missed 64 MiB a layer of Mixtral at 4,096 tokens, ZeRO-3 bf16: -3%)
        sp32=2 * (s * h + s),
        # the norms' outputs, saved by the column-parallel matmuls that read them (gathered in full
        # under sequence parallelism)
        whole=2 * s * h,
    )
    selective = Acts(
        # the matmuls' and SDPA's outputs: q, k, v before their norms and RoPE (recomputed), SDPA's
        # output and log-sum-exp, gate and up
        split=2 * s * q + 2 * s * kv + a * s + 2 * s * f,
        sp=s * h,  # block input
        reduced=2 * s * h,  # o's and down's outputs, reduced when tensor-parallel
    )
    full = Acts(sp=s * h)  # only the block input
    attn = 2 * 2 * s * s * q  # QK^T and scores·V, counted as full (non-causal) matmuls
    return Unit(
        name="block",
        kind="block",
        params_split=split,
        params_whole=whole,
        fwd_flops=2 * s * split + attn,
        attn_flops=attn,
        recompute_skipped_flops=2 * s * f * h,  # down's output is saved by nothing
        # under TP selective recompute re-runs o (the second norm needs the residual after it)
        selective_tp_recompute_flops=2 * s * q * h,
        acts={"none": none, "selective": selective, "full": full},
        # down's backward: its input's gradient, then the product's two operand gradients, with the
        # product itself freed
        backward_transient=Acts(split=2 * s * f),
        # the outputs of q, k, v (and their norms), gate and up (column-parallel); o's and down's
        # partial sums; the two norms' outputs
        weight_grad_outputs=Acts(
            split=s * (q + 2 * kv) + (s * (q + kv) if m.qk_norm else 0) + 2 * s * f,
            partial=2 * s * h,
            sp=2 * s * h,
        ),
        mp_allreduces=2,
        boundary_elements=s * h,
        fwd_ops=_block_ops(m),
        fwd_gemms=8,  # 7 linears, SDPA
        param_tensors=9 + (2 if m.qk_norm else 0),  # 7 linears, 2 norms (+ q, k norms)
        largest_split=max(h * f, h * q),
        largest_whole=h,
        fwd_elementwise=_block_elementwise(m),
    )


def _block_ops(m: LlamaModel) -> int:
    """aten ops of one block's forward, views included (a test counts them in torch)."""
    norm = 7  # pow, mean, add, rsqrt (and its detach), 2 muls (fp32: no casts)
    linear = 4  # t, view, mm, view back
    rope_tables = 7  # the frequencies' tensor, arange, unsqueeze, mul, cat, cos, sin
    rotate = 8  # transpose, mul, 2 slices, neg, cat, mul, add
    attention = 3 * (linear + 1) + rope_tables + 2 * rotate + 1 + 2 + 2 + linear  # + v's transpose,
    # SDPA (and its detach), the output's transpose and view, o
    mlp = 3 * linear + 2  # gate, up, down, silu, mul
    return 2 * norm + attention + mlp + 2 + (2 * norm if m.qk_norm else 0)  # + 2 residual adds


def _block_elementwise(m: LlamaModel) -> float:
    """Elements per sample the block's non-matmul ops write (the rotary tables are per batch)."""
    s, h, f, d = m.seq_len, m.hidden_size, m.ffn_hidden_size, m.head_width
    a, g = m.num_attention_heads, m.num_kv_heads
    norm = 3 * s * h + 3 * s  # pow, 2 muls; mean, add, rsqrt per token
    rotate = 4.5 * s * (a + g) * d  # 2 muls, cat, add of q and k, neg of their halves
    qk_norm = 3 * s * (a + g) * d + 3 * s * (a + g) if m.qk_norm else 0
    return 2 * norm + rotate + qk_norm + 2 * s * f + 2 * s * h  # silu, mul; 2 residual adds


def units(m: LlamaModel) -> list[Unit]:
    s, h, v = m.seq_len, m.hidden_size, m.vocab_size
    tied = m.tie_word_embeddings
    emb = Unit(
        "embedding",
        "embedding",
        params_split=v * h,
        mp_allreduces=1,
        boundary_elements=s * h,
        fwd_ops=1,  # the lookup
        fwd_elementwise=s * h,
        param_tensors=1,
        largest_split=v * h,
    )
    head = Unit(
        "head",
        "head",
        # the LM head, column-parallel over the vocabulary: the embedding's weight when tied
        params_split=0 if tied else h * v,
        params_whole=h,  # final norm
        fwd_flops=2 * s * h * v,
        # final norm: normalised input, and its input and rsqrt in fp32; its output (saved by the
        # LM head); log-softmax output (vocab-parallel)
        acts={"none": Acts(fp32=s * v, sp=s * h, sp32=s * h + s, whole=s * h)},
        # the gradients of the log-softmax output and of the logits (fp32: the loss upcasts)
        transient=Acts(fp32=2 * s * v),
        transient_tp=Acts(fp32=s * v),
        output_split=s * v,  # the logits
        weight_grad_outputs=Acts(split=s * v, sp=s * h),  # the logits' and the final norm output's
        fwd_ops=16,  # norm (7), LM head (t, view, mm, view), 2 flattening views, log-softmax, NLL
        fwd_gemms=1,
        fwd_elementwise=3 * s * h + 3 * s + s * v,  # norm, log-softmax
        param_tensors=1 if tied else 2,  # norm, LM head
        largest_split=0 if tied else h * v,
        largest_whole=h,
    )
    dense = block(m)
    # one Unit object per block: the planner keys per-block facts by the object (plan/chunks.py
    # block_recomputes: a zero-bubble chunk's blocks are recomputed twice, the first chunk's once)
    blocks = [
        moe_block(dense, m.moe, s, h, m.ffn_hidden_size, h * m.num_attention_heads * m.head_width)
        if is_moe_layer(m.moe, i)
        else replace(dense)
        for i in range(m.num_layers)
    ]
    return [emb, *blocks, head]


def input_bytes(m: LlamaModel) -> int:
    return 2 * 8 * m.seq_len  # int64 token ids and labels
