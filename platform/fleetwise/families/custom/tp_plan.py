"""Your `model.tp_plan` as torch's tensor-parallel styles: patterns -> ColwiseParallel,
RowwiseParallel or SequenceParallel (parallelize_module reads `*` as any one name part)."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel


def tp_plan(plan: dict[str, str]) -> dict:
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence": SequenceParallel}
    return {pattern: styles[style]() for pattern, style in plan.items()}
