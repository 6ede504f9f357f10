"""The fake-execution harness: the real per-rank runtime of one rank of a job of any size, run
without the memory, the compute or the other ranks. Shared by the dry run (dryrun/rank.py) and the
CUDA-semantics tests (tests/helpers/cuda_semantics.py, which add a stand-in device on top).

- `join_fake_world(rank, world_size, backends)`: torch's `fake` process-group backend (its
  FakeProcessGroup): every collective "succeeds" at once, moving nothing; the DeviceMesh and its
  subgroups are real. `init_fake_world` is the dry run's: the same, with the patches that give
  the fake backend the memory behaviour of the job's real one (dryrun/patches.py).
- `FakeExecution`: a context holding a `FakeTensorMode` (tensors with shapes, dtypes and storages
  but no data). `FakeExecution.allocate` is the `allocate` hook of `runtime.parallelize.parallelize`:
  a meta-built part gets fake storage instead of real memory and initial values.
- `HostReads`: the answers to host reads of device scalars (`.item()`, `float(t)`, `bool(t)`),
  which tensors without data cannot give.
- `MetaRelay`: pipelining's stage metadata between simulated ranks, through files.

Traps (torch 2.13, CPU build): DeviceMesh creation and `parallelize_module` / `fully_shard` must run
outside `FakeTensorMode` (mesh coordinates call `nonzero`); only allocation and the steps run inside.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from fleetwise import compat
from fleetwise.dryrun import patches


def join_fake_world(rank: int, world_size: int, backends: str = "fake") -> None:
    """Join a fake process group of `world_size` ranks as `rank` (no other process needed).
    backends: "fake", or per device type ("meta:fake": a group with no cpu backend, which refuses
    host tensors in collectives as NCCL does)."""
    if not dist.is_initialized():
        dist.init_process_group(backends, store=patches.fake_store(), rank=rank, world_size=world_size)


def init_fake_world(rank: int, world_size: int, backend: str = "nccl") -> None:
    """Join a fake process group of `world_size` ranks as `rank` (no other process needed), whose
    collectives hold the memory the job's real `backend` holds (dryrun/patches.py)."""
    patches.require_checked_torch()
    join_fake_world(rank, world_size)
    patches.works_hold_their_tensors()
    patches.ddp_bucket_indices_on_the_host()
    patches.reduce_scatter_copies_its_input(backend == "gloo")


class HostReads:
    """Answers to host reads of device scalars (`aten._local_scalar_dense`: `.item()`, `float(t)`,
    `bool(t)`), which tensors without data cannot give: floating and bool scalars read 1 / True (a
    finite flag is finite, a loss or norm is 1.0); integers read 0: the one integer read in the
    runtime is torch.distributed.pipelining's warm-up vote, where 0 means "some stage has no static
    shapes", which is true of fleetwise's stages, so the schedule takes the same dynamic-shape path
    as the real run (its metadata goes through `MetaRelay`); except GradScaler's found-inf flags
    (fp16: the tensors `_amp_foreach_non_finite_check_and_unscale_` writes, `note`d as they are
    written), which read 0 -- no overflow, so the optimizer steps as in a healthy step (read as
    1.0, every fp16 step was a skipped one: no update, no optimizer state)."""

    def __init__(self):
        # storages of the live GradScaler found-inf flags; a flag's key leaves with the flag (a
        # freed storage's address is reused: a later tensor there, e.g. a metrics row, would read 0)
        self.found_inf: set[int] = set()
        self.reads = 0

    def note(self, func, args) -> None:
        """Follow the ops that write found-inf flags (call it on every op, before running it)."""
        if func is compat.AMP_UNSCALE:
            key = compat.storage_key(args[1].untyped_storage())
            self.found_inf.add(key)
            weakref.finalize(args[1], self.found_inf.discard, key)

    def answer(self, t: torch.Tensor):
        """The value a host read of the scalar tensor `t` returns."""
        self.reads += 1
        if t.dtype == torch.bool:
            return True
        if compat.storage_key(t.untyped_storage()) in self.found_inf:
            return 0.0
        return 1.0 if t.dtype.is_floating_point or t.dtype.is_complex else 0


