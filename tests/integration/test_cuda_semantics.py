"""Every strategy on a process group that, like NCCL, refuses tensors not on the job's device
(tests/helpers/cuda_semantics.py): the real trainer runs two steps per layout and precision, one process
per simulated rank. Catches host tensors in collectives -- the per-step metrics vector, the
gradient norm and finite flag of offloaded (host) gradients, GradScaler's found_inf -- that gloo
accepts and NCCL refuses at the first step of the first multi-GPU run."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BASE = ("recipe=gpt/tiny", "hardware=a100", "train.global_batch_size=8", "train.micro_batch_size=2")
SHARDING = ("strategy=sharding", "hardware.devices_per_node=2")
PP = ("strategy=pp", "hardware.devices_per_node=2")
CASES = {
    "dp2_bf16": ("strategy=dp", "hardware.devices_per_node=2", "train.precision=bf16"),
    "dp2_fp16": ("strategy=dp", "hardware.devices_per_node=2", "train.precision=fp16"),
    "sharding1_zero": (*SHARDING, "strategy.sharding_stage=1"),
    # ZeRO-1's 16-bit working weights and GradScaler on its fp32 master gradients
    "sharding1_zero_fp16": (*SHARDING, "strategy.sharding_stage=1", "train.precision=fp16"),
    "sharding2_bf16": (*SHARDING, "strategy.sharding_stage=2", "train.precision=bf16"),
    "sharding3": (*SHARDING, "strategy.sharding_stage=3"),
    "sharding2_offload": (*SHARDING, "strategy.sharding_stage=2", "strategy.offload=true"),
    "sharding3_offload_bf16": (*SHARDING, "strategy.sharding_stage=3", "strategy.offload=true", "train.precision=bf16"),
    "sharding3_offload_fp16": (*SHARDING, "strategy.sharding_stage=3", "strategy.offload=true", "train.precision=fp16"),
    "mp2": ("strategy=mp", "strategy.mp_degree=2", "hardware.devices_per_node=2", "strategy.sequence_parallel=true"),
    # tensor parallel without FSDP under GradScaler: the position embedding and the norms (no
    # sequence parallelism) beside the DTensor weights in one unscale
    "mp2_fp16": ("strategy=mp", "strategy.mp_degree=2", "hardware.devices_per_node=2", "train.precision=fp16"),
    # ERNIE's embedding norm, segment embedding and head transform, on pipeline stages
    "ernie_pp2_mp2_sp_fp16": (
        "recipe=ernie/tiny", "strategy=hybrid", "hardware.devices_per_node=4", "strategy.pp_degree=2",
        "strategy.mp_degree=2", "strategy.sequence_parallel=true", "train.precision=fp16",
    ),
    "pp2_1F1B_fp16": (*PP, "strategy.schedule=1F1B", "train.precision=fp16"),
    "pp2_interleaved_bf16": (*PP, "strategy.schedule=interleaved_1F1B", "strategy.virtual_stages=2", "train.precision=bf16"),
    "hybrid_dp2_pp2_sh2_mp2_offload_bf16": (
        "strategy=hybrid", "hardware.devices_per_node=8", "hardware.nodes=2", "strategy.dp_degree=2",
        "strategy.pp_degree=2", "strategy.sharding_degree=2", "strategy.sharding_stage=3",
        "strategy.mp_degree=2", "strategy.offload=true", "train.precision=bf16", "train.global_batch_size=16",
    ),
}  # fmt: skip


@functools.cache
def _fork_server():
    """The simulated ranks start from a fork server that imported torch, the harness and the trainer
    once per test process (a new interpreter per rank paid ~5 s of CPU in imports)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["helpers.cuda_semantics", "fleetwise.runtime.trainer", "torch.distributed.pipelining"]
    )
    return ctx


