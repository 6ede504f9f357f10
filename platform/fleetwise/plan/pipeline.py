"""Pipeline arithmetic: which layers each stage holds, micro-batches in flight, and the bubble.

Stage placement follows torch.distributed.pipelining: with v chunks per rank, chunk c of the
pp·v chunks runs on rank c mod pp ("loop" placement: interleaved 1F1B, looped BFS, interleaved
zero bubble), except ZBV which folds the chunks into a V (rank r holds chunks r and 2pp-1-r).

The schedules are a typed value here (`PipelineSchedule`); the functions take the config's string
as well (a `StrEnum` member equals its name).
"""

from __future__ import annotations

from enum import StrEnum
from functools import cache
from typing import NamedTuple

from fleetwise.config.strategy import INTERLEAVED_SCHEDULES


class PipelineSchedule(StrEnum):
    """A pipeline schedule, by the name users write (config/strategy.py `Schedule`)."""

    GPIPE = "GPipe"
    ONE_F_ONE_B = "1F1B"
    INTERLEAVED_1F1B = "interleaved_1F1B"
    LOOPED_BFS = "looped_BFS"
    INTERLEAVED_ZERO_BUBBLE = "interleaved_zero_bubble"
    ZBV_ZERO_BUBBLE = "ZBV_zero_bubble"

    @property
    def multi_stage(self) -> bool:
        """Several chunks per rank (torch's PipelineScheduleMulti): the interleaved, looped BFS and
        zero-bubble schedules. They keep every send's Work to the end of the step."""
        return self in INTERLEAVED_SCHEDULES

    @property
    def zero_bubble(self) -> bool:
        """The backward split into an input-gradient and a weight-gradient pass (Qi et al. 2024)."""
        return self in (PipelineSchedule.INTERLEAVED_ZERO_BUBBLE, PipelineSchedule.ZBV_ZERO_BUBBLE)


