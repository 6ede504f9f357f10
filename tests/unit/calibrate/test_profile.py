"""`fleetwise calibrate`'s profile and the planner terms it feeds (no timing: fixed measurements)."""

import numpy as np
import pytest
from helpers.calibration import MEASURED
from helpers.config import compose

from fleetwise.families import model_units
from fleetwise.plan import make_plan


@pytest.fixture
def local_profile(tmp_path, monkeypatch):
    from fleetwise.calibrate.calibration import Calibration
    from fleetwise.calibrate.profile import profile_yaml

    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "local.yaml").write_text(profile_yaml(Calibration(**MEASURED)))
    monkeypatch.setenv("FLEETWISE_CONFIG_DIR", str(tmp_path))
    return tmp_path


def test_calibrated_profile_is_selectable_and_planned_with(local_profile):
    cfg, problems = compose("recipe=gpt/tiny", "hardware=local")
    assert problems == []
    hw = cfg.hardware
    assert (hw.name, hw.devices_per_node, hw.host_cores, hw.shared_compute) == ("local", 2, 2, True)
    plan = make_plan(cfg)
    assert plan.device_peak_flops == pytest.approx(150e9 / 2)  # the machine's peak, shared by 2 ranks
    # host time: every forward op of the 8 micro-batches at 10 µs (1 rank per core), 1.5x slower
    # with the other rank running too
    ops = sum(u.fwd_ops for u in model_units(cfg.model))
    assert plan.time_s["host_ops"] == pytest.approx(8 // 2 * ops * 10e-6 * 1.5)
    # DDP over 2 ranks: one all-reduce of the gradients (ring volume) plus the measured latency
    grads = 4 * plan.params
    assert plan.time_s["comm_dp"] == pytest.approx(grads / 1.5e9 + 200e-6)


def test_ranks_beyond_cores_time_share_host_and_comm(local_profile):
    two, _ = compose("recipe=gpt/tiny", "hardware=local", "hardware.devices_per_node=2")
    eight, _ = compose("recipe=gpt/tiny", "hardware=local", "hardware.devices_per_node=8")
    p2, p8 = make_plan(two), make_plan(eight)
    assert eight.hardware.ranks_per_core == 4
    # 8 ranks run 1 micro-batch each instead of 4, but 4 ranks share a core: the same host time
    assert p8.time_s["host_ops"] == pytest.approx(p2.time_s["host_ops"])
    assert p8.time_s["comm_dp"] > 4 * p2.time_s["comm_dp"] * 0.9  # time-shared collectives


def test_a_pipeline_rank_in_its_bubble_leaves_its_core_to_the_others(local_profile):
    """4 pipeline ranks on the profile's 2 cores: while a rank waits in its bubble the busy ones
    share the cores, so each micro-batch's host work is charged at 4 × (1 - bubble) / 2 ranks per
    core (not 2) and the co-run slowdown (1.5) scaled by the busy share; the optimizer step, every
    rank busy, pays both in full, as DDP (no bubble) pays them everywhere. gpt/tiny pp 4 on 2 CPU
    cores measured 36 ms a step where 2 ranks per core on top of the bubble planned 70 ms."""
    common = ("recipe=gpt/tiny", "hardware=local", "hardware.devices_per_node=4")
    pipe = ("strategy=pp", "strategy.pp_degree=4", "strategy.schedule=1F1B", "hardware.pipeline_action_us=0")
    alone = ("hardware.shared_compute=false", "hardware.co_run_slowdown=1")
    shared, _ = compose(*common, *pipe)
    unshared, _ = compose(*common, *pipe, *alone)
    p, q = make_plan(shared), make_plan(unshared)
    busy = 1 - p.bubble_fraction
    assert 0 < busy < 1
    assert p.time_s["host_ops"] == pytest.approx(q.time_s["host_ops"] * (4 * busy / 2) * (1 + 0.5 * busy))
    assert p.time_s["update"] == pytest.approx(q.time_s["update"] * 2 * 1.5)
    ddp, _ = compose(*common, "strategy=dp")
    ddp_alone, _ = compose(*common, "strategy=dp", *alone)
    assert make_plan(ddp).time_s["host_ops"] == pytest.approx(
        make_plan(ddp_alone).time_s["host_ops"] * 2 * 1.5
    )


def test_ddp_gradients_are_planned_once_on_gloo_and_nccl():
    """DDP's gradients are its buckets, all-reduced in place on either backend: the "gloo bucket
    copy" planned before (+4 B per parameter) was a second set of gradients that zeroing them to
    None allocated under gradient accumulation (runtime/optim.py zeroes them in place now)."""
    gloo, _ = compose("recipe=gpt/tiny", "hardware.devices_per_node=2")
    nccl, _ = compose("recipe=gpt/tiny", "hardware=a100", "hardware.devices_per_node=2")
    p = 234_880

    def without_inputs(cfg):  # a GPU holds one micro-batch of the input at a time, a CPU the step's
        m = make_plan(cfg).memory_bytes
        return m["total"] - m["inputs"], m["grads"]

    assert without_inputs(gloo) == without_inputs(nccl)
    assert without_inputs(gloo)[1] == 4 * p


@pytest.mark.parametrize(
    "recipe",
    [
        "gpt/tiny",
        "ernie/tiny",
        "resnet/tiny",
        "llama/tiny",
        # multi-head attention, Qwen 3's q/k norms, the head tied to the embedding
        "llama/tiny model.num_kv_heads=8 model.qk_norm=true model.tie_word_embeddings=true",
    ],
)
def test_planned_op_counts_match_the_ops_torch_dispatches(recipe):
    from fleetwise.calibrate.probes.workloads import OpCounter
    from fleetwise.runtime.modeling import build_model, build_source, model_spec

    name, *overrides = recipe.split()
    cfg, problems = compose(f"recipe={name}", *overrides, "hardware.devices_per_node=1")
    assert problems == []
    model, spec = build_model(cfg), model_spec(cfg)
    first = model.embed if hasattr(model, "embed") else model.stem

    def count(batch_size: int) -> list[OpCounter]:
        batch = build_source(cfg).batch(np.arange(batch_size))
        counted = []
        with OpCounter() as c:  # with autograd on: what training dispatches (saved-tensor detaches included)
            h = first(*[batch[k] for k in spec.inputs])
        counted.append(c)
        for layer in model.layers.values():
            with OpCounter() as c:
                h = layer(h)
            counted.append(c)
        with OpCounter() as c:
            out = model.head(h) if getattr(model, "output", None) is None else model.output(model.norm(h))
            spec.loss(out, batch[spec.label])
        counted.append(c)
        return counted

    two, four = count(2), count(4)
    units = model_units(cfg.model)
    tail = [model.head] if hasattr(model, "head") else [model.norm, model.output]
    modules = [[first], *([layer] for layer in model.layers.values()), tail]  # per unit
    params = [[p for m in group for p in m.parameters()] for group in modules]
    assert [u.param_tensors for u in units] == [len(ps) for ps in params]
    # the largest parameter tensor (one rank, no mp): the gradient-accumulation transient
    assert [u.largest_on_rank(1) for u in units] == [max(p.numel() for p in ps) for ps in params]
    assert [u.fwd_ops for u in units] == [c.count for c in two] == [c.count for c in four]
    assert [u.fwd_gemms for u in units] == [c.gemms for c in two]
    assert [u.fwd_convs for u in units] == [c.convs for c in two]
    # elements per sample: what 2 more samples add (per-batch terms cancel)
    assert [u.fwd_elementwise for u in units] == [
        (c4.elements - c2.elements) / 2 for c2, c4 in zip(two, four, strict=True)
    ]


def test_gemm_efficiency_curve_is_interpolated_for_the_ranks_thread_count(local_profile):
    one_rank, _ = compose("recipe=gpt/tiny", "hardware=local", "hardware.devices_per_node=1")
    two_ranks, _ = compose("recipe=gpt/tiny", "hardware=local")
    hw1, hw2 = one_rank.hardware, two_ranks.hardware
    assert (hw1.threads_per_rank, hw2.threads_per_rank) == (2, 1)
    # all threads: 0.1 at 1e5 FLOPs, 0.5 at 1e7 -> 0.3 halfway in log FLOPs; clamped at the ends
    assert hw1.gemm_fraction(1e6) == pytest.approx(0.3)
    assert hw1.gemm_fraction(1e3) == pytest.approx(0.1)
    assert hw1.gemm_fraction(1e12) == pytest.approx(0.95)
    assert hw2.gemm_fraction(1e6) == pytest.approx(0.7)  # one thread per rank: its own curve


def test_small_gemms_and_elementwise_ops_slow_the_planned_step(local_profile):
    cfg, _ = compose("recipe=gpt/tiny", "hardware=local", "hardware.devices_per_node=1")
    plan = make_plan(cfg)
    units = model_units(cfg.model)
    b, n = cfg.train.micro_batch_size, cfg.train.global_batch_size // cfg.train.micro_batch_size
    elements = sum(u.fwd_elementwise for u in units)
    assert plan.time_s["elementwise"] == pytest.approx(n * b * elements * 2e-9)
    gemm = plan.time_s["compute"] - plan.time_s["host_ops"] - plan.time_s["elementwise"]
    at_constant_efficiency = n * b * 3 * sum(u.fwd_flops for u in units) / (150e9 * 0.9)
    assert gemm > 2 * at_constant_efficiency  # tiny GEMMs (~1e6 FLOPs) run at ~0.3 of peak


def test_parameter_update_is_charged_per_tensor_and_element(local_profile):
    adamw, _ = compose("recipe=gpt/tiny", "hardware=local", "hardware.devices_per_node=1")
    sgd, _ = compose(
        "recipe=gpt/tiny", "hardware=local", "hardware.devices_per_node=1", "optim=sgd", "optim.momentum=0"
    )
    units = model_units(adamw.model)
    tensors, params = sum(u.param_tensors for u in units), sum(u.params for u in units)
    expected = tensors * 30e-6 + params * 1e-9
    assert make_plan(adamw).time_s["update"] == pytest.approx(expected)
    assert make_plan(sgd).time_s["update"] == pytest.approx(expected / 2)  # param + grad, no state


def test_tensor_parallel_ops_pay_the_dtensor_overhead(local_profile):
    dp, _ = compose("recipe=gpt/tiny", "hardware=local", "hardware.devices_per_node=2")
    mp, _ = compose("recipe=gpt/tiny", "hardware=local", "hardware.devices_per_node=2", "strategy=mp")
    ops = sum(u.fwd_ops for u in model_units(dp.model))
    n = 16 // 2  # mp ranks see the whole batch: 8 micro-batches each
    # DTensor's overhead was measured on co-running ranks: only the plain part is slowed down
    assert make_plan(mp).time_s["host_ops"] == pytest.approx(n * ops * (1.5 * 10 + 400) * 1e-6)
    assert make_plan(dp).time_s["host_ops"] == pytest.approx(n // 2 * ops * 1.5 * 10e-6)


def test_fsdp_host_work_is_per_unit_pass_and_a_regather_costs_only_its_collective(local_profile):
    def plan(*overrides):
        cfg, problems = compose("recipe=gpt/tiny", "hardware=local", *overrides)
        assert problems == []
        return make_plan(cfg)

    z2, z3 = (plan("strategy=sharding", f"strategy.sharding_stage={s}") for s in (2, 3))
    dp = plan("strategy=dp")
    units = model_units(compose("recipe=gpt/tiny")[0].model)
    tensors = sum(u.param_tensors for u in units)
    n = 16 // 2 // 2  # micro-batches per rank
    # FSDP's hooks and buffer copies: every parameter tensor in every micro-batch, at 300 µs (the
    # profile's figure, measured on co-running ranks: no co-run slowdown on top), whatever the stage
    assert z2.time_s["host_ops"] - dp.time_s["host_ops"] == pytest.approx(n * tensors * 300e-6)
    assert z3.time_s["host_ops"] == pytest.approx(z2.time_s["host_ops"])
    # stage 3 gathers every unit again for the backward: one more collective per unit and
    # micro-batch, its latency (200 µs) and half the parameters' bytes over 1.5 GB/s
    regather = n * (len(units) * 200e-6 + 0.5 * 4 * z2.params / 1.5e9)
    assert z3.time_s["comm_sharding"] - z2.time_s["comm_sharding"] == pytest.approx(regather)


def test_fsdp_copies_cost_per_parameter_at_each_all_gather_and_reduce_scatter(local_profile):
    """FSDP's flat-buffer copies (`fsdp_ns_per_param`): a pass over the rank's parameters at each
    all-gather and reduce-scatter of every unit; ZeRO-3 gathers again for the backward; DDP and
    ZeRO-1 copy nothing of the kind."""

    def plan(*overrides):
        cfg, problems = compose("recipe=gpt/tiny", "hardware=local", *overrides)
        assert problems == []
        return make_plan(cfg)

    n = 16 // 2 // 2  # micro-batches per rank
    for stage, collectives in ((2, 2), (3, 3)):  # per micro-batch: gather (+ re-gather) + reduce-scatter
        without = plan("strategy=sharding", f"strategy.sharding_stage={stage}")
        copied = plan("strategy=sharding", f"strategy.sharding_stage={stage}", "hardware.fsdp_ns_per_param=2")
        extra = copied.time_s["host_ops"] - without.time_s["host_ops"]
        assert extra == pytest.approx(n * collectives * copied.params * 2e-9)  # 2 ranks on 2 cores
        assert copied.step_time_s == pytest.approx(without.step_time_s + extra)
    for other in (["strategy=dp"], ["strategy=sharding", "strategy.sharding_stage=1"]):
        assert plan(*other, "hardware.fsdp_ns_per_param=2").step_time_s == plan(*other).step_time_s


def _pipeline_plan(schedule: str, virtual: int, *overrides: str):
    """(config, plan) of gpt/tiny on 2 pipeline ranks of the calibrated profile."""
    cfg, problems = compose(
        "recipe=gpt/tiny",
        "hardware=local",
        "hardware.devices_per_node=2",
        "strategy=pp",
        "strategy.pp_degree=2",
        f"strategy.schedule={schedule}",
        f"strategy.virtual_stages={virtual}",
        *overrides,
    )
    assert problems == []
    return cfg, make_plan(cfg)


@pytest.mark.parametrize(
    ("schedule", "virtual", "actions"),
    [("1F1B", 1, 2), ("interleaved_1F1B", 2, 2), ("interleaved_zero_bubble", 2, 3)],
)
def test_pipeline_schedule_actions_pay_their_host_cost(local_profile, schedule, virtual, actions):
    """Every schedule action (a micro-batch through one local stage: forward, backward, and the
    split weight-gradient pass of zero-bubble schedules) pays the profile's 100 µs (measured on
    co-running stages: no co-run slowdown on top), and under the multi-stage schedules a forward or
    backward pays `pipeline_multi_action_us` on top; without a pipeline there are none."""

    charged = _pipeline_plan(schedule, virtual)[1]
    free = _pipeline_plan(schedule, virtual, "hardware.pipeline_action_us=0")[1]
    n = charged.batch["accumulate_steps"]
    extra = charged.time_s["host_ops"] - free.time_s["host_ops"]
    assert extra == pytest.approx(n * virtual * actions * 100e-6)
    # torch's multi-stage schedules pay more per action that sends and receives (forward, and
    # backward or input-gradient: not zero bubble's weight pass); 1F1B's single stage does not
    multi = _pipeline_plan(schedule, virtual, "hardware.pipeline_multi_action_us=40")[1]
    more = multi.time_s["host_ops"] - charged.time_s["host_ops"]
    assert more == pytest.approx(0.0 if schedule == "1F1B" else n * virtual * 2 * 40e-6)
    dp, _ = compose("recipe=gpt/tiny", "hardware=local", "hardware.devices_per_node=2", "strategy=dp")
    dp_free, _ = compose(
        "recipe=gpt/tiny",
        "hardware=local",
        "hardware.devices_per_node=2",
        "strategy=dp",
        "hardware.pipeline_action_us=0",
    )
    assert make_plan(dp).time_s["host_ops"] == pytest.approx(make_plan(dp_free).time_s["host_ops"])


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "ZBV_zero_bubble"])
def test_zero_bubble_split_backward_is_charged_on_every_chunk_but_the_first(local_profile, schedule):
    """Zero bubble's split backward pays the profile's 30 µs per forward op and 0.5 ns per parameter
    of every unit in chunks 1.. (torch runs chunk 0's backward whole), per micro-batch, 1.5x slower
    for as long as the other rank runs too (1 - bubble); other schedules pay nothing."""
    from fleetwise.config.layout import Layout
    from fleetwise.plan.chunks import assign_units

    free = ("hardware.zero_bubble_split_op_us=0", "hardware.zero_bubble_split_ns_per_param=0")
    cfg, charged = _pipeline_plan(schedule, 2)
    _, uncharged = _pipeline_plan(schedule, 2, *free)
    chunks = assign_units(cfg, Layout.of(cfg))
    n = charged.batch["accumulate_steps"]
    slow = 1 + 0.5 * (1 - charged.bubble_fraction)  # the co-run slowdown while the other rank is busy
    stage = {s["rank"]: s for s in charged.stages}
    for r, before in ((s["rank"], s) for s in uncharged.stages):
        split = [u for c in stage[r]["chunks"] if c > 0 for u in chunks[c]]
        ops, params = sum(u.fwd_ops for u in split), sum(u.params_on_rank(1) for u in split)
        assert ops > 0
        extra = stage[r]["compute_s"] - before["compute_s"]
        assert extra == pytest.approx(n * slow * (ops * 30e-6 + params * 0.5e-9))
    for other in ("interleaved_1F1B", "looped_BFS"):
        assert _pipeline_plan(other, 2)[1].step_time_s == pytest.approx(
            _pipeline_plan(other, 2, *free)[1].step_time_s
        )


