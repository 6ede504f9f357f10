"""Planner numbers against values computed by hand (the arithmetic is spelled out here)."""

import pytest
from helpers.config import compose

from fleetwise.config.layout import Layout
from fleetwise.plan import make_plan
from fleetwise.plan.chunks import assign_units
from fleetwise.plan.memory.buffers import recv_buffer_sets
from fleetwise.plan.memory.ranks import pipeline_rank_memory
from fleetwise.plan.pipeline import (
    bubble_fraction,
    chunk_ranks,
    chunks_in_flight,
    split_layers,
    weight_steps_waiting,
    zbv_cool_down,
    zbv_sends_made,
)


def plan_of(*overrides):
    cfg, problems = compose(*overrides)
    assert problems == [], problems
    return cfg, make_plan(cfg)


def test_tiny_gpt_parameter_count():
    # V=256 (already a multiple of 64), h=64, s=32, L=4, f=256
    emb_and_head = 2 * 256 * 64
    positions = 32 * 64
    per_layer = 4 * 64 * 64 + 2 * 64 * 256 + 9 * 64 + 256  # q,k,v,o + fc1,fc2 + biases/LNs
    assert per_layer == 49_984
    _, plan = plan_of("recipe=gpt/tiny")
    assert plan.params == emb_and_head + positions + 4 * per_layer + 2 * 64 == 234_880


def test_gpt3_175b_parameters_and_flops():
    _, plan = plan_of("recipe=gpt/gpt3_175b")
    h, L, s, v = 12288, 96, 2048, 50304  # vocab 50257 padded to a multiple of 64
    per_layer = 12 * h * h + 13 * h
    assert plan.params == L * per_layer + 2 * v * h + s * h + 2 * h == 175_222_972_416
    # model FLOPs: tokens × (6 × matmul params + 12·L·s·h attention)
    n_matmul = L * 12 * h * h + v * h
    tokens = 1536 * s
    assert plan.flops_per_step == pytest.approx(tokens * (6 * n_matmul + 12 * L * s * h), rel=1e-12)
    assert plan.flops_per_step == pytest.approx(3.386e18, rel=1e-3)


@pytest.mark.parametrize("recipe,params", [("resnet/resnet50", 25_557_032), ("resnet/resnet101", 44_549_160)])
def test_resnet_parameter_counts_match_torchvision(recipe, params):
    _, plan = plan_of(f"recipe={recipe}")
    assert plan.params == params


def test_resnet50_forward_is_4_1_gmacs():
    _, plan = plan_of("recipe=resnet/resnet50")
    per_sample_fwd = plan.flops_per_step / 256 / 3
    assert per_sample_fwd / 2 == pytest.approx(4.09e9, rel=0.01)


def test_ddp_memory_of_tiny_gpt_by_hand():
    cfg, plan = plan_of("recipe=gpt/tiny")
    p = 234_880
    params, grads, adam = 4 * p, 4 * p, 8 * p
    b, s, h, f, a, v, L = 2, 32, 64, 256, 4, 256, 4
    # q, k, v, SDPA output (the out-projection reads a view of it), log-sum-exp, fc1 and GELU
    # outputs; the two norms' inputs; their outputs and mean/rstd
    block = (3 * s * h + s * h + a * s + 2 * s * f) + 2 * s * h + (2 * s * h + 4 * s)
    head = s * v + s * h + (s * h + 2 * s)
    saved = 4 * b * (L * block + head)
    logits_transient = 4 * b * 2 * s * v
    m = plan.memory_bytes
    assert (m["params"], m["grads"], m["optimizer"]) == (params, grads, adam)
    assert m["activations"] == saved + logits_transient
    # DDP's gradients are its all-reduce buckets, held for the whole job (zeroed in place, not
    # freed: runtime/optim.py), so the forward/backward peak holds everything at once -- once:
    # no second copy of the gradients (the dry run and a real gloo run agree to the byte)
    inputs = b * 2 * 8 * s  # this rank's batch: int64 tokens and labels (one micro-batch on 8 ranks)
    assert m["inputs"] == inputs
    assert m["total"] == params + grads + adam + saved + logits_transient + inputs
    assert plan.engine == "ddp"
    assert plan.comm_bytes_per_step["dp"] == int(2 * 7 / 8 * grads)


def test_sharding_stages_shrink_model_states():
    totals = {}
    for stage in (1, 2, 3):
        _, plan = plan_of("recipe=gpt/gpt3_1.3b", f"strategy.sharding_stage={stage}")
        totals[stage] = plan.memory_bytes
    # stage 1 and 2/3 all shard the AdamW state 8 ways; ZeRO-1 counts its fp32 masters there too
    # (bf16: 4 + 8 bytes over 8 ranks; FSDP's sharded fp32 parameters are under params)
    assert totals[2]["optimizer"] == totals[3]["optimizer"]
    assert totals[1]["optimizer"] == pytest.approx(totals[2]["optimizer"] * 12 / 8, rel=1e-9)
    # stage 1 keeps whole fp32 gradients, stages 2/3 an eighth of them
    assert totals[1]["grads"] == 8 * totals[2]["grads"]
    # stage 3 gathers two layers at a time instead of the whole model
    assert totals[3]["params"] < totals[2]["params"]


