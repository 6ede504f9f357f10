"""GPU-only code paths checked on CPU: multi-node rendezvous id, loss precision, memory headroom
and the CUDA memory report, foreach clipping."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.config import compose

TWO_NODES = (
    "recipe=gpt/tiny",
    "hardware=a100",
    "train.global_batch_size=64",
    "hardware.nodes=2",
    "launch.rdzv_endpoint=10.0.0.1:29500",
)


def rdzv_id(*overrides: str, run_dir: str) -> str:
    from fleetwise.launcher.torchrun import torchrun_command

    cfg, problems = compose(*TWO_NODES, *overrides)
    assert cfg is not None, problems
    (arg,) = [a for a in torchrun_command(cfg, Path(run_dir)) if a.startswith("--rdzv-id=")]
    return arg


def test_rdzv_id_is_the_same_on_every_node_of_a_job():
    """Each node names its run directory after the second it started: the id must not depend on it."""
    node0 = rdzv_id("launch.node_rank=0", run_dir="/runs/2026-11-23_20-00-01")
    node1 = rdzv_id("launch.node_rank=1", run_dir="/runs/2026-11-23_20-00-03")
    assert node0 == node1
    assert rdzv_id("optim.lr=1e-4", run_dir="/runs/a") != rdzv_id("optim.lr=2e-4", run_dir="/runs/a")
    assert rdzv_id("launch.rdzv_id=job42", run_dir="/runs/a") == "--rdzv-id=job42"


def test_loss_is_fp32_on_16_bit_logits():
    """FSDP's mixed precision runs without autocast: its 16-bit logits must still give an fp32
    cross entropy, equal to the one on upcast logits (autocast's behaviour on DDP)."""
    import torch
    import torch.nn.functional as F

    from fleetwise.runtime.modeling import model_spec
    from fleetwise.runtime.parallelize import ParallelModel

    cfg, _ = compose("recipe=gpt/tiny")
    pm = ParallelModel([], [0], 1, "fsdp", model_spec(cfg))
    torch.manual_seed(0)
    logits = (torch.randn(2, 8, 256) * 4).bfloat16()
    labels = torch.randint(0, 256, (2, 8))
    loss = pm.loss(logits, labels)
    assert loss.dtype == torch.float32
    expected = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_gpu_plan_reserves_device_overhead():
    """A plan that fills the nominal 80 GiB does not fit: the CUDA context, NCCL buffers, cuBLAS
    workspace and allocator fragmentation are taken from the capacity first."""
    from fleetwise.plan import make_plan

    cfg, _ = compose("recipe=gpt/tiny", "hardware=h100")
    plan = make_plan(cfg).to_dict()
    hw = cfg.hardware
    overhead = plan["device_overhead_bytes"]
    assert overhead == pytest.approx(
        hw.device_overhead_gib * 2**30 + hw.fragmentation * plan["device_memory_bytes"], rel=1e-9
    )
    assert 2 * 2**30 < overhead < 8 * 2**30  # context ~0.5, NCCL ~0.5-1, cuBLAS 32 MiB, 4% fragmentation
    assert plan["usable_memory_bytes"] == plan["device_memory_bytes"] - overhead
    cpu, _ = compose("recipe=gpt/tiny")
    assert make_plan(cpu).to_dict()["device_overhead_bytes"] == 0
    # a job planned at 95 % of the nominal capacity fits no more
    assert plan["memory_bytes"]["total"] < plan["usable_memory_bytes"]
    assert 0.95 * plan["device_memory_bytes"] > plan["usable_memory_bytes"]


def test_cuda_peak_reports_reserved_beside_allocated(monkeypatch):
    import torch

    from fleetwise.runtime.memory import TensorPeak

    stats = iter([(100, 160), (120, 150)])
    current = {}

    def reset(device):
        current.update(zip(("allocated", "reserved"), next(stats), strict=True))

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: current["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: current["reserved"])
    peak = TensorPeak(torch.device("cuda", 0))
    for _ in range(2):
        with peak.measure([], []):
            pass
    assert (peak.peak, peak.reserved) == (120, 160)


def test_clipping_uses_foreach_kernels():
    """One fused multiply per device and dtype, not one kernel launch per parameter."""
    import torch

    from fleetwise.compat import TorchDispatchMode
    from fleetwise.runtime.optim import clip_, grad_norm

    params = [torch.nn.Parameter(torch.ones(3) * i) for i in range(1, 6)]
    for p in params:
        p.grad = p.detach().clone()
    total = grad_norm(params)
    calls: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops():
        clip_(params, 1.0, total)
    assert not any(c.startswith("aten.mul_") for c in calls), calls
    assert any("_foreach_mul" in c for c in calls), calls
    assert grad_norm(params).item() == pytest.approx(1.0, rel=1e-5)


def test_calibrated_v100_profile_has_no_bf16():
    """A V100 runs bf16 emulated: its profile takes the measured fp16 peak for fp16 and says
    has_bf16=false (it used to copy the emulated bf16 number into fp16 and claim bf16)."""
    from helpers.calibration import MEASURED

    from fleetwise.calibrate.calibration import Calibration
    from fleetwise.calibrate.profile import profile

    cal = Calibration(
        **{
            **MEASURED,
            "device_type": "cuda",
            "backend": "nccl",
            "has_bf16": False,
            "peak_flops": {"fp32": 15.7e12, "tf32": 15.7e12, "fp16": 112e12},
        }  # fmt: skip
    )
    hw = profile(cal, "v100_local")
    assert hw["has_bf16"] is False
    assert hw["peak_tflops"]["bf16"] is None
    assert hw["peak_tflops"]["fp16"] == pytest.approx(112.0)


def test_calibrate_nccl_probe_selects_its_gpu_first(monkeypatch, tmp_path):
    """NCCL binds a communicator to the current device: each probe rank selects its own GPU
    before joining, or every rank would run on GPU 0."""
    import torch
    import torch.distributed as dist

    from fleetwise.calibrate.probes import collectives

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", str(d))))

    def init(*args, **kwargs):
        calls.append(("init", args[0]))
        raise RuntimeError("stop here")

    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(RuntimeError, match="stop here"):
        collectives.allreduce_worker(1, 2, str(tmp_path / "init"), "nccl", str(tmp_path / "out"))
    assert calls == [("set_device", "cuda:1"), ("init", "nccl")]


def test_channels_last_for_16_bit_convolutions_on_gpu():
    import torch

    from fleetwise.runtime.parallelize import memory_format

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    resnet_bf16, _ = compose("recipe=resnet/tiny", "train.precision=bf16", "hardware.has_bf16=true")
    resnet_fp32, _ = compose("recipe=resnet/tiny")
    gpt_bf16, _ = compose("recipe=gpt/tiny", "train.precision=bf16", "hardware.has_bf16=true")
    assert memory_format(resnet_bf16, cuda) == torch.channels_last
    assert memory_format(resnet_bf16, cpu) == torch.preserve_format
    assert memory_format(resnet_fp32, cuda) == torch.preserve_format
    assert memory_format(gpt_bf16, cuda) == torch.preserve_format


def test_checkpoint_rng_state_includes_the_gpu_stream(monkeypatch):
    import torch

    from fleetwise.runtime.checkpoint import rng_state, set_rng_state

    gpu_state = torch.arange(4, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: gpu_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device)))
    cuda = torch.device("cuda", 3)
    state = rng_state(3, cuda)
    assert set(state) == {"rng.rank3", "rng_cuda.rank3"}
    set_rng_state(state, 3, cuda)
    assert restored == [(gpu_state, cuda)]
    assert set(rng_state(0, torch.device("cpu"))) == {"rng.rank0"}