def test_co_running_ranks_and_convolutions_are_charged(local_profile):
    one, _ = compose("recipe=resnet/tiny", "hardware=local", "hardware.devices_per_node=1")
    two, _ = compose("recipe=resnet/tiny", "hardware=local", "hardware.devices_per_node=2")
    assert (one.hardware.co_run_factor, two.hardware.co_run_factor) == (1.0, 1.5)
    units = model_units(one.model)
    ops, convs = sum(u.fwd_ops for u in units), sum(u.fwd_convs for u in units)
    assert convs == 12  # stem, 2 per basic block, 3 downsampling 1x1
    n = 16 // 2
    assert make_plan(one).time_s["host_ops"] == pytest.approx(n * (ops * 10 + convs * 200) * 1e-6)
    # 2 ranks: half the micro-batches each, every op 1.5x slower
    assert make_plan(two).time_s["host_ops"] == pytest.approx(1.5 * n / 2 * (ops * 10 + convs * 200) * 1e-6)


def test_activation_checkpointing_pays_its_machinery_per_recomputed_op(local_profile):
    def host(mode):
        cfg, _ = compose(
            "recipe=gpt/tiny", "hardware=local", "hardware.devices_per_node=1", f"strategy.recompute={mode}"
        )
        return make_plan(cfg).time_s["host_ops"]

    units = model_units(compose("recipe=gpt/tiny")[0].model)
    block_ops = sum(u.fwd_ops for u in units if u.kind == "block")
    n = 16 // 2
    # both modes re-run every op of every block (10 µs each) and pay the checkpoint machinery on top:
    # 20 µs per op for full checkpointing, 50 µs for selective (its policy dispatch mode)
    assert host("full") - host("none") == pytest.approx(n * block_ops * (10 + 20) * 1e-6)
    assert host("selective") - host("none") == pytest.approx(n * block_ops * (10 + 50) * 1e-6)