class NotAlike(RuntimeError):
    """A stage answered for an alike one does not map its metadata to itself (MetaRelay)."""


class MetaRelay:
    """Carries torch.distributed.pipelining's stage metadata (the pickled shapes a stage sends its
    neighbour with send_object_list before the first step) between simulated ranks, through files
    in `folder`: the fake backend moves no data, and a stage cannot infer its input shapes without
    its neighbour's. The stages of one pipeline are therefore simulated at the same time: all of
    them, or, when `folder` holds a stand-ins file (dryrun/parent.py `stand_ins`: the middle
    stages are alike), only those it lists as running. A stage that does not run is answered from
    the real metadata of an alike one: forward, what stage `forward` sent on, if it equals what it
    received; backward, the same of stage `backward` (that equality makes every alike middle stage
    send on what it receives, see `stand_ins`). An inequality raises NotAlike (the launcher then
    runs every stage)."""

    def __init__(self, folder, timeout_s: float = 1800.0):
        import json
        from pathlib import Path

        from fleetwise import rundir

        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.timeout_s = timeout_s
        self.sent: dict[tuple[int, int], int] = defaultdict(int)
        self.received: dict[tuple[int, int], int] = defaultdict(int)
        plan = self.folder / rundir.STAND_INS_FILE
        self.stand_ins = json.loads(plan.read_text()) if plan.exists() else None

    def rewind(self) -> None:
        """Start the exchange over, for another trainer of the same stages in this process (layer
        sampling): its stages send the same metadata again and read what was sent before."""
        self.sent.clear()
        self.received.clear()

    def _path(self, src: int, dst: int, seq: int):
        return self.folder / f"stage{src}_to_{dst}_{seq}.pkl"

    def put(self, src: int, dst: int, meta) -> None:
        import pickle

        seq = self.sent[src, dst]
        self.sent[src, dst] += 1
        tmp = self._path(src, dst, seq).with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(pickle.dumps(meta))
        os.replace(tmp, self._path(src, dst, seq))

    def get(self, src: int, dst: int):
        seq = self.received[src, dst]
        self.received[src, dst] += 1
        if self.stand_ins is None or src in self.stand_ins["running"]:
            return self._wait(src, dst, seq)
        # src does not run: answered by the alike stage that does, if it maps its metadata to itself
        s = self.stand_ins["forward"] if src < dst else self.stand_ins["backward"]
        step = 1 if src < dst else -1
        received, sent = self._wait(s - step, s, seq), self._wait(s, s + step, seq)
        if received != sent:
            raise NotAlike(
                f"pipeline stages are not alike: stage {s} received {received!r} from stage {s - step} "
                f"but sent {sent!r} to stage {s + step}, so it cannot answer for stage {src}"
            )
        return sent

    def _wait(self, src: int, dst: int, seq: int):
        import pickle

        path, waited = self._path(src, dst, seq), 0.0
        while not path.exists():
            if waited > self.timeout_s:
                raise TimeoutError(
                    f"pipeline stage {src} never sent its metadata to stage {dst} ({path}): "
                    "simulate every stage of one pipeline together"
                )
            time.sleep(0.05)
            waited += 0.05
        return pickle.loads(path.read_bytes())

    def install(self) -> None:
        """Route PipelineStage's metadata exchange (this process only) through the relay."""
        relay = self
        patches.route_stage_metadata(
            send=lambda stage, meta, dst_stage: relay.put(stage.stage_index, dst_stage, meta),
            recv=lambda stage, src_stage: relay.get(src_stage, stage.stage_index),
        )


class FakeExecution:
    """`with FakeExecution() as fx:` -- tensors created or computed inside are fake.
    Re-enterable (allocation, then each step)."""

    def __init__(self):
        # allow_non_fake_inputs: real host tensors (data batches, constants) mix with fake ones
        self.mode = compat.FakeTensorMode(allow_non_fake_inputs=True)

    def __enter__(self) -> FakeExecution:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)

    def allocate(self, device: torch.device):
        """The `allocate` hook of `parallelize`: fake storage for this rank's shards, no values."""

        def allocate(part: nn.Module) -> None:
            with self:
                part.to_empty(device=device)

        return allocate