@pytest.mark.parametrize(("precision", "working", "master"), [("fp32", 4, 0), ("bf16", 2, 4)])
def test_zero1_memory_and_traffic_by_hand(precision, working, master):
    """ZeRO-1 (runtime/zero1.py, Megatron's distributed optimizer) on dp 2 x sharding 4: working
    weights (2 B under bf16, 4 B under fp32) and the fp32 gradient buffer whole; fp32 masters (bf16
    only: under fp32 the working weights are their own) and AdamW's two moments over d = 4 --
    Megatron's 6 + 12/d and 8 + 8/d bytes per parameter (the reduce-scatter is in place). Per step: reduce-scatter of the fp32 gradients and
    all-gather of the working weights over sharding, all-reduce of the shard over dp."""
    cfg, plan = plan_of(
        "recipe=gpt/tiny",
        "strategy=hybrid",
        "strategy.dp_degree=2",
        "strategy.sharding_degree=4",
        "strategy.sharding_stage=1",
        "hardware.devices_per_node=8",
        f"train.precision={precision}",
        "hardware.has_bf16=true",
    )
    p, d = 234_880, 4
    m = plan.memory_bytes
    assert plan.engine == "zero1"
    assert m["params"] == working * p
    assert m["grads"] == 4 * p
    assert m["optimizer"] == (master + 8) * p / d
    assert working * p + 4 * p + m["optimizer"] == {"fp32": 8 + 8 / d, "bf16": 6 + 12 / d}[precision] * p
    comm = plan.comm_bytes_per_step
    # gloo (this profile): all-reduces of the gradient buffer and of the working weights' buffer
    # instead (gloo's reduce-scatter and all-gather are slower than its all-reduce); NCCL: a
    # reduce-scatter and an all-gather
    assert comm["sharding"] == int(2 * (d - 1) / d * (4 * p + working * p))
    assert comm["dp"] == int(2 * (2 - 1) / 2 * 4 * p / d)
    nccl = make_plan(cfg.model_copy(update={"hardware": cfg.hardware.model_copy(update={"backend": "nccl"})}))
    assert nccl.comm_bytes_per_step["sharding"] == int((d - 1) / d * (4 * p + working * p))


def test_tensor_and_pipeline_parallel_divide_parameters():
    _, p1 = plan_of("recipe=gpt/gpt3_13b")  # mp 8 × pp 2
    per_rank = [st["params_per_device"] for st in p1.stages]
    assert len(per_rank) == 2
    assert sum(per_rank) * 8 == pytest.approx(p1.params, rel=0.01)  # replicated LNs/biases are tiny


