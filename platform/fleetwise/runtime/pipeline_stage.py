"""A pipeline stage whose receive buffers are bounded by the micro-batches in flight.

torch.distributed.pipelining's `PipelineStage` allocates, when a schedule first runs, one receive
buffer per micro-batch of the step for the activations a stage receives and one for the gradients
it receives (`_setup_forward_recv_info`, `_setup_backward_recv_info`), and keeps them all for the
life of the stage: n micro-batches × the boundary activation, twice, whatever the schedule.
Under 1F1B only the micro-batches whose backward has not run yet need one -- at most pp of them on
the first stage -- so for GPT-3 175B (n = 192 per pipeline, pp 16) the buffers alone were 18 GiB.

`ReusingStage` changes only where the buffers come from, not the schedules: a micro-batch's set of
buffers is taken, when the schedule first asks for it (posting the receive), from the sets that
earlier micro-batches have finished with, or allocated when none is free; it is given back when the
micro-batch's backward is done (its weight backward, for the zero-bubble schedules that split it).
A buffer is therefore never written by a receive while autograd still holds it, and the number of
sets is the most micro-batches a schedule has between a receive and the end of their backward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch.distributed.pipelining.stage import PipelineStage

from fleetwise.compat import RECV_POOL_CHECKED, VERSION, pooled_recv_stage

log = logging.getLogger(__name__)


class RecvSlots(dict):
    """micro-batch -> its tuple of receive infos (torch's, each with a `buffer`), handed out lazily
    from a pool."""

    def __init__(self, make: Callable[[], tuple]):
        super().__init__()
        self.make = make
        self.free: list[tuple] = []
        self.allocated = 0  # sets of buffers made so far (the pool's high-water mark)

    def __missing__(self, mb: int) -> tuple:
        if self.free:
            infos = self.free.pop()
        else:
            infos = self.make()
            self.allocated += 1
        self[mb] = infos
        return infos

    def release(self, mb: int) -> None:
        infos = self.pop(mb, None)
        if infos is None:
            return
        for info in infos:
            if info.buffer is not None:
                info.buffer.grad = None  # autograd accumulates into a leaf's .grad: start clean
        self.free.append(infos)

    def held(self) -> list[tuple]:
        """Every set this stage keeps, handed out or free (what its memory holds)."""
        return [*self.values(), *self.free]


class ReusingStage(pooled_recv_stage() or PipelineStage):
    """`PipelineStage` with pooled receive buffers (see the module's docstring). torch makes the
    buffers in private methods that differ between versions: `compat.pooled_recv_stage()` adapts
    them (checked on torch 2.11 and 2.13) and hands the sets to the two hooks below. Where it cannot
    (None: another shape), `make_stage` runs torch's own stage instead."""

    def pool_activations(self, first: tuple, make: Callable[[], tuple]) -> RecvSlots:
        slots = RecvSlots(make)
        slots.free.append(first)
        slots.allocated = 1
        return slots

    def pool_gradients(self, make: Callable[[], tuple]) -> RecvSlots:
        slots = RecvSlots(make)
        slots[0]  # made now, where torch makes them: the metadata is checked before the first step
        slots.release(0)
        return slots

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not self.has_backward:  # forward only: the received activations are used up
            self._release(fwd_chunk_id)
        return out

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False
    ):
        out = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if full_backward:
            self._release(bwd_chunk_id)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        # torch computes a micro-batch's weight gradients with one autograd.grad call per group of
        # parameters (pipelining._backward.stage_backward_weight), and a checkpointed block
        # (strategy.recompute) re-runs its forward once per backward call that unpacks it: once
        # per parameter group, each re-run's unused tensors held until the micro-batch is done.
        # Under one GraphExecGroup every block is recomputed once for all of them (the groups
        # read disjoint saved tensors, which the group requires).
        from torch.utils.checkpoint import GraphExecGroup

        with GraphExecGroup():
            out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        self._release(bwd_chunk_id)
        return out

    def _release(self, mb: int) -> None:
        for infos in (self.args_recv_info, self.grad_recv_info):
            if isinstance(infos, RecvSlots):
                infos.release(mb)

    def buffer_sets(self) -> dict[str, int]:
        """Sets of receive buffers made so far: {"activations": …, "gradients": …}."""
        return {
            name: infos.allocated if isinstance(infos, RecvSlots) else 0
            for name, infos in (("activations", self.args_recv_info), ("gradients", self.grad_recv_info))
        }


class PlainStage(PipelineStage):
    """torch's own PipelineStage: a buffer set per micro-batch, kept for the stage's life. Used on
    a torch whose receive-buffer internals `compat.pooled_recv_stage()` does not know."""

    noted = False  # one note per process

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not PlainStage.noted:
            PlainStage.noted = True
            log.warning(
                "pipeline receive buffers are not pooled on torch %s (checked on %s): one set per "
                "micro-batch is held for the whole step, more than the plan counts",
                VERSION,
                ", ".join(RECV_POOL_CHECKED),
            )

    def buffer_sets(self) -> dict[str, int]:
        return {"activations": len(self.args_recv_info), "gradients": len(self.grad_recv_info)}


def make_stage(*args, **kwargs) -> PipelineStage:
    """The stage fleetwise runs: ReusingStage where this torch's buffers can be pooled, else torch's."""
    return (ReusingStage if pooled_recv_stage() else PlainStage)(*args, **kwargs)