def test_zero1_and_fsdp_pay_the_backends_own_reduce_scatter_and_all_gather(local_profile):
    """gloo's reduce-scatter and all-gather are slower per byte of ring volume than its all-reduce
    (calibrate measures them): ZeRO-1's reduce-scatter + all-gather cost more than DDP's one
    all-reduce of the same gradients, and ZeRO-1 also all-reduces the chunks' squared norm."""
    from fleetwise.calibrate.calibration import Calibration
    from fleetwise.calibrate.profile import profile

    written = profile(Calibration(**MEASURED, reduce_scatter_gbps=0.5, all_gather_gbps=0.75))
    assert (written["reduce_scatter_gbps"], written["all_gather_gbps"]) == (0.5, 0.75)
    assert profile(Calibration(**MEASURED))["reduce_scatter_gbps"] is None  # not measured: all-reduce's

    def plan(*overrides):
        cfg, problems = compose("recipe=gpt/tiny", "hardware=local", *overrides)
        assert problems == []
        return make_plan(cfg)

    def on_nccl(*overrides):  # the backend's own collectives (a CPU job must run gloo)
        cfg, problems = compose("recipe=gpt/tiny", "hardware=local", *overrides)
        assert problems == []
        return make_plan(
            cfg.model_copy(update={"hardware": cfg.hardware.model_copy(update={"backend": "nccl"})})
        )

    zero1 = ("strategy=sharding", "strategy.sharding_stage=1")
    slow = ("hardware.reduce_scatter_gbps=0.5", "hardware.all_gather_gbps=0.75")
    dp, z_same, z_slow = plan("strategy=dp"), on_nccl(*zero1), on_nccl(*zero1, *slow)
    grads = 4 * dp.params
    assert dp.time_s["comm_dp"] == pytest.approx(grads / 1.5e9 + 200e-6)
    # same bytes as the all-reduce at its bandwidth; reduce-scatter, all-gather and the norm's all-reduce
    assert z_same.time_s["comm_sharding"] == pytest.approx(grads / 1.5e9 + 3 * 200e-6)
    assert z_slow.time_s["comm_sharding"] == pytest.approx(
        0.5 * grads / 0.5e9 + 0.5 * grads / 0.75e9 + 3 * 200e-6
    )
    assert z_slow.comm_bytes_per_step == z_same.comm_bytes_per_step  # the bytes moved are the same
    # on gloo ZeRO-1 all-reduces both buffers instead (runtime/zero1.py): twice the bytes, at the
    # all-reduce's bandwidth, whatever its reduce-scatter's and all-gather's
    z_gloo = plan(*zero1, *slow)
    assert z_gloo.comm_bytes_per_step["sharding"] == 2 * z_slow.comm_bytes_per_step["sharding"]
    assert z_gloo.time_s["comm_sharding"] == pytest.approx(2 * grads / 1.5e9 + 3 * 200e-6)
    fsdp, fsdp_slow = plan("strategy=sharding", "strategy.sharding_stage=2"), plan("strategy=sharding", *slow)
    n = 16 // 2 // 2  # micro-batches per rank: a gather (0.75 GB/s) and a reduce-scatter (0.5) each
    extra = n * 0.5 * grads * (1 / 0.5e9 - 1 / 1.5e9 + 1 / 0.75e9 - 1 / 1.5e9)
    assert fsdp_slow.time_s["comm_sharding"] - fsdp.time_s["comm_sharding"] == pytest.approx(extra)