def test_pipeline_schedule_arithmetic():
    assert split_layers(10, 4) == [3, 3, 2, 2]
    assert split_layers(8, 2, [5, 3]) == [5, 3]
    assert chunk_ranks("interleaved_1F1B", 2, 2) == [0, 1, 0, 1]
    assert chunk_ranks("ZBV_zero_bubble", 2, 2) == [0, 1, 1, 0]
    assert bubble_fraction("1F1B", 4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("GPipe", 4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1F1B", 4, 2, 8) == pytest.approx(3 / 19)
    assert chunks_in_flight("GPipe", 4, 1, 8, 0) == {0: 8}
    assert chunks_in_flight("1F1B", 4, 1, 8, 0) == {0: 4}
    assert chunks_in_flight("1F1B", 4, 1, 8, 3) == {0: 1}
    # interleaved, pp=2, v=2, n=4, rank 0: warm-up (v-1)·pp + 2(pp-1-r) = 4 chunk-forwards, +1
    assert sum(chunks_in_flight("interleaved_1F1B", 2, 2, 4, 0).values()) == 5


def _torch_peak_in_flight(schedule: str, pp: int, v: int, n: int, rank: int) -> dict[int, int]:
    """Per local chunk, the micro-batches whose activations torch's own action list for `rank`
    holds (forwards run, weight gradients not yet: a zero-bubble input-gradient step keeps the
    graph) at the moment the rank holds the most."""
    from collections import defaultdict

    from torch.distributed.pipelining import schedules as S

    from fleetwise.dryrun import patches

    cls = {
        "interleaved_1F1B": S.ScheduleInterleaved1F1B,
        "interleaved_zero_bubble": S.ScheduleInterleavedZeroBubble,
        "ZBV_zero_bubble": S.ScheduleZBVZeroBubble,
    }[schedule]
    held: dict[int, int] = defaultdict(int)
    best, at = -1, {}
    for action in patches.action_lists(cls, pp, v, n)[rank]:
        kind = action.computation_type
        if kind == S.FORWARD:
            held[action.stage_index] += 1
        if kind in (S.FULL_BACKWARD, S.BACKWARD_WEIGHT):
            held[action.stage_index] -= 1
        if sum(held.values()) > best:
            best, at = sum(held.values()), dict(held)
    return {i: at.get(stage, 0) for i, stage in enumerate(sorted(held))}


@pytest.mark.parametrize("schedule", ["interleaved_1F1B", "interleaved_zero_bubble", "ZBV_zero_bubble"])
def test_micro_batches_in_flight_follow_torchs_action_lists(schedule):
    cases = [(2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 16), (8, 2, 32)]
    if schedule != "ZBV_zero_bubble":  # ZBV is defined for v = 2 only
        cases.append((4, 3, 8))
    for pp, v, n in cases:
        for rank in range(pp):
            want = _torch_peak_in_flight(schedule, pp, v, n, rank)
            assert chunks_in_flight(schedule, pp, v, n, rank) == want, (pp, v, n, rank)


def test_zero_bubble_weight_steps_waiting_follow_torchs_action_lists():
    """At each weight step on the rank's last local chunk, per local chunk: the micro-batches in
    flight (forward run, weight step not) and of those the ones waiting (input-gradient step run):
    the planner's moment is the one of those holding the most in flight."""
    from torch.distributed.pipelining import schedules as S

    from fleetwise.dryrun import patches

    for pp, v, n in [(2, 2, 4), (2, 2, 8), (2, 2, 32), (4, 2, 8), (4, 2, 16), (4, 3, 8), (8, 2, 32)]:
        lists = patches.action_lists(S.ScheduleInterleavedZeroBubble, pp, v, n)
        for rank in range(pp):
            stages = [rank + pp * i for i in range(v)]
            fwd, inp, best = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0), None
            for a in lists[rank]:
                if a.computation_type == S.FORWARD:
                    fwd[a.stage_index] += 1
                if a.computation_type == S.BACKWARD_INPUT:
                    inp[a.stage_index] += 1
                if a.computation_type == S.BACKWARD_WEIGHT:
                    if a.stage_index == stages[-1]:  # the moment: its weight step about to run
                        moment = ({i: fwd[st] for i, st in enumerate(stages)}, inp[stages[-1]])
                        if best is None or sum(moment[0].values()) > sum(best[0].values()):
                            best = moment
                    fwd[a.stage_index] -= 1
                    inp[a.stage_index] -= 1
            flight, waiting = best
            assert chunks_in_flight("interleaved_zero_bubble", pp, v, n, rank) == flight, (pp, v, n, rank)
            assert weight_steps_waiting("interleaved_zero_bubble", pp, v, n, rank) == {v - 1: waiting}, (
                pp,
                v,
                n,
                rank,
            )
    assert (
        weight_steps_waiting("1F1B", 4, 1, 8, 3) == {} == weight_steps_waiting("ZBV_zero_bubble", 2, 2, 8, 1)
    )


def _receive_pool_high_water(actions: list) -> dict[tuple[str, int], int]:
    """("act" | "grad", stage) -> the most receive sets runtime/pipeline_stage.py's pool holds at
    once over one rank's lowered action list: a set taken at a micro-batch's RECV_F / RECV_B, given
    back at its weight step."""
    from torch.distributed.pipelining import schedules as S

    live: dict[tuple[str, int], set[int]] = {}
    most: dict[tuple[str, int], int] = {}
    for a in actions:
        key = {S.RECV_F: "act", S.RECV_B: "grad"}.get(a.computation_type)
        if key:
            held = live.setdefault((key, a.stage_index), set())
            held.add(a.microbatch_index)
            most[key, a.stage_index] = max(most.get((key, a.stage_index), 0), len(held))
        if a.computation_type == S.BACKWARD_WEIGHT:
            for k in ("act", "grad"):
                live.get((k, a.stage_index), set()).discard(a.microbatch_index)
    return most


def test_zero_bubble_receive_buffer_sets_follow_torchs_lowered_action_lists():
    """runtime/pipeline_stage.py takes a set of receive buffers at a micro-batch's RECV action and
    gives it back at its weight step; its pool's high-water mark per chunk, from torch's own
    lowered lists (with the sends and receives), is what the planner counts: the first local
    chunk's activation sets, the last one's, and every chunk's gradient sets."""
    from torch.distributed.pipelining import schedules as S

    from fleetwise.dryrun import patches

    for pp, v, n in [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 16), (8, 2, 32), (4, 3, 8)]:
        compute = patches.action_lists(S.ScheduleInterleavedZeroBubble, pp, v, n)
        lowered = patches.lowered_action_lists(
            compute, stage_to_rank=lambda st, pp=pp: st % pp, num_stages=pp * v
        )
        for rank, actions in lowered.items():
            most = _receive_pool_high_water(actions)
            flight = chunks_in_flight("interleaved_zero_bubble", pp, v, n, rank)
            for i in range(v):
                stage = rank + pp * i
                acts, grads = recv_buffer_sets("interleaved_zero_bubble", n, flight[i], rank, i, v)
                if stage < pp * v - 1:
                    assert most.get(("grad", stage), 0) == grads, (pp, v, n, rank, i)
                if stage > 0 and i in (0, v - 1):  # a middle chunk's is bounded: 2 x in flight
                    assert most.get(("act", stage), 0) == acts, (pp, v, n, rank, i)
                elif stage > 0:
                    assert most.get(("act", stage), 0) <= acts, (pp, v, n, rank, i)


def _zbv_action_lists(pp: int, n: int) -> dict:
    """torch 2.13's ZB-V action lists per rank, without a process group (local chunk 0 is stage r,
    1 is stage 2pp-1-r)."""
    from torch.distributed.pipelining import schedules as S

    from fleetwise.dryrun import patches

    return patches.action_lists(S.ScheduleZBVZeroBubble, pp, 2, n)


ZBV_CASES = [(2, 4), (2, 8), (2, 16), (3, 6), (4, 8), (4, 16), (8, 16), (8, 32)]


def test_zbv_weight_steps_follow_their_input_gradient_steps_at_once():
    """ZB-V runs each input-gradient step's weight step right after it (in the cool-down after a
    few more input-gradient steps): no micro-batch waits for one at the planner's moment, which is
    inside an input-gradient step (weight_steps_waiting is empty; the transient is what it keeps
    for its weight step). Micro-batches in flight: test_micro_batches_in_flight_follow_torchs_action_lists."""
    from torch.distributed.pipelining import schedules as S

    for pp, n in ZBV_CASES:
        for rank, actions in _zbv_action_lists(pp, n).items():
            steady = [a for a in actions if a.computation_type == S.FORWARD][
                -1
            ]  # the cool-down starts after it
            steady_end = actions.index(steady)
            for a, after in zip(actions[:steady_end], actions[1 : steady_end + 1], strict=True):
                if a.computation_type == S.BACKWARD_INPUT:
                    assert after.computation_type == S.BACKWARD_WEIGHT, (pp, n, rank, str(a))
                    assert (after.stage_index, after.microbatch_index) == (a.stage_index, a.microbatch_index)
            assert weight_steps_waiting("ZBV_zero_bubble", pp, 2, n, rank) == {}


