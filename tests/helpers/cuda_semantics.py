"""CUDA/NCCL semantics on a CPU build: one simulated rank of a real fleetwise job whose collectives,
like NCCL's, refuse every tensor that is not on the job's device.

`forked_rank(RANK, MESSAGES_DIR, OVERRIDES, …)` in a process of its own per simulated rank, forked
from a server that imported this module (and torch) once (tests/integration/test_cuda_semantics.py).

Why this shape (torch 2.13, CPU build):
- The process group is `init_process_group("meta:fake", store=FakeStore())`: its only backend is for
  the job's device type, so a host (CPU) tensor in a collective fails exactly as under NCCL ("No
  backend type associated with device type cpu"). Collectives move no data.
- The job's device is `meta`, not a fake `cuda`: fake CUDA tensors can be created on a CPU build,
  but any op on them aborts the process in C++ (no CUDA device guard). Meta tensors run forward,
  backward, DTensor, FSDP2 and the pipeline schedules; like GPU memory they are not host memory.
- The fake world is the dry run's own harness (fleetwise/dryrun/fake.py): the fake process group
  (`join_fake_world`), the answers to host reads of device scalars (`HostReads`: `.item()` reads
  1.0 -- finite, one -- integers 0 -- the pipeline's warm-up vote -- and GradScaler's found_inf 0),
  and the pipeline's metadata messages (pickled objects between stages) through files
  (`MetaRelay`), because fake collectives carry no data: simulated ranks of one pipeline must
  run at the same time.
- What the stand-in device lacks is supplied here (what it changes inside FSDP2 and DDP, with torch's
  private names, in fleetwise/dryrun/patches.py), and only that: a device module (`torch.meta`:
  current_device, streams, events), device-to-host copies (ones; a GradScaler flag 0), pinned
  host memory, FSDP2's host copy of offloaded meta shards (which it skips for meta parameters),
  DDP with a Python all-reduce hook (its C++ hook needs a result the fake backend does not
  produce) and without its data-dependent start-up checks and bucket rebuild. The count of host-device synchronizations is this test's own.
- Not covered: checkpoints (DCP writes tensor data, which the device does not hold), and code
  behind `device.type == "cuda"` tests (DDP device_ids, CUDA memory statistics, CUDA events).
  Pinned host memory is: `pin_memory()` marks its copy pinned, and a host-to-device copy waits
  (a sync) unless it is non-blocking from pinned memory.
- autocast has no meta kernels: 16-bit runs use it as a no-op; the trainer's precision logic, the
  GradScaler and FSDP's MixedPrecisionPolicy run as configured.

Everything else is the product: Trainer, parallelize (DDP, ZeRO-1, FSDP2 ± offload, TP,
pipelining), the optimizer step, clipping, the per-step metrics reduction.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import traceback
import types
import weakref
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from fleetwise.compat import PIN_MEMORY, SCALAR_READ, TO_COPY, TorchDispatchMode, storage_key
from fleetwise.dryrun import patches as torch_patches
from fleetwise.dryrun.fake import HostReads, MetaRelay, join_fake_world

DEVICE = torch.device("meta")


# host-device synchronizations so far: host reads of device data and device synchronize calls
SYNCS = {"count": 0}
# collectives so far (c10d ops: each one a point where a rank waits for its peers)
COLLECTIVES = {"count": 0}
# elements copied from the host to the device so far
H2D = {"elements": 0}
# storages of host tensors in page-locked ("pinned") memory, which a CPU build has none of
PINNED: set[int] = set()


def pin(t: torch.Tensor) -> torch.Tensor:
    """Mark `t`'s storage as pinned host memory (until it is freed)."""
    key = storage_key(t.untyped_storage())
    PINNED.add(key)
    weakref.finalize(t.untyped_storage(), PINNED.discard, key)
    return t


def pinned(t: torch.Tensor) -> bool:
    return storage_key(t.untyped_storage()) in PINNED


class DeviceReads(TorchDispatchMode):
    """Host-device synchronizations, counted in SYNCS: host reads of device data -- a scalar read
    (`.item()`, `float()`, answered by the dry run's HostReads) and a device-to-host copy -- and
    host-to-device copies that make the host wait: from pageable memory, or blocking (CUDA stages
    a pageable copy synchronously; only a non-blocking copy from pinned memory is queued on the
    stream). `pin_memory()` makes a pinned copy here. Collectives are counted in COLLECTIVES."""

    def __init__(self):
        super().__init__()
        self.reads = HostReads()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            COLLECTIVES["count"] += 1
        if func is SCALAR_READ and args[0].is_meta:
            SYNCS["count"] += 1
            return self.reads.answer(args[0])
        self.reads.note(func, args)
        if func is torch.ops.aten.is_pinned.default:
            return pinned(args[0])
        if func is PIN_MEMORY:
            return pin(args[0].clone())
        if func is TO_COPY and args[0].is_meta and str(kwargs.get("device")) == "cpu":
            SYNCS["count"] += 1
            return torch.ones(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if func is torch.ops.aten.copy_.default and args[1].is_meta and args[0].device.type == "cpu":
            SYNCS["count"] += 1
            # a GradScaler found-inf flag (offload: on the host) reads 0, as HostReads answers it
            return args[0].fill_(0 if storage_key(args[0].untyped_storage()) in self.reads.found_inf else 1)
        if func is TO_COPY and args[0].device.type == "cpu":
            to_device = str(kwargs.get("device")) == "meta"
            SYNCS["count"] += to_device and not (kwargs.get("non_blocking") and pinned(args[0]))
            H2D["elements"] += args[0].numel() if to_device else 0
        if func is torch.ops.aten.copy_.default and args[0].is_meta and args[1].device.type == "cpu":
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            SYNCS["count"] += not (non_blocking and pinned(args[1]))
            H2D["elements"] += args[1].numel()
        return func(*args, **kwargs)


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def wait(self, *args):
        pass

    def synchronize(self):
        SYNCS["count"] += 1

    def query(self):
        return True


class _Stream(_Event):
    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, event=None):
        return event or _Event()