def test_each_micro_batch_adds_its_gradient_into_the_steps(local_profile):
    """Gradient accumulation is a memory-bound pass over the rank's gradients per micro-batch:
    DDP's autograd adds micro-batches 2..n into .grad, ZeRO-1's hook adds every one (the first too)
    into its fp32 buffer; at 2 ns an element, 1.5x slower with the other rank running."""
    from fleetwise.calibrate.calibration import Calibration
    from fleetwise.calibrate.profile import profile

    assert profile(Calibration(**MEASURED, grad_accumulate_ns=1.25))["grad_accumulate_ns"] == 1.25

    def plan(*overrides):
        cfg, problems = compose(
            "recipe=gpt/tiny", "hardware=local", "hardware.grad_accumulate_ns=2", *overrides
        )
        assert problems == []
        return make_plan(cfg)

    zero1 = ("strategy=sharding", "strategy.sharding_stage=1")
    for mb, n in ((2, 4), (8, 1)):  # 16 samples over 2 ranks
        dp, z = (
            plan("strategy=dp", f"train.micro_batch_size={mb}"),
            plan(*zero1, f"train.micro_batch_size={mb}"),
        )
        assert dp.time_s["grad_accumulate"] == pytest.approx((n - 1) * dp.params * 2e-9 * 1.5)
        assert z.time_s["grad_accumulate"] == pytest.approx(n * z.params * 2e-9 * 1.5)
    # it is compute on the critical path: the step grows by as much
    base = make_plan(
        compose("recipe=gpt/tiny", "hardware=local", "strategy=dp", "train.micro_batch_size=2")[0]
    )
    assert dp.step_time_s > 0 and plan(
        "strategy=dp", "train.micro_batch_size=2"
    ).step_time_s == pytest.approx(base.step_time_s + 3 * base.params * 2e-9 * 1.5)