def test_zbv_sends_made_at_the_first_moment_follow_torchs_action_lists():
    """ZB-V's first moment: the last chunk-1 input-gradient step with chunks_in_flight's counts in
    flight (forwards minus weight steps). The sends made by then, that step's own included, are
    its forwards (outputs) and input-gradient steps (input gradients) per chunk."""
    from torch.distributed.pipelining import schedules as S

    for pp in (2, 3, 4, 8):
        for n in (2 * pp, 3 * pp, 4 * pp, 5 * pp, 8 * pp):
            for rank, actions in _zbv_action_lists(pp, n).items():
                stages = (rank, 2 * pp - 1 - rank)
                flight = chunks_in_flight("ZBV_zero_bubble", pp, 2, n, rank)
                done = {k: {st: 0 for st in stages} for k in (S.FORWARD, S.BACKWARD_INPUT, S.BACKWARD_WEIGHT)}
                made = None
                for a in actions:
                    done[a.computation_type][a.stage_index] += 1
                    live = [done[S.FORWARD][st] - done[S.BACKWARD_WEIGHT][st] for st in stages]
                    if (
                        a.computation_type == S.BACKWARD_INPUT
                        and a.stage_index == stages[1]
                        and live == [flight[0], flight[1]]
                    ):
                        made = [
                            {i: done[k][st] for i, st in enumerate(stages)}
                            for k in (S.FORWARD, S.BACKWARD_INPUT)
                        ]
                assert made == list(zbv_sends_made(pp, n, rank)), (pp, n, rank)


def test_zbv_cool_down_moment_follows_torchs_action_lists():
    """ZB-V's cool-down runs input-gradient steps ahead of their weight steps: at the one with the
    most micro-batches waiting (its own included), torch's list holds what zbv_cool_down says --
    in flight and waiting per local chunk, and chunk 0's input-gradient steps still to come."""
    from torch.distributed.pipelining import schedules as S

    for pp, n in [*ZBV_CASES, (4, 4), (8, 8), (4, 12), (8, 24)]:
        for rank, actions in _zbv_action_lists(pp, n).items():
            stages = [rank, 2 * pp - 1 - rank]
            flight, waiting, best = dict.fromkeys(stages, 0), dict.fromkeys(stages, 0), None
            for at, a in enumerate(actions):
                if a.computation_type == S.FORWARD:
                    flight[a.stage_index] += 1
                if a.computation_type == S.BACKWARD_INPUT:
                    waiting[a.stage_index] += 1
                    if rank == 0 and a.stage_index == 0:
                        continue  # stage 0's is a full backward: nothing waits (block_recomputes)
                    if best is None or sum(waiting.values()) > sum(best[1].values()):
                        to_come = sum(
                            b.computation_type == S.BACKWARD_INPUT and b.stage_index == rank
                            for b in actions[at + 1 :]
                        )
                        best = (dict(flight), dict(waiting), to_come)
                if a.computation_type == S.BACKWARD_WEIGHT:
                    flight[a.stage_index] -= 1
                    waiting[a.stage_index] -= 1
            moment = tuple({i: m[st] for i, st in enumerate(stages)} for m in best[:2]) + (best[2],)
            first = chunks_in_flight("ZBV_zero_bubble", pp, 2, n, rank)
            if zbv_cool_down(pp, n, rank) is None:  # the most waiting is one: ZB-V's first moment
                assert moment[:2] == (first, {0: 0, 1: 1}), (pp, n, rank, moment)
            else:
                assert zbv_cool_down(pp, n, rank) == moment, (pp, n, rank, moment)


def test_zbv_receive_buffer_sets_follow_torchs_lowered_action_lists():
    """As for interleaved zero bubble: a set taken at a micro-batch's RECV, given back at its weight
    step; the pool's high-water mark per chunk is recv_buffer_sets' count, wherever the neighbour
    is another rank. Rank pp-1 hands its middle boundary to itself (no receive): torch puts the
    tensor it hands over into the receiving chunk's set, taken at the handing chunk's forward
    (activations) or input-gradient step (gradients)."""
    from torch.distributed.pipelining import schedules as S

    from fleetwise.dryrun import patches

    for pp, n in [*ZBV_CASES, (2, 2), (4, 4)]:
        # rank pp-1: stage pp's activation set from stage pp-1's forward to its own weight step,
        # stage pp-1's gradient set from stage pp's input-gradient step to its own weight step
        taken = {(S.FORWARD, pp - 1): "act", (S.BACKWARD_INPUT, pp): "grad"}
        given_back = {pp: "act", pp - 1: "grad"}
        live, most = {"act": set(), "grad": set()}, {"act": 0, "grad": 0}
        for a in _zbv_action_lists(pp, n)[pp - 1]:
            key = taken.get((a.computation_type, a.stage_index))
            if key:
                live[key].add(a.microbatch_index)
                most[key] = max(most[key], len(live[key]))
            if a.computation_type == S.BACKWARD_WEIGHT:
                live[given_back[a.stage_index]].discard(a.microbatch_index)
        flight = chunks_in_flight("ZBV_zero_bubble", pp, 2, n, pp - 1)
        last = pp - 1
        assert (
            recv_buffer_sets("ZBV_zero_bubble", n, flight[1], last, 1, 2, (True, False), pp)[0] == most["act"]
        )
        assert (
            recv_buffer_sets("ZBV_zero_bubble", n, flight[0], last, 0, 2, (False, True), pp)[1]
            == most["grad"]
        )
        compute = _zbv_action_lists(pp, n)
        on_rank = lambda st, pp=pp: st if st < pp else 2 * pp - 1 - st  # noqa: E731
        lowered = patches.lowered_action_lists(compute, stage_to_rank=on_rank, num_stages=2 * pp)
        for rank, actions in lowered.items():
            most = _receive_pool_high_water(actions)
            flight = chunks_in_flight("ZBV_zero_bubble", pp, 2, n, rank)
            for i, stage in enumerate([rank, 2 * pp - 1 - rank]):
                acts, grads = recv_buffer_sets("ZBV_zero_bubble", n, flight[i], rank, i, 2, pp=pp)
                if stage > 0 and on_rank(stage - 1) != rank:
                    assert most.get(("act", stage), 0) == acts, (pp, n, rank, i)
                if stage < 2 * pp - 1 and on_rank(stage + 1) != rank:
                    assert most.get(("grad", stage), 0) == grads, (pp, n, rank, i)