def simulate(tmp_path: Path, overrides: tuple[str, ...]) -> dict:
    """Run the simulated ranks (rank 0 and its pipeline peers) side by side; rank 0's metrics."""
    from helpers.cuda_semantics import forked_rank, ranks_to_run

    args = [*BASE, *overrides]
    steps = int(os.environ.get("HARNESS_STEPS", "2"))
    ctx = _fork_server()
    procs = {
        r: ctx.Process(
            target=forked_rank,
            args=(r, tmp_path, args, steps, tmp_path / f"rank_{r}.log", tmp_path / f"rank_{r}.json"),
        )
        for r in ranks_to_run(args)
    }
    for p in procs.values():
        p.start()
    for p in procs.values():
        p.join(timeout=600)
    for p in procs.values():
        if p.exitcode is None:
            p.kill()
    failed = {
        r: ((tmp_path / f"rank_{r}.log").read_text().strip().splitlines() or ["(no output)"])[-1]
        for r, p in procs.items()
        if p.exitcode != 0
    }
    assert not failed, failed
    return json.loads((tmp_path / "rank_0.json").read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_strategy_runs_with_device_only_collectives(tmp_path, name):
    metrics = simulate(tmp_path, (*CASES[name], "train.steps=2"))
    # two steps went through the whole loop (both read: the first and the last): the metrics
    # vector reached rank 0 from every rank
    assert metrics["step"] == 2
    assert metrics["train/loss"] == 1.0  # every host read of a device scalar answers 1
    assert metrics["train/skipped_steps"] == 0.0
    # the optimizer step of offloaded shards runs on the host: torch's fused CPU AdamW (the
    # multi-tensor step made a temporary per parameter there); on the device, multi-tensor
    offloaded = "strategy.offload=true" in CASES[name]
    assert metrics["optimizer_kernels"] == (["fused"] if offloaded else ["foreach"]), metrics["optimizer_kernels"]


def test_no_host_device_sync_between_log_steps(tmp_path, monkeypatch):
    """Steps that neither log nor checkpoint never wait for the device: no scalar read, no
    device-to-host copy, no synchronize, no host-to-device copy the host waits for -- the inputs
    of every micro-batch cross from pinned memory, non-blocking (counted by the harness: before,
    two inputs x two micro-batches made 4 syncs in every step); the reading steps read every
    step's metrics at once, finite flags included, in one collective more than a step that does
    not read. Two layouts: DDP under bf16 autocast, and pipeline × FSDP × TP."""
    monkeypatch.setenv("HARNESS_STEPS", "5")
    steps = ("train.steps=5", "train.log_interval=4")
    layouts = {
        "dp2_bf16": (*CASES["dp2_bf16"], *steps),
        "pp2_sh2_mp2": (
            "strategy=hybrid", "hardware.devices_per_node=8", "strategy.pp_degree=2", "strategy.sharding_degree=2",
            "strategy.sharding_stage=2", "strategy.mp_degree=2", "train.precision=bf16", *steps,
        ),
    }  # fmt: skip
    for name, overrides in layouts.items():
        (tmp_path / name).mkdir()
        out = simulate(tmp_path / name, overrides)
        syncs = out["syncs_per_step"]
        # steps 2 and 3 neither log nor checkpoint; step 1 reads (the first step always does),
        # step 4 logs, step 5 is the last
        non_log = syncs[1:3]
        assert len(non_log) == 2 and all(n == 0 for n in non_log), (name, syncs)
        assert syncs[0] > 0 and syncs[3] > 0 and syncs[4] > 0, (name, syncs)
        calls = out["collectives_per_step"]
        assert calls[1] == calls[2] and calls[3] == calls[4] == calls[1] + 1, (name, calls)
        assert out["step"] == 5, name  # rank 0's records reached it through the reading steps


def test_synthetic_images_are_drawn_on_the_device(tmp_path, monkeypatch):
    """ResNet's synthetic images (data=synthetic, the GPU bench's data) are drawn on the job's
    device: per step only the labels cross from the host (before: every image, drawn with numpy
    on the host, ~3 ms per 224x224 image)."""
    monkeypatch.setenv("HARNESS_STEPS", "3")
    dp2 = ("recipe=resnet/tiny", "data=synthetic", "strategy=dp", "hardware.devices_per_node=2")
    out = simulate(tmp_path, (*dp2, "train.precision=fp16", "train.steps=3"))
    per_rank = 8 // 2  # train.global_batch_size over dp 2
    # step 2 reads nothing back (step 1 and the last step read the metrics: a small host row)
    assert out["h2d_elements_per_step"][1] == per_rank, out["h2d_elements_per_step"]
    assert out["step"] == 3