def test_probes_that_subtract_timings_interleave_them(monkeypatch):
    """A variant and its plain twin are timed in turn (a, b, a, b), so a slow spell of a shared
    machine lands on both: each gets the median of its own runs after one warm-up."""
    from fleetwise.calibrate.probes import timing

    now, calls = [0.0], []
    costs = {"a": iter([100, 5, 1, 9]), "b": iter([100, 2, 3, 2])}  # warm-up first, then three runs

    def make(name):
        def fn():
            calls.append(name)
            now[0] += next(costs[name])  # the fake clock advances by this run's cost

        return fn

    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    assert timing.interleaved([make("a"), make("b")], reps=3) == [5, 2]
    assert calls == ["a", "b"] * 4


def test_quick_runs_a_fifth_of_every_probes_repetitions_and_at_least_three(monkeypatch):
    """`fleetwise calibrate --quick` (what the e2e test runs): timed and interleaved probes run a
    fifth of their repetitions, never fewer than three (a median needs samples) nor more than asked;
    without it, all of them."""
    from fleetwise.calibrate import command
    from fleetwise.calibrate.probes import machine, timing

    runs = []
    monkeypatch.setattr(timing, "_share", 1.0)  # set_share below is undone with the test
    assert timing.timed(lambda: runs.append(1), reps=50) >= 0 and len(runs) == 1 + 50  # warm-up + reps
    shares = []

    def fake_measure(**kwargs):
        shares.append(timing._share)
        runs.clear()
        timing.timed(lambda: runs.append(1), reps=50)
        timing.interleaved([lambda: runs.append("a"), lambda: runs.append("b")], reps=30)
        timing.timed(lambda: runs.append(2), reps=7)
        timing.timed(lambda: runs.append(3), reps=2)
        raise SystemExit(0)

    monkeypatch.setattr(machine, "measure", fake_measure)
    with pytest.raises(SystemExit):
        command.main(["--quick", "--no-comm", "--out", "/dev/null"])
    assert shares == [timing.QUICK] and runs.count(1) == 1 + 10
    assert runs.count("a") == runs.count("b") == 1 + 6
    assert runs.count(2) == 1 + 3 and runs.count(3) == 1 + 2