def _synchronize(*args) -> None:
    SYNCS["count"] += 1


def _device_module(world: int):
    stream = _Stream()
    return types.SimpleNamespace(
        current_device=lambda: 0,
        device_count=lambda: world,
        set_device=lambda d: None,
        is_available=lambda: True,
        is_initialized=lambda: True,
        synchronize=_synchronize,
        Stream=_Stream,
        Event=_Event,
        current_stream=lambda *a: stream,
        stream=lambda s: contextlib.nullcontext(),
    )


def _ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    def allreduce_hook(group, bucket):
        buf = bucket.buffer()
        dist.all_reduce(buf, group=group)  # the device rule applies to the bucket
        fut = torch.futures.Future()
        fut.set_result(buf)
        return fut

    class HookedDDP(DistributedDataParallel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.register_comm_hook(self.process_group, allreduce_hook)
            torch_patches.ddp_keeps_its_first_buckets(self)

    return HookedDDP


@contextlib.contextmanager
def cuda_semantics(cfg, rank: int, messages: Path):
    """The fake process group and the stand-ins above, for one simulated rank. The group has the
    backends the product asks for, with the job's device in place of cuda; the pipeline's metadata
    goes through files in `messages`."""
    from fleetwise.runtime.mesh import process_group_backend

    backend = process_group_backend(cfg)
    fake = {"nccl": "meta:fake", "cpu:gloo,cuda:nccl": "cpu:fake,meta:fake"}[backend]
    world = cfg.hardware.world_size
    join_fake_world(rank, world, fake)
    MetaRelay(messages, timeout_s=300).install()
    real_autocast = torch.autocast

    def autocast(device_type, *args, **kwargs):
        return (
            contextlib.nullcontext() if device_type == "meta" else real_autocast(device_type, *args, **kwargs)
        )

    patches = [
        mock.patch.object(torch, "meta", _device_module(world), create=True),
        mock.patch("torch.autocast", autocast),
        mock.patch("fleetwise.runtime.parallelize.DistributedDataParallel", _ddp_class()),
        torch_patches.fsdp_and_ddp_on_a_stand_in_device(DEVICE, pin),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(DeviceReads())
        yield


def run_rank(rank: int, messages: Path, overrides: list[str], steps: int = 2) -> dict:
    """Build the real Trainer for `rank` of the job the overrides describe and run `steps` steps
    on the stand-in device; returns rank 0's last metrics ({} on other ranks) and, under
    `syncs_per_step`, `collectives_per_step` and `h2d_elements_per_step`, this rank's
    host-device synchronizations, collectives and elements copied from the host to the device in
    each step, and under `optimizer_kernels` the update kernels of its optimizers
    (torch's `fused` or `foreach`, or `default`: torch's choice by the tensors' device)."""
    from fleetwise.config.validate import load_config
    from fleetwise.plan import make_plan
    from fleetwise.runtime.mesh import DistEnv
    from fleetwise.runtime.trainer import Trainer

    cfg = load_config(overrides)
    plan = make_plan(cfg)
    world = cfg.hardware.world_size
    metrics: dict = {}
    with cuda_semantics(cfg, rank, messages), tempfile.TemporaryDirectory() as run_dir:
        env = DistEnv(rank, world, 0, DEVICE, 0)
        trainer = Trainer(cfg, plan, env, Path(run_dir))
        syncs, collectives, copied = [], [], []
        for step in range(1, steps + 1):
            before, calls, elements = SYNCS["count"], COLLECTIVES["count"], H2D["elements"]
            records = trainer.train_step(step)
            syncs.append(SYNCS["count"] - before)
            collectives.append(COLLECTIVES["count"] - calls)
            copied.append(H2D["elements"] - elements)
            metrics = records[-1] if records else metrics
        kernels = {
            next((k for k in ("fused", "foreach") if opt.defaults.get(k)), "default")
            for opt in trainer.optimizers.local()
        }
    return {
        **metrics,
        "syncs_per_step": syncs,
        "collectives_per_step": collectives,
        "h2d_elements_per_step": copied,
        "optimizer_kernels": sorted(kernels),
    }


def ranks_to_run(overrides: list[str]) -> list[int]:
    """Rank 0 and the other stages of its pipeline (they exchange metadata); every other rank runs
    the same code as one of these."""
    from fleetwise.config.layout import Layout
    from fleetwise.config.validate import load_config

    layout = Layout.of(load_config(overrides))
    return [
        r for r in range(layout.world_size) if all(v == 0 for k, v in layout.coords(r).items() if k != "pp")
    ]


def forked_rank(rank: int, messages: Path, overrides: list[str], steps: int, log: Path, result: Path) -> None:
    """`run_rank` in a process of its own, forked from a fork server that imported this module: its
    output into `log`, its metrics as JSON into `result`; it ends without teardown (exit 1 on an
    exception, whose traceback and a one-line summary are the log's last lines)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        out = run_rank(rank, messages, overrides, steps=steps)
    except Exception as err:
        traceback.print_exc()
        print(f"FAILED rank {rank}: {type(err).__name__}: {err}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
    result.write_text(json.dumps(out))
    os._exit(0)  # the fake group needs no teardown
