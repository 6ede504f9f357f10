"""Pipeline probes: torch.distributed.pipelining's host time per schedule action, and the extra
time of a zero-bubble schedule's split backward."""

from __future__ import annotations

import torch

from fleetwise.calibrate.probes.timing import interleaved, timed
from fleetwise.calibrate.probes.workloads import OpCounter


def zero_bubble_split_cost(overhead_us: float, reps: int = 15) -> tuple[float, float]:
    """(µs per forward op, ns per parameter): the extra time of a transformer block's backward
    (fleetwise's own PreLNBlock) when a zero-bubble schedule splits it, beyond one full backward.
    torch's split (pipelining._backward: an input-gradient pass that keeps the graph and the
    parameter groups' intermediates, then a weight-gradient pass per group, under one
    GraphExecGroup as runtime/pipeline_stage.py runs it) walks the graph twice -- a host cost per
    op, taken at a width where FLOPs are negligible -- and costs a memory-bound pass over the
    block's weights on top, taken from the same block at width 256 less its per-op part. A 6-layer
    d=512 GPT on 2 CPU ranks measured ~4 ms per block and micro-batch more under interleaved zero
    bubble than under 1F1B; one such block alone, 2.4-4.2 ms (d=256: 2.1, d=768: 6.2)."""
    from torch.utils.checkpoint import GraphExecGroup

    from fleetwise.compat import stage_backward_split
    from fleetwise.models.transformer import PreLNBlock

    stage_backward, stage_backward_input, stage_backward_weight = stage_backward_split()

    def extra(blocks: int, width: int, tokens: int) -> tuple[float, int, int]:
        """Seconds the split adds, forward ops, parameters."""
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(PreLNBlock(width, 2, 4 * width) for _ in range(blocks)))
        x = torch.randn(2, tokens, width, requires_grad=True)
        grad = torch.randn(2, tokens, width)

        def full():
            stage_backward([model(x)], [grad], [x])

        def split():
            _, groups = stage_backward_input([model(x)], [grad], [x], model.parameters())
            with GraphExecGroup():
                stage_backward_weight(model.parameters(), groups)

        with OpCounter() as ops:  # with autograd on, as the planner's per-unit op counts are
            model[0](x)
        t_full, t_split = interleaved([full, split], reps)
        return t_split - t_full, blocks * ops.count, sum(p.numel() for p in model.parameters())

    # a zero-bubble pipeline has two ranks or more: measured at the threads each of two ranks gets
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))
    try:
        seconds, ops, _ = extra(8, 16, 8)
        per_op = max(0.0, seconds / ops)
        seconds, ops, params = extra(1, 512, 128)
        per_param = max(0.0, (seconds - ops * per_op) / params)
    finally:
        torch.set_num_threads(threads)
    return per_op * 1e6, per_param * 1e9


def pipeline_action_us(
    latency_s: float, microbatches: int = 8, width: int = 16, reps: int = 10
) -> tuple[float, float]:
    """Host time per schedule action of torch.distributed.pipelining (a micro-batch's forward or
    backward on one stage, with its send or receive), beyond the stage's own compute and the P2P
    latency: (single-stage 1F1B's, and what the multi-stage schedules spend on top). Run on every
    rank: the ranks are the stages of a pipeline of tiny layers, one per chunk, whose compute is
    negligible, so a step's time is almost all per-action overhead. With equal forward and backward
    actions a 1F1B step lasts 2 (n + pp - 1) action slots, an interleaved 1F1B one with v chunks per
    rank 2 (v n + pp - 1): the planner's actions / (1 - bubble). The multi-stage probe is interleaved
    1F1B with 2 chunks per rank (torch's PipelineScheduleMulti, which every interleaved and
    zero-bubble schedule runs on: 2 CPU ranks measured ~1.1 ms a slot there vs ~0.65 ms under 1F1B)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    x, target = torch.randn(2 * microbatches, width), torch.zeros(2 * microbatches, width)

    def layer() -> nn.Module:
        return nn.Sequential(nn.Linear(width, width), nn.Tanh())

    def timed_step(schedule) -> float:
        def step():
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=target, losses=[])
            else:
                schedule.step()
            dist.barrier()

        return timed(step, reps, typical=True)

    def loss(out, _):
        return out.sum()

    torch.manual_seed(0)
    part = layer()
    single = Schedule1F1B(PipelineStage(part, rank, world, torch.device("cpu")), microbatches, loss_fn=loss)
    chunks = [PipelineStage(layer(), i, 2 * world, torch.device("cpu")) for i in (rank, rank + world)]
    multi = ScheduleInterleaved1F1B(chunks, microbatches, loss_fn=loss)
    micro = x[:2]
    t_local = timed(lambda: part(micro).sum().backward(), reps * microbatches, typical=True)
    per_single = timed_step(single) / (2 * (microbatches + world - 1))
    per_multi = timed_step(multi) / (2 * (2 * microbatches + world - 1))
    base = max(0.0, per_single - t_local / 2 - latency_s)
    return base * 1e6, max(0.0, per_multi - per_single) * 1e6