def test_zero1_pays_its_hook_per_tensor_and_micro_batch_and_its_copies_per_step(local_profile):
    """ZeRO-1's own host work (runtime/zero1.py), which DDP does not do: a Python gradient hook per
    parameter tensor in every micro-batch's backward (40 µs here) and, once a step, per tensor the
    reduce's bookkeeping, the pieces' squared norms and the all-gather's copies (25 µs). Measured
    on co-running ranks (no co-run slowdown on top); time-shared when ranks outnumber cores."""
    from fleetwise.calibrate.calibration import Calibration
    from fleetwise.calibrate.profile import profile

    written = profile(Calibration(**MEASURED, zero1_us_per_tensor=40.0, zero1_step_us_per_tensor=25.0))
    assert (written["zero1_us_per_tensor"], written["zero1_step_us_per_tensor"]) == (40.0, 25.0)

    def plan(hook: float, step: float, *overrides):
        cfg, problems = compose(
            "recipe=gpt/tiny",
            "hardware=local",
            f"hardware.zero1_us_per_tensor={hook}",
            f"hardware.zero1_step_us_per_tensor={step}",
            *overrides,
        )
        assert problems == []
        return make_plan(cfg)

    tensors = sum(u.param_tensors for u in model_units(compose("recipe=gpt/tiny")[0].model))
    zero1 = ("strategy=sharding", "strategy.sharding_stage=1")
    for mb, n, ranks in ((2, 4, 2), (8, 1, 2), (2, 2, 4)):  # 16 samples over the ranks
        args = (*zero1, f"train.micro_batch_size={mb}", f"hardware.devices_per_node={ranks}")
        z, bare = plan(40, 25, *args), plan(0, 0, *args)
        per_core = ranks / 2  # ranks time-sharing the 2 cores
        assert z.time_s["host_ops"] - bare.time_s["host_ops"] == pytest.approx(n * tensors * 40e-6 * per_core)
        assert z.time_s["update"] - bare.time_s["update"] == pytest.approx(tensors * 25e-6 * per_core)
        assert z.step_time_s - bare.step_time_s == pytest.approx((n * 40 + 25) * tensors * 1e-6 * per_core)
    # DDP does neither
    assert plan(40, 25, "strategy=dp").step_time_s == plan(0, 0, "strategy=dp").step_time_s
    # the gather's memory-bound passes over the bucket, at the accumulation's 2 ns an element (1.5x
    # co-run): on gloo zeroing the buffer it all-reduces, then the copies in and out (NCCL: the copies)
    ns = ("hardware.grad_accumulate_ns=2", *zero1)
    z, bare = plan(0, 0, *ns), plan(0, 0, *zero1)
    assert z.time_s["update"] - bare.time_s["update"] == pytest.approx(2 * z.params * 2e-9 * 1.5)


