"""A model as a chain of units (embedding, blocks, head) with analytic sizes.

Each unit knows, per sample and without torch: its parameters (split into the part tensor
parallelism divides by mp and the part every mp rank replicates), its forward matmul FLOPs, and
the activation elements it keeps for backward under each recompute mode. The pipeline planner
assigns units to stages; the memory, FLOPs and time models sum them.

Parameter counts mirror the model code in `fleetwise.models` exactly (a test builds every tiny
model with torch and compares). Activation counts follow what PyTorch's autograd saves for our
modules (the accounting of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", redone for this engine: separate q/k/v projections, fused SDPA that saves
q, k, v, its output and a log-sum-exp instead of the s×s attention matrix, no dropout masks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fleetwise.config.model import CTRModel, ERNIEModel, GPTModel, ModelConfig, ResNetModel, TransformerModel


@dataclass(frozen=True)
class Acts:
    """Saved activation elements per sample: `split` is divided by mp, `sp` by mp only under
    sequence parallelism, `whole` is kept in full by every mp rank."""

    split: float = 0.0
    sp: float = 0.0
    whole: float = 0.0

    def elements(self, mp: int, sequence_parallel: bool) -> float:
        return self.split / mp + (self.sp / mp if sequence_parallel else self.sp) + self.whole

    @property
    def total(self) -> float:
        return self.split + self.sp + self.whole


@dataclass(frozen=True)
class Unit:
    name: str
    kind: str  # "embedding" | "block" | "head"
    params_split: int = 0  # divided by mp under tensor parallelism
    params_whole: int = 0  # replicated on every mp rank
    fwd_flops: float = 0.0  # per sample, matmul/conv FLOPs of the forward pass (2 per multiply-add)
    acts: dict[str, Acts] = field(default_factory=dict)  # recompute mode -> saved activations
    transient: Acts = Acts()  # short-lived peak on top of the saved ones (e.g. logits and their grad)
    attn_flops: float = 0.0  # per sample, attention score/context FLOPs (part of fwd_flops)
    mp_allreduces: int = 0  # tensor-parallel all-reduces of a (seq, hidden) activation per forward
    boundary_elements: float = 0.0  # elements per sample sent to the next pipeline stage
    # aten ops the forward of one micro-batch dispatches (views included; the head counts its
    # loss): each costs the profile's op_overhead_us of host time. A test counts them in torch.
    fwd_ops: int = 0
    # of those, the matmul-like ops (linear, conv, SDPA): the planner times them at the GEMM
    # efficiency of their average size. A test counts them in torch.
    fwd_gemms: int = 0
    # elements per sample that the other (non-view) ops write in forward (norms, activations, adds,
    # lookups, log-softmax): each costs the profile's elementwise_ns with its backward. Per-batch
    # terms (positions, BatchNorm statistics, the loss) are left out; the same test counts them.
    fwd_elementwise: float = 0.0
    param_tensors: int = 0  # parameter tensors: the optimizer step costs time per tensor too
    fwd_convs: int = 0  # of the GEMMs, convolutions: each costs the profile's conv_call_us more
    # elements of the unit's largest parameter tensor, split by mp / replicated: while gradients
    # accumulate, autograd computes a tensor's new gradient before adding it into .grad, so one
    # extra gradient of (at most) this size is briefly alive. A test compares with torch.
    largest_split: int = 0
    largest_whole: int = 0

    @property
    def params(self) -> int:
        return self.params_split + self.params_whole

    def largest_on_rank(self, mp: int) -> float:
        return max(self.largest_split / mp, self.largest_whole)

    def params_on_rank(self, mp: int) -> float:
        return self.params_split / mp + self.params_whole

    def saved(self, recompute: str) -> Acts:
        return self.acts.get(recompute, self.acts.get("none", Acts()))


# ------------------------------------------------------------------------------------------------
# Transformers


def _transformer_block(m: TransformerModel) -> Unit:
    s, h, f, a = m.seq_len, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads
    # q, k, v and fc1 are column-parallel (weight and bias split); out-proj and fc2 are row-parallel
    # (weight split, bias replicated); both layer norms are replicated.
    split = 4 * h * h + 2 * h * f + 3 * h + f
    whole = 2 * h + 4 * h
    none = Acts(
        # q, k, v; SDPA output and log-sum-exp; the re-laid-out context (out-proj input); fc1 output
        # (GELU input) and GELU output (fc2 input).
        split=3 * s * h + s * h + a * s + s * h + 2 * s * f,
        # the inputs of the two layer norms (sequence parallel shards them)
        sp=2 * s * h,
        # the outputs of the two layer norms, saved by the column-parallel linears that read them
        # (gathered in full under sequence parallelism); LN mean/rstd
        whole=2 * s * h + 4 * s,
    )
    selective = Acts(
        # selective checkpointing keeps matmul and attention outputs and recomputes norms and GELU
        split=3 * s * h + s * h + a * s + s * f,
        sp=s * h,  # block input
        whole=2 * s * h,  # out-proj and fc2 outputs (row-parallel partial sums)
    )
    full = Acts(sp=s * h)  # only the block input; the block is recomputed during backward
    attn = 2 * 2 * s * s * h  # QK^T and scores·V, counted as full (non-causal) matmuls
    return Unit(
        name="block",
        kind="block",
        params_split=split,
        params_whole=whole,
        fwd_flops=2 * s * (4 * h * h + 2 * h * f) + attn,
        attn_flops=attn,
        acts={"none": none, "selective": selective, "full": full},
        mp_allreduces=2,
        boundary_elements=s * h,
        fwd_ops=39,  # pre- and post-LN alike: 2 LN, 6 linears (t, addmm, views), SDPA, GELU, 2 adds
        fwd_gemms=7,  # 6 linears, SDPA
        param_tensors=16,  # 6 linears and 2 layer norms, weight and bias each
        largest_split=max(h * f, h * h),
        largest_whole=h,
        fwd_elementwise=2 * (s * h + 2 * s) + 2 * s * h + s * f,  # 2 LN (+ mean, rstd), 2 adds, GELU
    )


def _gpt_units(m: GPTModel) -> list[Unit]:
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
        acts={"none": Acts(split=s * v, sp=s * h, whole=s * h + 2 * s)},
        transient=Acts(split=2 * s * v),  # logits, then the gradient of the logits
        fwd_ops=10,  # LN, LM head (t, mm, views), log-softmax, NLL
        fwd_gemms=1,
        fwd_elementwise=s * h + 2 * s + s * v,  # LN, log-softmax
        param_tensors=3,  # LN weight and bias, LM head
        largest_split=h * v,
        largest_whole=h,
    )
    return [emb] + [_transformer_block(m) for _ in range(m.num_layers)] + [head]


def _ernie_units(m: ERNIEModel) -> list[Unit]:
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
        acts={"none": Acts(split=s * v, whole=4 * s * h + 2 * s)},
        transient=Acts(split=2 * s * v),
        fwd_ops=15,  # dense, GELU, LN, decoder (t, addmm, views), log-softmax, NLL
        fwd_gemms=2,
        fwd_elementwise=2 * s * h + 2 * s + s * v,  # GELU, LN, log-softmax
        param_tensors=6,  # dense, LN, decoder
        largest_split=h * v,
        largest_whole=h * h,
    )
    return [emb] + [_transformer_block(m) for _ in range(m.num_layers)] + [head]


def masked_per_sample(m: ERNIEModel) -> int:
    """Positions the masking selects per sequence (whole words/spans up to this budget)."""
    return max(1, round(m.seq_len * m.mask_prob))


# ------------------------------------------------------------------------------------------------
# ResNet (torchvision layout: convolutions without bias, BatchNorm after each, stride on the 3x3)


def _conv_out(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def _resnet_units(m: ResNetModel) -> list[Unit]:
    w, size, cin = m.base_width, m.image_size, m.in_channels
    expansion = 4 if m.block == "bottleneck" else 1
    units: list[Unit] = []

    # Stem: conv 7x7/2, BN, ReLU, maxpool 3x3/2.
    s1 = _conv_out(size, 7, 2, 3)
    s2 = _conv_out(s1, 3, 2, 1)
    units.append(
        Unit(
            "stem",
            "embedding",
            params_whole=49 * cin * w + 2 * w,
            fwd_flops=2 * 49 * cin * w * s1 * s1,
            # input image, conv output (BN input), ReLU output (maxpool input); maxpool indices (int64 = 2)
            acts={"none": Acts(whole=cin * size * size + 2 * w * s1 * s1 + 2 * w * s2 * s2)},
            boundary_elements=w * s2 * s2,
            fwd_ops=7,  # conv, BN (3 ops), ReLU (+ detach), max-pool
            fwd_gemms=1,
            fwd_elementwise=2 * w * s1 * s1 + 2 * w * s2 * s2,  # BN, ReLU, max-pool and its indices
            param_tensors=3,  # conv, BN weight and bias
            fwd_convs=1,
            largest_whole=49 * cin * w,
        )
    )
    inplanes, spatial = w, s2
    for stage, blocks in enumerate(m.layers):
        planes = w * 2**stage
        for i in range(blocks):
            stride = 2 if (stage > 0 and i == 0) else 1
            out = _conv_out(spatial, 3, stride, 1)
            down = stride != 1 or inplanes != planes * expansion
            if m.block == "basic":
                params = 9 * inplanes * planes + 9 * planes * planes + 4 * planes
                flops = 2 * 9 * (inplanes * planes + planes * planes) * out * out
                saved = 4 * planes * out * out  # conv1 out, ReLU1 out, conv2 out, block output
                convs = 2
                largest = 9 * max(inplanes, planes) * planes
                # BN and ReLU after each conv, the residual add
                elementwise = 5 * planes * out * out
            else:
                params = inplanes * planes + 9 * planes * planes + 4 * planes * planes + 2 * planes * 6
                flops = 2 * (
                    inplanes * planes * spatial * spatial
                    + 9 * planes * planes * out * out
                    + 4 * planes * planes * out * out
                )
                saved = 2 * planes * spatial * spatial + 2 * planes * out * out + 8 * planes * out * out
                convs = 3
                largest = max(inplanes * planes, 9 * planes * planes, expansion * planes * planes)
                elementwise = 2 * planes * spatial * spatial + 14 * planes * out * out
            # conv 1, BN 3 (counter, buffer, norm) and ReLU 2 (+ detach) ops each; residual add:
            # basic 2 conv+BN, 2 ReLU; bottleneck 3 conv+BN, 3 ReLU
            ops = 2 * 4 + 2 * 2 + 1 if m.block == "basic" else 3 * 4 + 3 * 2 + 1
            if down:
                ops += 4  # 1x1 conv + BN
                params += inplanes * planes * expansion + 2 * planes * expansion
                flops += 2 * inplanes * planes * expansion * out * out
                saved += planes * expansion * out * out
                convs += 1
                largest = max(largest, inplanes * planes * expansion)
                elementwise += planes * expansion * out * out
            units.append(
                Unit(
                    f"layer{stage + 1}.{i}",
                    "block",
                    params_whole=params,
                    fwd_flops=flops,
                    acts={
                        "none": Acts(whole=saved),
                        "selective": Acts(whole=saved),
                        "full": Acts(whole=inplanes * spatial * spatial),
                    },
                    boundary_elements=planes * expansion * out * out,
                    fwd_ops=ops,
                    fwd_gemms=convs,
                    fwd_elementwise=elementwise,
                    param_tensors=3 * convs,  # each conv and its BN's weight and bias
                    fwd_convs=convs,
                    largest_whole=largest,
                )
            )
            inplanes, spatial = planes * expansion, out
    units.append(
        Unit(
            "head",
            "head",
            params_whole=inplanes * m.num_classes + m.num_classes,
            fwd_flops=2 * inplanes * m.num_classes,
            acts={"none": Acts(whole=inplanes * spatial * spatial + inplanes + m.num_classes)},
            transient=Acts(whole=2 * m.num_classes),
            fwd_ops=7,  # avg-pool, flatten, linear (t, addmm), log-softmax, NLL
            fwd_gemms=1,
            fwd_elementwise=inplanes + m.num_classes,  # pooled features, log-softmax
            param_tensors=2,
            largest_whole=inplanes * m.num_classes,
        )
    )
    return units


# ------------------------------------------------------------------------------------------------
# CTR (DeepFM / Wide&Deep)


def ctr_mlp_dims(m: CTRModel) -> list[int]:
    return [len(m.sparse_tables) * m.embedding_dim + m.num_dense_features, *m.mlp_hidden, 1]


def ctr_parameter_shapes(m: CTRModel) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of `fleetwise.models.ctr.CTRNet` by name and shape, in `named_parameters()`
    order. The parameter server places variables by these names; a test checks them against torch."""
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for t in m.sparse_tables:
        shapes.append((f"embeddings.{t.name}.weight", (t.num_embeddings, m.embedding_dim)))
    for t in m.sparse_tables:
        shapes.append((f"first_order.{t.name}.weight", (t.num_embeddings, 1)))
    shapes.append(("dense_first_order.weight", (1, m.num_dense_features)))
    shapes.append(("dense_first_order.bias", (1,)))
    dims = ctr_mlp_dims(m)
    for i, (a, b) in enumerate(zip(dims, dims[1:], strict=False)):
        # nn.Sequential(Linear, ReLU, Linear, ReLU, ..., Linear): linears sit at even indices
        shapes.append((f"mlp.{2 * i}.weight", (b, a)))
        shapes.append((f"mlp.{2 * i}.bias", (b,)))
    return shapes


