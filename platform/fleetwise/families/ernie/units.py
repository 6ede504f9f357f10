"""ERNIE as a chain of planner units: the embedding (words, positions, token types, its norm), the
post-LN blocks GPT and ERNIE share (`fleetwise.families.transformer.transformer_block`), and the MLM
head over every position."""

from __future__ import annotations

from fleetwise.families.ernie.schema import ERNIEModel, masked_per_sample
from fleetwise.families.transformer import transformer_block
from fleetwise.plan.units import Acts, Unit


def units(m: ERNIEModel) -> list[Unit]:
    s, h, v = m.seq_len, m.hidden_size, m.padded_vocab_size
    emb = Unit(
        "embedding",
        "embedding",
        params_split=v * h,
        params_whole=s * h + m.type_vocab_size * h + 2 * h,  # positions, token types, embedding LN
        acts={"none": Acts(sp=s * h, whole=2 * s)},  # embedding LN input
        mp_allreduces=1,
        boundary_elements=s * h,
        fwd_ops=7,  # arange, 3 lookups, 2 adds, LN
        fwd_elementwise=5 * s * h + 2 * s,  # word and type lookups, 2 adds, LN (+ mean, rstd)
        param_tensors=5,  # 3 tables, LN
        largest_split=v * h,
        largest_whole=max(s, m.type_vocab_size) * h,
    )
    head = Unit(
        "head",
        "head",
        # MLM head over every position (as BERT/ERNIE implementations do; the loss reads the masked
        # ones): dense h->h + GELU + LN (replicated), then a vocab-parallel decoder with bias.
        params_split=h * v + v,
        params_whole=h * h + h + 2 * h,
        fwd_flops=2 * s * (h * h + h * v),
        # dense input, GELU input, LN input, LN output; log-softmax output (vocab-parallel)
        acts={"none": Acts(fp32=s * v, whole=4 * s * h + 2 * s)},
        transient=Acts(fp32=2 * s * v),  # the gradients of the log-softmax output and of the logits
        transient_tp=Acts(fp32=s * v),
        output_split=s * v,  # the decoder's logits
        # the decoder's logits, the dense layer's output (replicated), the norm's output
        weight_grad_outputs=Acts(split=s * v, partial=s * h, whole=s * h),
        fwd_ops=15,  # dense, GELU, LN, decoder (t, addmm, views), log-softmax, NLL
        fwd_gemms=2,
        fwd_elementwise=2 * s * h + 2 * s + s * v,  # GELU, LN, log-softmax
        param_tensors=6,  # dense, LN, decoder
        largest_split=h * v,
        largest_whole=h * h,
    )
    return [emb] + [transformer_block(m, post_ln=True) for _ in range(m.num_layers)] + [head]


def input_bytes(m: ERNIEModel) -> int:
    return 3 * 8 * m.seq_len  # int64 token ids, token types and labels


def plan_notes(m: ERNIEModel) -> list[str]:
    k = masked_per_sample(m)
    return [f"masked LM: {k} of {m.seq_len} positions per sequence are predicted"]