def _idle_fraction(lists: dict, last_stage: int) -> float:
    """Run the lists with F = I = W = 1 per chunk and micro-batch (stage 0's input-gradient pass
    a full backward of 2, its weight pass nothing: block_recomputes) and each action waiting for
    the one it consumes: the slowest rank's idle share of the step."""
    from torch.distributed.pipelining import schedules as S

    done, clock, busy, at = {}, dict.fromkeys(lists, 0.0), dict.fromkeys(lists, 0.0), dict.fromkeys(lists, 0)
    moved = True
    while moved:
        moved = False
        for r, acts in lists.items():
            while at[r] < len(acts):
                a = acts[at[r]]
                s, m, kind = a.stage_index, a.microbatch_index, a.computation_type
                if kind == S.FORWARD:
                    key, dep, cost = "F", (s - 1, "F", m) if s else None, 1.0
                elif kind in (S.BACKWARD_INPUT, S.FULL_BACKWARD):
                    dep = (s, "F", m) if s == last_stage else (s + 1, "I", m)
                    key, cost = "I", 2.0 if (kind == S.FULL_BACKWARD or s == 0) else 1.0
                else:
                    key, dep, cost = "W", (s, "I", m), 0.0 if s == 0 else 1.0
                if dep is not None and dep not in done:
                    break
                clock[r] = max(clock[r], done[dep] if dep else 0.0) + cost
                done[(s, key, m)] = clock[r]
                busy[r] += cost
                at[r] += 1
                moved = True
    assert all(at[r] == len(acts) for r, acts in lists.items()), "the action lists deadlock"
    return 1 - max(busy.values()) / max(clock.values())


def test_zero_bubble_bubbles_are_those_of_torchs_own_action_lists():
    """The planner's bubble of torch's multi-stage schedules against their own action lists, at
    every legal micro-batch count (a multiple of pp) up to 4·pp. ZB-V used to plan none from
    m = 2p (the paper's), where torch's list idles the pipeline fill: 7.2% at pp 16, m = 32."""
    from torch.distributed.pipelining import schedules as S

    from fleetwise.dryrun import patches

    for name, cls, vs in [
        ("interleaved_zero_bubble", S.ScheduleInterleavedZeroBubble, (2, 3)),
        ("ZBV_zero_bubble", S.ScheduleZBVZeroBubble, (2,)),
        ("interleaved_1F1B", S.ScheduleInterleaved1F1B, (2, 3)),
    ]:
        for pp in (2, 4, 8, 16):
            for v in vs:
                for n in (pp, 2 * pp, 3 * pp, 4 * pp):
                    real = _idle_fraction(patches.action_lists(cls, pp, v, n), pp * v - 1)
                    assert bubble_fraction(name, pp, v, n) == pytest.approx(real, abs=1e-9), (name, pp, v, n)
    assert bubble_fraction("ZBV_zero_bubble", 16, 2, 32) == pytest.approx(15 / 207)


def test_gpipe_keeps_more_activations_than_1f1b():
    base = (
        "recipe=gpt/tiny",
        "strategy=pp",
        "strategy.pp_degree=2",
        "strategy.dp_degree=4",
        "train.global_batch_size=64",
    )
    _, gpipe = plan_of(*base, "strategy.schedule=GPipe")
    _, ofob = plan_of(*base, "strategy.schedule=1F1B")
    assert gpipe.batch["num_microbatches"] == 8
    assert gpipe.memory_bytes["activations"] > 3 * ofob.memory_bytes["activations"]


def test_recompute_full_keeps_only_block_inputs():
    _, none = plan_of("recipe=gpt/gpt3_175b", "strategy.recompute=none")
    _, full = plan_of("recipe=gpt/gpt3_175b", "strategy.recompute=full")
    assert full.memory_bytes["activations"] < none.memory_bytes["activations"] / 3
    assert full.step_time_s > none.step_time_s  # one more forward per block


def test_step_time_and_mfu_are_consistent():
    cfg, plan = plan_of("recipe=gpt/gpt3_1.3b")
    peak = cfg.hardware.peak_flops("bf16")
    assert plan.mfu == pytest.approx(plan.flops_per_step / (plan.step_time_s * plan.world_size * peak))
    assert plan.tokens_per_s == pytest.approx(512 * 2048 / plan.step_time_s)