def split_layers(num_layers: int, stages: int, explicit: list[int] | None = None) -> list[int]:
    """Layers per chunk: the explicit split, or as even as possible (earlier chunks take the extra)."""
    if explicit is not None:
        return list(explicit)
    base, extra = divmod(num_layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def chunk_ranks(schedule: str, pp: int, virtual: int) -> list[int]:
    """Pipeline rank that runs each chunk (index = chunk)."""
    chunks = pp * virtual
    if schedule == PipelineSchedule.ZBV_ZERO_BUBBLE:
        return [c if c < pp else 2 * pp - 1 - c for c in range(chunks)]
    return [c % pp for c in range(chunks)]


@cache  # the search asks it for every rank of every candidate (callers never mutate the dict)
def chunks_in_flight(schedule: str, pp: int, virtual: int, n: int, rank: int) -> dict[int, int]:
    """Micro-batches whose activations a rank holds at its peak, per local chunk index.

    From the schedules' warm-up phases in torch.distributed.pipelining:
    - GPipe runs every forward before any backward: n per chunk.
    - 1F1B: stage r does min(n, pp - r) forwards before its first backward.
    - Looped BFS: all n micro-batches of every local chunk before the backwards.
    - Interleaved 1F1B: warm-up of (v-1)·pp + 2·(pp-1-r) chunk-forwards, +1 in steady state
      (Narayanan et al. 2021).
    - Zero bubble: a micro-batch's activations stay until its weight-gradient step (torch keeps
      the graph from the input-gradient step to it), so what counts is forwards minus weight
      steps. Counted on the schedules' own action lists (torch 2.13, pp 2-8, v 2-3, n = 4-32):
      interleaved zero bubble peaks with a round (pp micro-batches, all n of a short round) on
      the first local chunk and pp on each other one, on every rank; ZBV with 2pp-1-r on its first
      chunk and r+1 on its second.
    Counts are in chunk-forwards; each chunk holds 1/v of the rank's layers.
    """
    if pp == 1:
        return {0: 1}
    if schedule == PipelineSchedule.GPIPE:
        return {0: n}
    if schedule == PipelineSchedule.ONE_F_ONE_B:
        return {0: min(n, pp - rank)}
    if schedule == PipelineSchedule.LOOPED_BFS:
        return {c: n for c in range(virtual)}
    if schedule == PipelineSchedule.ZBV_ZERO_BUBBLE:
        return {0: min(n, 2 * pp - 1 - rank), 1: min(n, rank + 1)}
    # interleaved: distribute the warm-up chunk-forwards over the local chunks, earliest first
    per_round = n // max(1, n // pp)
    if schedule == PipelineSchedule.INTERLEAVED_ZERO_BUBBLE:
        return {c: min(n, per_round if c == 0 else pp) for c in range(virtual)}
    total = min((virtual - 1) * per_round + 2 * (pp - 1 - rank) + 1, n * virtual)
    counts = {c: 0 for c in range(virtual)}
    c, left = 0, total
    while left > 0:
        take = min(per_round, left, n - counts[c])
        counts[c] += take
        left -= take
        c = (c + 1) % virtual
    return counts


def weight_steps_waiting(schedule: str, pp: int, virtual: int, n: int, rank: int) -> dict[int, int]:
    """Interleaved zero bubble: of the micro-batches in flight (`chunks_in_flight`), those whose
    input-gradient step has run and whose weight step has not, per local chunk, at the moment the
    rank's peak is: a weight step on its last local chunk. A waiting micro-batch keeps what its
    weight step reads (each weighted op's input and output gradient, `Unit.weight_grad_outputs`)
    and no longer what only its input gradients needed (the last stage's logits and log-softmax
    output). From torch 2.13's action lists (pp 2-8, v 2-3): rank r has r+1 waiting on its last
    local chunk there, and the others' in flight have run only their forwards. Empty for every
    other schedule (ZBV's peak moments differ by rank: not modelled)."""
    if pp == 1 or schedule != PipelineSchedule.INTERLEAVED_ZERO_BUBBLE:
        return {}
    last = virtual - 1
    return {last: min(rank + 1, chunks_in_flight(schedule, pp, virtual, n, rank)[last])}


class CoolDown(NamedTuple):
    """ZB-V's cool-down moment (`zbv_cool_down`), per local chunk."""

    in_flight: dict[int, int]  # micro-batches in flight
    waiting: dict[int, int]  # of those, waiting for their weight step (the step's own included)
    to_come: int  # chunk 0's input-gradient steps still to come


def zbv_cool_down(pp: int, n: int, rank: int) -> CoolDown | None:
    """ZB-V's second peak moment: in the cool-down torch runs several input-gradient steps before
    their weight steps, each waiting micro-batch keeping its output gradients. At the
    input-gradient step with the most of them waiting, per local chunk: the micro-batches in
    flight, those waiting (the step's own included: it is on chunk 0), and how many of chunk 0's
    input-gradient steps are still to come. From torch 2.13's action lists (pp 2-8, n = 2pp-4pp):
    rank r > 0 has pp and r in flight, r + 1 and r waiting, pp - 1 - r to come (pp 4, n 8: rank 3
    at 3I7, rank 1 at 1I5). None where that step is ZB-V's first moment (`chunks_in_flight`):
    rank 0 (its chunk 0 runs full backwards, nothing waits there) and n = pp (no cool-down)."""
    if rank == 0 or n < 2 * pp:
        return None
    return CoolDown({0: pp, 1: rank}, {0: rank + 1, 1: rank}, pp - 1 - rank)


class SendsMade(NamedTuple):
    """Sends a ZB-V rank has made by its first moment (`zbv_sends_made`), per local chunk."""

    outputs: dict[int, int]  # forward outputs sent on
    input_gradients: dict[int, int]  # input gradients sent back


def zbv_sends_made(pp: int, n: int, rank: int) -> SendsMade:
    """ZB-V's first moment (`chunks_in_flight`) is mid-step, at its last chunk-1 input-gradient
    step with that many in flight: the sends made by then, the step's own included, as (outputs,
    input gradients) per local chunk. From torch 2.13's action lists (pp 2-8, n = 2pp-8pp):
    outputs n on chunk 0 and n-pp+1+r on chunk 1, input gradients n-2pp+1+r and n-pp+1 (pp 4,
    n 8, rank 1: 21 sends, not 32). Only for n >= 2pp (below, there is no such steady moment)."""
    return SendsMade({0: n, 1: n - pp + 1 + rank}, {0: n - 2 * pp + 1 + rank, 1: n - pp + 1})


def bubble_fraction(schedule: str, pp: int, virtual: int, n: int) -> float:
    """Idle fraction of a pipeline step, assuming equal stage times and backward = 2 × forward.

    GPipe and 1F1B: (p-1)/(m+p-1) (Huang et al. 2019; Narayanan et al. 2021).
    Interleaved with v chunks: (p-1)/(v·m+p-1) (Narayanan et al. 2021, section 2.2.2).
    Zero-bubble schedules (Qi et al. 2024) fill the bubble with weight-gradient work: with
    F = B_input = B_weight a rank does 3·v·m units and, as torch's own action lists run (torch 2.13
    `pipeline_order`; the first chunk's input-gradient pass is a full backward, its weight pass
    none), idles p-1 of them: the pipeline's fill. ZB-V reaches that only from m = 2p; at m = p
    its two chunks cannot overlap and it idles as if one chunk did all the work. (The paper's ZB-V
    idles about none from m >= 2p; torch's list does not, and the planner used to follow the
    paper: 175B at pp 16, m = 32, 7.2% of the step uncharged.) `tests/unit/plan/test_planner.py`
    runs torch's lists; `scripts/bench.py` measures each schedule.
    """
    if pp == 1:
        return 0.0
    if schedule in (PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B):
        return (pp - 1) / (n + pp - 1)
    if schedule == PipelineSchedule.INTERLEAVED_ZERO_BUBBLE:
        return (pp - 1) / (3 * virtual * n + pp - 1)
    if schedule == PipelineSchedule.ZBV_ZERO_BUBBLE:
        return (pp - 1) / (3 * (virtual if n >= 2 * pp else 1) * n + pp - 1)
    return (pp - 1) / (virtual * n + pp - 1)
