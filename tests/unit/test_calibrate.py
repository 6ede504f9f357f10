"""`fleetwise calibrate`'s profile and the planner terms it feeds (no timing: fixed measurements)."""

import numpy as np
import pytest
from conftest import compose

from fleetwise.plan import make_plan
from fleetwise.plan.units import model_units

MEASURED = dict(
    device_type="cpu",
    backend="gloo",
    cores=2,
    peak_flops={"fp32": 150e9},
    gemm_flops={"512": 150e9},
    single_thread_flops=80e9,
    matmul_efficiency=0.9,
    op_overhead_us=10.0,
    allreduce_latency_us=200.0,
    allreduce_gbps=1.5,
    memory_gib=16.0,
)


@pytest.fixture
def local_profile(tmp_path, monkeypatch):
    from fleetwise.runtime.calibrate import Calibration, profile_yaml

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
    # host time: every forward op of the 8 micro-batches at 10 µs (1 rank per core)
    ops = sum(u.fwd_ops for u in model_units(cfg.model))
    assert plan.time_s["host_ops"] == pytest.approx(8 // 2 * ops * 10e-6)
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


def test_gloo_ddp_bucket_copy_is_planned_nccl_is_not():
    gloo, _ = compose("recipe=gpt/tiny", "hardware.devices_per_node=2")
    nccl, _ = compose("recipe=gpt/tiny", "hardware=a100", "hardware.devices_per_node=2")
    p = 234_880
    assert make_plan(gloo).memory_bytes["total"] - make_plan(nccl).memory_bytes["total"] == 4 * p


@pytest.mark.parametrize("recipe", ["gpt/tiny", "ernie/tiny", "resnet/tiny"])
def test_planned_op_counts_match_the_ops_torch_dispatches(recipe):
    from torch.utils._python_dispatch import TorchDispatchMode

    from fleetwise.runtime.modeling import build_model, build_source, model_spec

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    cfg, problems = compose(f"recipe={recipe}", "hardware.devices_per_node=1")
    assert problems == []
    model, spec = build_model(cfg), model_spec(cfg)
    batch = build_source(cfg).batch(np.arange(2))
    first = model.embed if hasattr(model, "embed") else model.stem
    counted = []
    with Count() as c:  # with autograd on: what training dispatches (saved-tensor detaches included)
        h = first(*[batch[k] for k in spec.inputs])
    counted.append(c.n)
    for layer in model.layers.values():
        with Count() as c:
            h = layer(h)
        counted.append(c.n)
    with Count() as c:
        out = model.head(h) if getattr(model, "output", None) is None else model.output(model.norm(h))
        spec.loss(out, batch[spec.label])
    counted.append(c.n)
    assert [u.fwd_ops for u in model_units(cfg.model)] == counted
