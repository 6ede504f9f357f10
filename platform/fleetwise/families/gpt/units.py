"""GPT as a chain of planner units: the embedding (tokens and learned positions), the pre-LN
blocks GPT and ERNIE share (`fleetwise.families.transformer.transformer_block`), and the head (final
norm, untied LM head, the loss)."""

from __future__ import annotations

from fleetwise.families.gpt.schema import GPTModel
from fleetwise.families.transformer import transformer_block
from fleetwise.plan.units import Acts, Unit


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
    return [emb] + [transformer_block(m) for _ in range(m.num_layers)] + [head]


def input_bytes(m: GPTModel) -> int:
    return 2 * 8 * m.seq_len  # int64 token ids and labels
