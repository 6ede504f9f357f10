"""FLOP formulas torch's registry lacks, for every FLOP count fleetwise makes: the dry run's counters
(dryrun/counters.py) and the trace that measures your own model's planner units
(families/custom/derive.py) -- one set, so that the two agree on the same op.

torch.utils.flop_counter has the CUDA flash-attention kernels' formulas, not the CPU ones that
`F.scaled_dot_product_attention` dispatches to on a CPU (FlopCounterMode counts 0 for them). The same
counts as torch's flash attention: forward QK^T and scores·V; backward five such matmuls (the
scores recomputed, then the gradients of scores, V, Q and K). Formulas take shapes, as torch's own
(FlopCounterMode's custom_mapping wraps them; `shape_wrapper` for a caller holding tensors).
"""

from __future__ import annotations

import fleetwise.compat as compat


def cpu_attention_formulas() -> dict:
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, query, key, value)

    return {compat.SDPA_CPU: forward, compat.SDPA_CPU_BACKWARD: backward}