def _ctr_units(m: CTRModel) -> list[Unit]:
    fields = len(m.sparse_tables)
    rows = sum(t.num_embeddings for t in m.sparse_tables)
    dims = ctr_mlp_dims(m)
    mlp = sum(a * b + b for a, b in zip(dims, dims[1:], strict=False))
    mlp_flops = 2 * sum(a * b for a, b in zip(dims, dims[1:], strict=False))
    linears = len(dims) - 1
    return [
        Unit(
            "embedding",
            "embedding",
            # per table: k-dim embedding + 1-dim first-order weight; dense first-order linear (+bias)
            params_whole=rows * (m.embedding_dim + 1) + m.num_dense_features + 1,
            acts={"none": Acts(whole=fields * (m.embedding_dim + 1))},
            fwd_ops=4 * fields + 2,  # per table: select + lookup, twice (embedding, first order); stack, cat
            fwd_elementwise=2 * fields * (m.embedding_dim + 1),  # the lookups, then stacked
            param_tensors=2 * fields + 2,  # embedding and first-order table per field, dense linear
            largest_whole=max(
                [t.num_embeddings * m.embedding_dim for t in m.sparse_tables] + [m.num_dense_features]
            ),
        ),
        Unit(
            "mlp",
            "block",
            params_whole=mlp,
            fwd_flops=mlp_flops + 4 * fields * m.embedding_dim,
            acts={"none": Acts(whole=2 * sum(dims[1:]) + dims[0])},
            # dense first order 5, FM 8 (DeepFM), concat 2, linears 2 each, ReLU 2 each, output 2, loss 1
            fwd_ops=5 + (8 if m.kind == "deepfm" else 0) + 2 + 2 * linears + 2 * (linears - 1) + 3,
            fwd_gemms=linears + 1,  # the MLP and the dense first-order linear
            param_tensors=2 * linears,
            largest_whole=max(a * b for a, b in zip(dims, dims[1:], strict=False)),
            # concatenated input, ReLU outputs, FM squares and sums (DeepFM)
            fwd_elementwise=dims[0]
            + sum(dims[1:-1])
            + (4 * fields * m.embedding_dim if m.kind == "deepfm" else 0),
        ),
    ]