def test_the_gemm_curve_never_falls_with_size(monkeypatch):
    """A larger GEMM is never written as less efficient than a smaller one: a noisy top point
    (two idle calibrations read 0.96 and 0.87 at 2e9 FLOPs) would rank larger micro-batches
    slower in the search. Timed here with a fake probe: the 1024 GEMM's run is twice as slow
    as its FLOPs say, the others at peak."""
    from fleetwise.calibrate.probes import compute

    peak = 1e11

    def timed(fn, reps, sync=None, typical=False):
        n = fn.__defaults__[0].in_features  # the probe's Linear
        inner = fn.__defaults__[3]
        return inner * 3 * 2 * n**3 / peak * (2.0 if n == 1024 else 1.0)

    monkeypatch.setattr(compute, "timed", timed)
    curve = compute.gemm_curve(peak, overhead_us=0.0)
    assert list(curve) == [str(2 * n**3) for n in compute.CURVE_SIZES]
    assert curve[str(2 * 1024**3)] == curve[str(2 * 512**3)] == 1.0, curve
    assert compute.monotone({"1e9": 0.87, "1e5": 0.1, "3e8": 0.96, "1e7": 0.5}) == {
        "1e5": 0.1,
        "1e7": 0.5,
        "3e8": 0.96,
        "1e9": 0.96,
    }