def test_parameter_server_plan_counts_server_shards_and_pulled_rows():
    cfg, plan = plan_of("recipe=ctr/tiny")
    ps = plan.ps
    assert ps["sparse_rows"] == 5000 + 3000 + 100 + 300
    assert ps["sparse_params"] == ps["sparse_rows"] * 9  # embedding_dim 8 + first-order weight
    # Zipf ids: a micro-batch of 32 touches at most 32 rows per table, far fewer than the table.
    assert 0 < ps["rows_pulled_per_step"] <= 4 * 32 * plan.batch["accumulate_steps"]
    assert ps["sparse_bytes_pulled_per_step"] < ps["sparse_table_bytes"] / 10
    assert plan.world_size == 4


def test_pipeline_receive_buffers_by_hand():
    """The pipeline stage (runtime/pipeline_stage.py) reuses its receive buffers: under 1F1B a set
    of activation buffers per micro-batch in flight (the first block's saved input already) and one
    gradient set; it keeps in-flight outputs. Not one per micro-batch of the step (torch's)."""
    cfg, plan = plan_of("recipe=gpt/tiny", "strategy=pp", "hardware.devices_per_node=2")
    b, s, h, v, n = 2, 32, 64, 256, 8
    assert plan.batch["num_microbatches"] == n
    pp1F1B = ("recipe=gpt/tiny", "strategy=pp", "hardware.devices_per_node=2")
    # stage 0 (1F1B keeps 2 micro-batches in flight): 1 gradient buffer + 2 held outputs
    assert _stage_memory(*pp1F1B)[0].pipeline_buffers == 4 * (1 + 2) * b * s * h
    # the last stage (1 in flight) receives into the first block's saved input and holds its
    # output, the logits, from each micro-batch's forward to its backward (torch's fwd_cache)
    assert _stage_memory(*pp1F1B, rank=1)[0].pipeline_buffers == 4 * 1 * b * s * v
    # and the same with 4× the micro-batches: the buffers no longer grow with the step's batch
    _, big = plan_of(*pp1F1B, "train.global_batch_size=64")
    assert big.batch["num_microbatches"] == 4 * n
    for rank in (0, 1):
        assert (
            _stage_memory(*pp1F1B, "train.global_batch_size=64", rank=rank)[0].pipeline_buffers
            == _stage_memory(*pp1F1B, rank=rank)[0].pipeline_buffers
        )
    # looped BFS posts every receive of a phase at once: n gradient sets + n held outputs on stage 0
    _, bfs = plan_of("recipe=gpt/tiny", "strategy=pp", "hardware.devices_per_node=2",
                     "strategy.schedule=looped_BFS", "strategy.virtual_stages=2")  # fmt: skip
    assert bfs.memory_bytes["pipeline_buffers"] >= 4 * 2 * n * b * s * h
    # recompute does not shrink them: they are the engine's, not autograd's
    for rank in (0, 1):
        assert (
            _stage_memory(*pp1F1B, "strategy.recompute=full", rank=rank)[0].pipeline_buffers
            == _stage_memory(*pp1F1B, rank=rank)[0].pipeline_buffers
        )
    _, dp = plan_of("recipe=gpt/tiny", "hardware.devices_per_node=2")
    assert dp.memory_bytes["pipeline_buffers"] == 0


def test_input_batch_and_gradient_accumulation_transient_of_tiny_resnet():
    batch = ("train.global_batch_size=16", "train.micro_batch_size=2")  # not the recipe's: pinned here
    _, one = plan_of("recipe=resnet/tiny", "hardware.devices_per_node=1", *batch)
    _, eight = plan_of("recipe=resnet/tiny", *batch)
    per_sample = 4 * 3 * 32 * 32 + 8  # fp32 image, int64 label
    assert one.memory_bytes["inputs"] == 16 * per_sample  # the whole step's batch, 8 micro-batches
    assert eight.memory_bytes["inputs"] == 2 * per_sample  # one micro-batch per rank
    # on a GPU the batch waits in host memory and one micro-batch at a time is on the device
    _, gpu = plan_of("recipe=resnet/tiny", "hardware=a100", "hardware.devices_per_node=1", *batch)
    assert gpu.memory_bytes["inputs"] == 2 * per_sample
    # accumulating 8 micro-batches: the largest weight's fresh gradient (layer 4's 3x3 conv, 64x64x9)
    # is alive next to its .grad; without accumulation it is the .grad itself. It replaces the
    # smaller transient of the head (logits and their gradient: 2 samples x 2 x 10 classes)
    largest = 4 * 9 * 64 * 64
    assert one.memory_bytes["activations"] - eight.memory_bytes["activations"] == largest - 4 * 2 * 2 * 10


def test_fsdp_mixed_precision_runs_the_residual_stream_in_16_bits():
    base = (
        "recipe=gpt/tiny",
        "strategy=hybrid",
        "strategy.pp_degree=2",
        "hardware=a100",
        "train.precision=bf16",
    )
    # the same 16 samples per pipeline replica: alone (autocast), or one of 2 FSDP shards
    _, fsdp = plan_of(*base, "hardware.devices_per_node=4", "strategy.sharding_degree=2",
                      "strategy.sharding_stage=2", "train.global_batch_size=32")  # fmt: skip
    _, plain = plan_of(*base, "hardware.devices_per_node=2", "train.global_batch_size=16")
    assert (fsdp.engine, plain.engine) == ("fsdp", "none")
    # autocast keeps the residual stream, hence the stage boundary, in fp32
    assert plain.comm_bytes_per_step["pp"] == 2 * fsdp.comm_bytes_per_step["pp"]
    assert plain.memory_bytes["pipeline_buffers"] == 2 * fsdp.memory_bytes["pipeline_buffers"]