def model_units(m: ModelConfig) -> list[Unit]:
    if isinstance(m, GPTModel):
        return _gpt_units(m)
    if isinstance(m, ERNIEModel):
        return _ernie_units(m)
    if isinstance(m, ResNetModel):
        return _resnet_units(m)
    return _ctr_units(m)


def total_params(m: ModelConfig) -> int:
    return sum(u.params for u in model_units(m))


def input_bytes_per_sample(m: ModelConfig) -> int:
    """Bytes of one sample of the batch a rank holds for the whole step, as the data sources
    (`fleetwise.data`) build it: int64 token ids and labels (ERNIE adds token types), fp32 images
    with an int64 label, CTR int64 ids per field with fp32 dense features and an fp32 label."""
    if isinstance(m, ERNIEModel):
        return 3 * 8 * m.seq_len
    if isinstance(m, TransformerModel):
        return 2 * 8 * m.seq_len
    if isinstance(m, ResNetModel):
        return 4 * m.in_channels * m.image_size**2 + 8
    return 8 * len(m.sparse_tables) + 4 * m.num_dense_features + 4


def tokens_per_sample(m: ModelConfig) -> int:
    return m.seq_len if isinstance(m, TransformerModel) else 0


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def largest(values: list[float]) -> float:
    return max(values) if values else 0.0


__all__ = [
    "Acts",
    "Unit",
    "model_units",
    "total_params",
    "tokens_per_sample",
    "masked_per_sample",
    "ctr_mlp_dims",
    "ctr_parameter_shapes",
    "ceil_div",
    "largest",
    "math",
]
