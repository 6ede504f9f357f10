"""Mixture of experts for the transformer families, the torch-free half: the `model.moe` section,
which blocks are MoE blocks, its rules, and its planner terms. The layer itself is
`fleetwise.models.moe`; what the trainer does with it (metrics, the bias update) is
`fleetwise.runtime.moe`.

A MoE block replaces the dense MLP by a router and `num_experts` SwiGLU experts of width
`expert_ffn_size`: every token goes to the `top_k` experts of highest score, and their outputs are
summed with the scores as weights (Shazeer et al. 2017; Mixtral, Jiang et al. 2024), plus
`num_shared_experts` experts every token goes through (DeepSeekMoE, Dai et al. 2024). Routing is
dropless by default: every expert takes every token routed to it, so a token's output does not
depend on how the batch is split over ranks; with a capacity factor, an expert takes at most
ceil(capacity_factor · tokens · top_k / num_experts) tokens of a micro-batch (in token order) and the
rest are dropped (counted).

Load balancing: `aux_loss` adds coef · Σ_i f_i · P_i per MoE block to the loss (f_i: the share of
routed token slots expert i got, times num_experts / top_k; P_i: the mean normalised score of
expert i; 1 at perfect balance; DeepSeek-V2's expert-level balance loss, Switch's for top_k 1);
`bias` is DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for the
choice of experts only (not to the weights), moved after every step by bias_update_rate towards the
experts that got fewer tokens than the mean.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from typing import Literal

from pydantic import Field

from fleetwise.config.base import Section
from fleetwise.config.problems import Problem
from fleetwise.plan.units import Acts, Unit


class MoE(Section):
    """Mixture-of-experts blocks (num_experts 0: every block has a dense MLP)."""

    num_experts: int = Field(0, ge=0, description="Routed experts per MoE block (0: no MoE, dense MLPs).")
    top_k: int = Field(2, ge=1, description="Experts each token is routed to (Mixtral: 2).")
    num_shared_experts: int = Field(
        0, ge=0, description="Experts every token goes through, beside the routed ones (DeepSeekMoE)."
    )
    expert_ffn_size: int | None = Field(
        None, ge=1, description="SwiGLU width of one expert (null: the dense MLP's width)."
    )
    first_dense_layers: int = Field(
        0, ge=0, description="The first k blocks keep a dense MLP (DeepSeek's first_k_dense_replace)."
    )
    interval: int = Field(
        1,
        ge=1,
        description="After those, every n-th block is a MoE block (1: all of them), starting with the first.",
    )
    score_func: Literal["softmax", "sigmoid"] = Field(
        "softmax",
        description="Router scores: softmax over the experts (Mixtral) or a sigmoid each (DeepSeek-V3).",
    )
    normalize_weights: bool = Field(
        True, description="Divide the chosen experts' scores by their sum (Mixtral, DeepSeek-V3)."
    )
    load_balance: Literal["aux_loss", "bias", "none"] = Field(
        "aux_loss",
        description="aux_loss: a balance loss × aux_loss_coef; bias: DeepSeek-V3's auxiliary-loss-free "
        "per-expert bias, updated after each step; none.",
    )
    aux_loss_coef: float = Field(0.01, ge=0, description="Weight of the balance loss (Mixtral: 0.02).")
    bias_update_rate: float = Field(
        0.001, gt=0, description="load_balance=bias: the bias step per optimizer step (DeepSeek-V3: 0.001)."
    )
    capacity_factor: float | None = Field(
        None,
        gt=0,
        description="null: dropless. Else an expert takes at most capacity_factor × tokens × top_k / "
        "num_experts tokens of a micro-batch; the rest are dropped and counted.",
    )
    grouped_mm: bool = Field(
        True,
        description="Run the experts as one grouped GEMM where torch has one (else a loop; same numbers).",
    )

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


def expert_width(moe: MoE, dense_ffn: int) -> int:
    return moe.expert_ffn_size if moe.expert_ffn_size is not None else dense_ffn


def is_moe_layer(moe: MoE, layer: int) -> bool:
    """Whether block `layer` (0-based) has experts instead of a dense MLP."""
    return (
        moe.enabled
        and layer >= moe.first_dense_layers
        and (layer - moe.first_dense_layers) % moe.interval == 0
    )


def tp_plan_of(plan, moe: MoE, num_layers: int):
    """A family's tensor-parallel plan function for a model with `moe`: as it is while some block is
    dense (runtime/parallelize.py leaves each MoE block's MLP out), without its `layers.*.mlp…`
    entries when every block is MoE (Mixtral: they would name modules no block has)."""
    if len(moe_layers(moe, num_layers)) < num_layers:
        return plan
    return partial(_without_mlps, plan)


def _without_mlps(plan, sequence_parallel: bool) -> dict:
    return {k: v for k, v in plan(sequence_parallel).items() if not k.startswith("layers.*.mlp")}


def moe_layers(moe: MoE, num_layers: int) -> list[int]:
    return [i for i in range(num_layers) if is_moe_layer(moe, i)]


def check_moe(moe: MoE, num_layers: int) -> Iterator[Problem]:
    """The section's own rules (those about the layout are in config/rules/moe.py)."""
    if not moe.enabled:
        return
    e, k = moe.num_experts, moe.top_k
    if k > e:
        yield Problem(
            "model.moe.top_k",
            f"top_k={k} is more than num_experts={e}: a token cannot go to more experts than there are",
            f"set model.moe.top_k to at most {e} (Mixtral: 2 of 8), or raise model.moe.num_experts",
        )
    if moe.first_dense_layers >= num_layers:
        yield Problem(
            "model.moe.first_dense_layers",
            f"first_dense_layers={moe.first_dense_layers} leaves no MoE block of num_layers={num_layers}",
            f"set model.moe.first_dense_layers below {num_layers}, or model.moe.num_experts=0 for a dense model",
        )
    if moe.score_func == "softmax" and k == 1 and moe.normalize_weights:
        yield Problem(
            "model.moe.normalize_weights",
            "top_k=1 with softmax scores and normalize_weights=true: the one weight is always 1, so the "
            "router gets no gradient from the loss",
            "set model.moe.normalize_weights=false (Switch Transformer's top-1 routing), or top_k >= 2",
        )
    if moe.load_balance == "aux_loss" and moe.aux_loss_coef == 0:
        yield Problem(
            "model.moe.aux_loss_coef",
            "load_balance=aux_loss with aux_loss_coef=0 balances nothing",
            "set model.moe.aux_loss_coef (Mixtral: 0.02, Qwen3-MoE: 0.001), or model.moe.load_balance=none",
        )


def moe_notes(moe: MoE, num_layers: int, dense_ffn: int) -> list[str]:
    if not moe.enabled:
        return []
    n = len(moe_layers(moe, num_layers))
    shared = f" + {moe.num_shared_experts} shared" if moe.num_shared_experts else ""
    routing = "dropless" if moe.capacity_factor is None else f"capacity factor {moe.capacity_factor:g}"
    return [
        f"mixture of experts in {n} of {num_layers} blocks: top-{moe.top_k} of {moe.num_experts} experts"
        f"{shared}, width {expert_width(moe, dense_ffn)}, {moe.score_func} router, {routing}, "
        f"balanced by {moe.load_balance}; FLOPs and MFU count the active parameters, assuming balanced "
        "routing (moe/load_max_over_mean in metrics.jsonl measures it)"
    ]


def moe_block(dense: Unit, moe: MoE, seq: int, hidden: int, dense_ffn: int, attention_largest: int) -> Unit:
    """A transformer block's planner unit with its dense SwiGLU MLP (width dense_ffn) replaced by the
    mixture of experts (fleetwise.models.moe) -- counted as torch runs it, per sample of `seq` tokens:

    - parameters: the router [E, h], E experts' w1, w3 [f, h] and w2 [h, f], the shared experts'
      SwiGLU (width num_shared·f); of those, the E - top_k experts a token does not use are inactive;
    - FLOPs on the active ones: the router, top_k experts per token, the shared experts;
    - what autograd saves (s tokens, k slots each, sk = s·k rows): the routed rows [sk, h] (the
      experts' input), the four SwiGLU tensors per row, the experts' output rows [sk, h] and their
      weights [sk] (the weighting multiply's operands), the weighted rows [sk, h] (index_add saves
      its source: the Mixtral dry run held it, 64 MiB a layer at 4,096 tokens); the router's fp32 scores [s, E] (softmax's or
      sigmoid's output), the chosen weights and their sum (normalize_weights' division), the three
      int64 index tensors (the chosen experts [s, k], the sort order and the rows' tokens [sk]: 8
      bytes each, counted as two fp32 elements), a sigmoid router's per-token sum (the balance loss),
      the capacity mask; the shared experts' four SwiGLU tensors. Balanced routing: sk rows whatever
      the split among the experts, so the counts hold for every routing of a dropless layer;
    - under tensor parallelism the MoE MLP is not split (models/moe.py): its parameters are
      `params_whole`, its saved tensors `replicated` (the router's fp32 ones stay `fp32`, divided by
      mp: a few per cent of the layer's at most), its FLOPs `replicated_flops`, and the block
      all-reduces one activation over mp per forward (attention's), not two.
    """
    s, h, f = seq, hidden, expert_width(moe, dense_ffn)
    e, k = moe.num_experts, moe.top_k
    fs = moe.num_shared_experts * f
    sk = s * k
    dense_mlp = 3 * hidden * dense_ffn
    params = h * e + 3 * e * h * f + 3 * h * fs
    active = h * e + 3 * k * h * f + 3 * h * fs
    none = dense.saved("none")
    router_fp32 = (
        s * e  # scores
        + ((s * k + s) if moe.normalize_weights else 0)  # the division's operands
        + 2 * (s * k + 2 * sk)  # int64: chosen experts, sort order, the rows' tokens
        + (s if moe.score_func == "sigmoid" and moe.load_balance == "aux_loss" else 0)
        + (sk if moe.capacity_factor is not None else 0)  # the capacity mask
    )
    acts_none = replace(
        none,
        split=none.split - 4 * s * dense_ffn,
        replicated=none.replicated + 3 * sk * h + 4 * sk * f + sk + 4 * s * fs,
        fp32=none.fp32 + router_fp32,
    )
    sel = dense.saved("selective")
    acts_selective = replace(
        sel,
        # the matmuls' outputs: the router's, the experts' w1, w3 and w2, the shared gate and up
        split=sel.split - 2 * s * dense_ffn,
        replicated=sel.replicated + s * e + 2 * sk * f + sk * h + 2 * s * fs + (s * h if fs else 0),
        reduced=sel.reduced - s * h,  # o's (the shared down projection's output: replicated)
    )
    wgo = dense.weight_grad_outputs
    return replace(
        dense,
        name="moe_block",
        params_split=dense.params_split - dense_mlp,
        params_whole=dense.params_whole + params,
        inactive_params=params - active,
        expert_params=3 * e * h * f,
        exchange_elements=sk * h,
        fwd_flops=dense.fwd_flops - 2 * s * dense_mlp + 2 * s * active,
        replicated_flops=2 * s * active,
        mp_allreduces=dense.mp_allreduces - 1,
        # checkpointed: the recompute ends at the last op whose tensor backward needs, before the
        # shared experts' down projection (without them, at the index_add back onto the tokens)
        recompute_skipped_flops=2 * s * fs * h,
        acts={"none": acts_none, "selective": acts_selective, "full": dense.saved("full")},
        # the experts' down projection's backward: its input's gradient, then the product's operands'
        backward_transient=Acts(replicated=max(2 * sk * f, 2 * s * fs)),
        weight_grad_outputs=replace(
            wgo,
            split=wgo.split - 2 * s * dense_ffn,
            replicated=wgo.replicated + s * e + 2 * sk * f + 2 * s * fs + sk * h + (s * h if fs else 0),
            partial=wgo.partial - s * h,
        ),
        # counted by hand (not held by a test like the dense block's): router 10, dispatch and
        # combine 20, the experts 10, the balance loss 8, the step's counts 6; shared SwiGLU 14
        fwd_ops=dense.fwd_ops - (3 * 4 + 2) + 54 + (14 if fs else 0),
        fwd_gemms=dense.fwd_gemms - 3 + 1 + 3 + (3 if fs else 0),
        param_tensors=dense.param_tensors - 3 + 1 + 3 + (3 if fs else 0),
        largest_split=attention_largest,
        largest_whole=max(dense.largest_whole, h * fs, h * e),
        largest_expert=e * h * f,  # (a routed expert weight [e, f, h]: split over ep too)
        fwd_elementwise=dense.fwd_elementwise
        - 2 * s * dense_ffn
        + s * e
        + 2 * sk * f
        + 2 * sk * h
        + 2 * s * h
        + (2 * s * fs + s * h if fs else 0),
    )


# config path -> largest accepted value (what the planner can represent; checked with the family's
# other bounds, families/llama/schema.py)
MOE_LIMITS = {
    "model.moe.num_experts": 1 << 16,
    "model.moe.top_k": 1 << 10,
    "model.moe.num_shared_experts": 1 << 10,
    "model.moe.expert_ffn_size": 1 << 22,
}
