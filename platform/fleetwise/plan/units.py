"""A model as a chain of units (embedding, blocks, head) with analytic sizes.

Each unit knows, per sample and without torch: its parameters (split into the part tensor
parallelism divides by mp and the part every mp rank replicates), its forward matmul FLOPs, and
the activation elements it keeps for backward under each recompute mode. The pipeline planner
assigns units to stages; the memory, FLOPs and time models sum them. Each family builds its
chain in its own module (`fleetwise.families.<name>.units`); this module is the generic part.

Parameter counts mirror the model code in `fleetwise.models` exactly (a test builds every tiny
model with torch and compares). Activation counts follow what PyTorch's autograd saves for our
modules (the accounting of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", redone for this engine: separate q/k/v projections, fused SDPA that saves
q, k, v, its output and a log-sum-exp instead of the s×s attention matrix, no dropout masks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Acts:
    """Saved activation elements per sample: `split` is divided by mp, `sp` by mp only under
    sequence parallelism, `whole` is kept in full by every mp rank. `reduced`: the outputs of
    row-parallel matmuls after their reduction (reduce-scatter under sequence parallelism, else
    all-reduce; the matmul's own output without tensor parallelism): divided by mp only under
    sequence parallelism like `sp`, but in the compute dtype like `split` (the matmul's)."""

    split: float = 0.0
    sp: float = 0.0
    whole: float = 0.0
    reduced: float = 0.0
    # divided by mp like `split`, but fp32 whatever the precision: a vocabulary-parallel loss's
    # log-softmax output (the trainer's loss upcasts the logits; autocast runs log-softmax in fp32)
    fp32: float = 0.0
    # a row-parallel matmul's own output, before its reduction (the partial sums): whole on every
    # mp rank, sequence parallel or not, in the compute dtype like `split`
    partial: float = 0.0
    # in the compute dtype like `split`, but whole on every mp rank: a MoE block's MLP, which tensor
    # parallelism does not split (models/moe.py)
    replicated: float = 0.0
    # sharded like `sp`, but fp32 whatever the precision: an RMSNorm that normalises in fp32 saves
    # its input's fp32 copy and the per-token rsqrt (families/llama: `x.float()`, as Hugging Face's)
    sp32: float = 0.0

    def elements(self, mp: int, sequence_parallel: bool) -> float:
        seq = self.sp + self.reduced + self.sp32
        return (
            (self.split + self.fp32) / mp
            + (seq / mp if sequence_parallel else seq)
            + self.whole
            + self.partial
            + self.replicated
        )

    @property
    def total(self) -> float:
        return (
            self.split + self.sp + self.whole + self.reduced + self.fp32 + self.partial + self.replicated + self.sp32
        )


NO_ACTS = Acts()  # a unit that saves nothing


@dataclass(frozen=True)
class Unit:
    name: str
    kind: str  # "embedding" | "block" | "head"
    params_split: int = 0  # divided by mp under tensor parallelism
    params_whole: int = 0  # replicated on every mp rank
    fwd_flops: float = 0.0  # per sample, matmul/conv FLOPs of the forward pass (2 per multiply-add)
    # of fwd_flops, those every mp rank computes in full (a MoE block's MLP: not split over mp)
    replicated_flops: float = 0.0
    acts: dict[str, Acts] = field(default_factory=dict)  # recompute mode -> saved activations
    transient: Acts = Acts()  # short-lived peak on top of the saved ones (e.g. logits and their grad)
    # the same under tensor parallelism, where it differs: a vocabulary-parallel loss
    # (loss_parallel) computes the logits' gradient in its NLL backward and passes it through the
    # log-softmax backward, one gradient where plain cross entropy makes two
    transient_tp: Acts | None = None
    # gradients alive at the peak of a block's own backward, beside its saved (or recomputed)
    # activations, in the matmul dtype: a transformer block's first backward matmul (fc2) holds
    # its input's gradient (s x ffn) while the input itself is still saved
    backward_transient: Acts = Acts()
    # zero bubble: the gradients of the outputs of the unit's weighted ops (its matmuls' and norms'
    # outputs), which torch captures at a micro-batch's input-gradient step and keeps to its
    # weight step (pipelining._backward.stage_backward_input, param_group["grads"]). A test sums
    # torch's own captured gradients.
    weight_grad_outputs: Acts = Acts()
    attn_flops: float = 0.0  # per sample, attention score/context FLOPs (part of fwd_flops)
    # per sample, FLOPs at the end of the forward that full recompute does not re-run: torch's
    # non-reentrant checkpoint stops recomputing once the last tensor backward needs is back
    # (a transformer block's fc2: its output is saved by nothing)
    recompute_skipped_flops: float = 0.0
    # per sample, FLOPs selective recompute re-runs under tensor parallelism: the row-parallel
    # matmuls whose reduced output is kept instead of their partial sums (runtime/recompute.py)
    selective_tp_recompute_flops: float = 0.0
    mp_allreduces: int = 0  # tensor-parallel all-reduces of a (seq, hidden) activation per forward
    boundary_elements: float = 0.0  # elements per sample sent to the next pipeline stage
    # elements per sample of the unit's own output, divided by mp, in the matmul dtype: the LM head's
    # logits, which torch's pipeline stage keeps (its fwd_cache) for each of the last stage's
    # micro-batches from its forward to its backward
    output_split: float = 0.0
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
    # the largest routed-expert weight [E, out, in] (split over ep ranks by ep; not by mp)
    largest_expert: int = 0
    # of the parameters, those a token does not use: a mixture of experts' experts it is not
    # routed to (top_k of num_experts are). Memory counts every parameter, FLOPs the active ones.
    inactive_params: int = 0
    # of the parameters, the routed experts' (in params_whole: split along the experts over
    # strategy.ep_degree ranks, not over mp), and the elements per sample one all-to-all of their rows moves (tokens · top_k ·
    # hidden: the rows leave for their experts' ranks and come back, forward and backward)
    expert_params: int = 0
    exchange_elements: float = 0.0

    @property
    def params(self) -> int:
        return self.params_split + self.params_whole

    @property
    def active_params(self) -> int:
        return self.params - self.inactive_params

    def largest_on_rank(self, mp: int, ep: int = 1) -> float:
        return max(self.largest_split / mp, self.largest_whole, self.largest_expert / ep)

    def fresh_grad_on_rank(self, mp: int, ep: int = 1) -> float:
        """Elements of the largest gradient tensor the unit's backward makes on this rank (the
        vocabulary-parallel embedding's is its own rows: models/tp_plan.py VocabParallelEmbedding)."""
        return self.largest_on_rank(mp, ep)

    def params_on_rank(self, mp: int, ep: int = 1) -> float:
        """Parameters a rank holds: the split ones by mp, the routed experts (whole over mp) by ep."""
        return self.params_split / mp + self.params_whole - self.expert_params * (1 - 1 / ep)

    def saved(self, recompute: str) -> Acts:
        held = self.acts.get(recompute)
        return held if held is not None else self.acts.get("none", NO_ACTS)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def largest(values: list[float]) -> float:
    return max(values) if values else 0.0


__all__ = [
    "Acts",
    "Unit",
    "ceil_div",
    "largest",
    "math",
]