def _stage_memory(*overrides, rank=0):
    """One pipeline rank's planned memory and parameter count (memory.ranks.pipeline_rank_memory)."""
    cfg, problems = compose(*overrides)
    assert problems == [], problems
    layout = Layout.of(cfg)
    ranks = chunk_ranks(cfg.strategy.schedule, layout.pp, cfg.strategy.virtual_stages)
    return pipeline_rank_memory(
        cfg, layout, assign_units(cfg, layout), ranks, rank, cfg.train.accumulate_steps
    )


def test_pipeline_stage_backward_peak_by_hand():
    """The demo's layout (gpt/tiny, pp 2 x ZeRO-2 sharding 2 x mp 2, fp32), pipeline stage 0 (the
    embedding and 2 blocks, 1F1B: 2 micro-batches in flight). Measured in the dry run: the peak is
    in a block's backward, at fc2's node: its input's gradient (s x f/mp) and fc2's fresh weight
    gradient (FSDP under a pipeline accumulates through autograd) beside every saved activation;
    the vocabulary-parallel embedding's gradient is its own rows (models/tp_plan.py)."""
    demo = ("recipe=gpt/tiny", "strategy=hybrid", "strategy.pp_degree=2", "strategy.sharding_degree=2",
            "strategy.sharding_stage=2", "strategy.mp_degree=2")  # fmt: skip
    b, s, h, f, v, a, mp = 2, 32, 64, 256, 256, 4, 2
    block_p = (4 * h * h + 2 * h * f + 3 * h + f) // mp + 6 * h
    p = v * h // mp + s * h + 2 * block_p  # stage 0's parameters on one mp rank
    # per sample and block: q, k, v, SDPA out + lse, fc1 out, GELU out (split; the out-projection
    # reads a view of SDPA's output); the two norms' inputs and outputs, their mean/rstd (whole)
    saved = 4 * ((3 * s * h + s * h + a * s + 2 * s * f) // mp + 2 * s * h + 2 * s * h + 4 * s)
    fc2_backward = 4 * b * s * f // mp + 4 * h * f // mp  # input gradient + fresh weight gradient

    mem, params = _stage_memory(*demo)
    assert params == p
    assert mem.grads == 4 * p  # one fp32 copy of this rank's parameters
    assert mem.activations == 2 * 2 * b * saved + fc2_backward
    _, plan = plan_of(*demo)
    assert plan.stages[0]["memory_total_bytes"] == int(mem.total)

    # full recompute keeps the blocks' inputs; the recomputed block (all but its input) is alive
    # at once with fc2's backward temporaries
    full, _ = _stage_memory(*demo, "strategy.recompute=full")
    block_input = 4 * s * h
    assert full.activations == 2 * 2 * b * block_input + b * (saved - block_input) + fc2_backward


def test_zero_bubble_recomputes_a_block_twice():
    """torch's zero-bubble backward is two calls (input gradients, then weight gradients) and a
    checkpointed block re-runs its forward in each; the first chunk runs one full backward."""
    base = ("recipe=gpt/tiny", "strategy=pp", "strategy.virtual_stages=2", "hardware.devices_per_node=2")
    b, s, h, f, n = 2, 32, 64, 256, 8
    block_fwd = 2 * s * (4 * h * h + 2 * h * f) + 2 * 2 * s * s * h
    recompute = block_fwd - 2 * s * f * h  # up to fc2's input (the last tensor backward needs)
    flops, notes = {}, {}
    for schedule in ("interleaved_1F1B", "interleaved_zero_bubble"):
        for mode in ("none", "full"):
            _, plan = plan_of(*base, f"strategy.schedule={schedule}", f"strategy.recompute={mode}")
            flops[schedule, mode] = [st["flops_per_device"] for st in plan.stages]
            notes[schedule, mode] = " ".join(plan.notes)
    one = [
        a - b_
        for a, b_ in zip(flops["interleaved_1F1B", "full"], flops["interleaved_1F1B", "none"], strict=True)
    ]
    two = [
        a - b_
        for a, b_ in zip(
            flops["interleaved_zero_bubble", "full"], flops["interleaved_zero_bubble", "none"], strict=True
        )
    ]
    # 4 chunks of one block: rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3
    assert one == [n * b * 2 * recompute] * 2
    assert two == [n * b * 3 * recompute, n * b * 4 * recompute]
    assert "re-runs each checkpointed block" in notes["interleaved_zero_bubble", "full"]
    assert "re-runs" not in notes["interleaved_1F1B", "full"] + notes["interleaved_zero_bubble", "none"]


def test_zero_bubble_recomputes_a_llama_block_by_its_chunk():
    """The same rule for Llama: one Unit per block, so that a block of the first chunk is
    recomputed once and one of a later chunk twice (its dense blocks were one object, and the last
    chunk's count stood for every chunk: rank 0 read 9.2% more FLOPs)."""
    base = ("recipe=llama/tiny", "strategy=pp", "strategy.virtual_stages=2", "hardware.devices_per_node=2",
            "model.num_layers=4")  # fmt: skip
    flops = {}
    for schedule in ("interleaved_1F1B", "interleaved_zero_bubble"):
        for mode in ("none", "full"):
            _, plan = plan_of(*base, f"strategy.schedule={schedule}", f"strategy.recompute={mode}")
            flops[schedule, mode] = [st["flops_per_device"] for st in plan.stages]
    one, two = (
        [a - b for a, b in zip(flops[sch, "full"], flops[sch, "none"], strict=True)]
        for sch in ("interleaved_1F1B", "interleaved_zero_bubble")
    )
    # rank 0 holds chunks 0 (recomputed once) and 2 (twice), rank 1 chunks 1 and 3 (twice each);
    # 1F1B recomputes each once
    assert [t / o for t, o in zip(two, one, strict=True)] == [1.5, 2.0], (one, two)


def test_sequence_parallel_pipeline_buffers_are_sequence_shards():
    """Under sequence parallelism a stage sends, receives and holds its sequence shard (the dry
    run's receive buffers and held outputs are (b, s/mp, h)): 1/mp of the buffers, as of the bytes
    sent (GPT-3 13B, interleaved zero bubble, SP, mp 8: 30.6 GiB planned against 18.0 in the dry
    run before, 17.3 after)."""
    base = ("recipe=gpt/tiny", "strategy=hybrid", "strategy.pp_degree=2", "strategy.mp_degree=2",
            "strategy.dp_degree=1", "hardware.devices_per_node=4")  # fmt: skip
    _, whole = plan_of(*base)
    _, shard = plan_of(*base, "strategy.sequence_parallel=true")
    b, s, h = 2, 32, 64
    assert whole.memory_bytes["pipeline_buffers"] == 4 * (1 + 2) * b * s * h  # 1 gradient set, 2 held outputs
    assert shard.memory_bytes["pipeline_buffers"] == whole.memory_bytes["pipeline_buffers"] / 2
    assert shard.comm_bytes_per_step["pp"] == whole.comm_bytes_per_step["pp"] / 2


def test_adamw_step_temporaries_follow_the_device():
    # AdamW's sqrt(exp_avg_sq) and quotient: on a GPU job torch steps every tensor at once (one
    # temporary per parameter); on CPU it loops, two temporaries of one tensor at a time (the
    # largest here: the 256 x 64 token embedding / LM head). One micro-batch in flight under full
    # recompute, so on the GPU the step is the peak (runtime/optim.py foreach_for)
    job = (
        "recipe=gpt/tiny",
        "optim=adamw",
        "strategy=pp",
        "strategy.recompute=full",
        "train.micro_batch_size=1",
    )
    cfg, cpu = plan_of(*job, "hardware.devices_per_node=2")
    _, gpu = plan_of(*job, "hardware=a100", "hardware.devices_per_node=2")
    layout = Layout.of(cfg)
    p0 = pipeline_rank_memory(cfg, layout, assign_units(cfg, layout), [0, 1], 0, 16)[1]
    assert cpu.memory_bytes["step_temporaries"] == 2 * 4 * 256 * 64
    assert gpu.memory_bytes["step_temporaries"] == 4 * p0
    assert gpu.memory_peak["phase"] == "optimizer step"
    assert cpu.memory_peak["phase"] == "forward/backward"


def test_every_pipeline_stage_reports_its_peak_phase_and_parts():
    # issue 15's table sets the planner's parts beside the dry run's per stage: GPT 530B (pp 35, full
    # recompute, 1F1B) peaks in stage 0's forward/backward (every in-flight micro-batch) and in the
    # last stage's optimizer step (foreach AdamW: one fp32 temporary per parameter, 5 x 4 B each)
    _, plan = plan_of("recipe=gpt/megatron_530b")
    for st in plan.stages:
        assert sum(st["memory_peak"]["parts"].values()) == pytest.approx(st["memory_total_bytes"], abs=8)
    first, last = plan.stages[0]["memory_peak"], plan.stages[-1]["memory_peak"]
    assert first["phase"] == "forward/backward" and first["parts"]["activations"] > 0
    assert last["phase"] == "optimizer step"
    p = last["parts"]
    assert p["params"] == p["grads"] == p["step_temporaries"] and p["optimizer"] == 2 * p["params"]
    assert plan.memory_peak == max(
        (st["memory_peak"] for st in plan.stages), key=lambda m: sum(m["parts"].values())
    )


def test_offload_on_a_gpu_plans_the_host_state_apart():
    """GPU offload (FSDP's CPUOffloadPolicy): the fp32 shard of the params, its gradients and AdamW's
    two moments are host memory -- `memory_bytes.host`, 16 B per sharded parameter (the step is
    torch's fused CPU kernel: no temporaries) -- and none of it is in the device's total; on a
    CPU device host and device are one memory, and nothing is planned apart."""
    base = ("recipe=gpt/gpt3_1.3b", "strategy.sharding_stage=3", "strategy.recompute=full", "hardware=h100")
    _, plain = plan_of(*base)
    _, off = plan_of(*base, "strategy.offload=true")
    shard = off.stages[0]["params_per_device"]
    assert (
        off.memory_bytes["host"] == off.stages[0]["host_memory_bytes"] == pytest.approx(16 * shard, rel=1e-6)
    )
    assert off.memory_bytes["step_temporaries"] == 0 and plain.memory_bytes["host"] == 0
    # the device no longer holds the 16 B per sharded parameter of params, grads and optimizer state
    assert plain.memory_bytes["total"] - off.memory_bytes["total"] >= 16 * shard * 0.99
    assert any("host memory per device" in n for n in off.notes)
    _, cpu = plan_of(
        "recipe=gpt/tiny", "strategy=sharding", "strategy.sharding_stage=3", "strategy.offload=true"
    )
    assert cpu.memory_bytes["host"] == 0 and cpu.memory_bytes["optimizer"] > 0
