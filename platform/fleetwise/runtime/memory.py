"""Peak memory of a rank: CUDA allocator statistics on GPU; on CPU the process's peak RSS and
the exact bytes of live tensors, counted on sampled steps."""

from __future__ import annotations

import contextlib
import resource
import sys
import weakref
from collections.abc import Iterator

import torch

from fleetwise.compat import (
    FakeTensorMode,
    TorchDispatchMode,
    dispatch_modes,
    is_fake,
    local_tensor,
    storage_key,
    tree_flatten,
)


def rss_peak_bytes() -> int:
    """Peak resident set size of this process so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class LiveTensorBytes(TorchDispatchMode):
    """Exact bytes of live tensor storage, and their peak, while active.

    Every op's outputs are recorded by storage (a view shares its base's storage and is counted
    once); a weakref finaliser subtracts a storage when it is freed, and in-place storage resizes
    (FSDP2's way of freeing and re-allocating unsharded parameters) are followed. Tensors alive before the
    step (parameters, gradients, optimizer state) are registered up front. DTensors are counted by
    their local shard: that is what this rank holds.

    torch.compile'd blocks (train.compile) run as one fused kernel sequence the mode does not see
    (`ignore_compile_internals`: dynamo refuses to compile under any other mode); what they keep
    for backward is still counted, through a saved-tensors hook, so the peak misses only the
    transient buffers inside one compiled block.

    Host memory, kept apart (`host`: tensors that start in it): a GPU job's offloaded state
    (FSDP's CPUOffloadPolicy) lives in host RAM, not on the device, but its dry run simulates
    every tensor on the one cpu device. Given host tensors, the tracker counts their storages in
    `host_current` / `host_peak` instead of `current` / `peak`, and so does every op's output whose
    inputs (those of more than one element that it tracks) are all in host storages -- where a
    GPU runs that op (the optimizer step on offloaded shards, the gradient norm): a tensor's device
    follows its inputs'. The dry run moves the rest across itself (`to_host`, `on_device`:
    dryrun/rank.py `_offload_on_the_host`), where FSDP's host<->device copies are no-ops on
    a cpu device. Without host tensors (every real run, and dry runs of CPU jobs, whose offloaded
    state is in the same RAM) everything counts in `peak`, as before."""

    def __init__(self, tensors: list[torch.Tensor], host: list[torch.Tensor] = ()):
        super().__init__()
        self.live: dict[int, int] = {}
        # the dry run counts fake tensors (they are its whole model); a real run holds none
        self.fake = any(isinstance(m, FakeTensorMode) for m in dispatch_modes())
        self.current = 0
        self.peak = 0
        self.host: set[int] = set()  # keys of the storages in host memory
        self.host_current = 0
        self.host_peak = 0
        self.separate_host = bool(host)
        self._device_scope = 0
        # the dry run names the moment the step is in (dryrun/rank.py: the pipeline action
        # running) and keeps the peak reached in each; None: not followed
        self.moment: str | None = None
        self.moment_peaks: dict[str, int] = {}
        for t in host:
            self._track(t, host=True)
        for t in tensors:
            self._track(t)

    @staticmethod
    def _storage(t: torch.Tensor):
        """The storage of this rank's part of `t` that the tracker counts, or None."""
        t = local_tensor(t)
        # the device type alone: a meta tensor's is "meta", and `t.is_meta` on a fake tensor is an op
        # dispatched through every mode (~0.2 ms a call in the dry run, 5% of its time)
        if t.device.type != "cpu":
            return None
        try:
            return t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # wrapper subclasses without storage
            return None

    def _track(self, t: torch.Tensor, host: bool = False) -> None:
        t = local_tensor(t)
        # torch.compile's tracing tensors (the saved-tensors hook sees them), not this rank's
        # memory: subclasses (FakeTensor, FunctionalTensor), so a plain tensor skips is_fake, which
        # cost more than the rest of this call (compiled train.compile runs: peaks byte-identical)
        if not self.fake and type(t) is not torch.Tensor and is_fake(t):
            return
        storage = self._storage(t)
        if storage is None:
            return
        key = storage_key(storage)
        if key in self.live:
            return
        nbytes = storage.nbytes()
        self.live[key] = nbytes
        if host:
            self.host.add(key)
            self.host_current += nbytes
            self.host_peak = max(self.host_peak, self.host_current)
        else:
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            if self.moment is not None and self.current > self.moment_peaks.get(self.moment, 0):
                self.moment_peaks[self.moment] = self.current
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        if key in self.host:
            self.host.discard(key)
            self.host_current -= nbytes
        else:
            self.current -= nbytes

    def _resized(self, storage, nbytes: int) -> None:
        """A storage resized in place: FSDP2 frees a resharded parameter with `resize_(0)` and
        re-allocates it for the next all-gather, on the same storage object and outside dispatch."""
        key = storage_key(storage)
        if key not in self.live:
            return
        delta, self.live[key] = nbytes - self.live[key], nbytes
        if key in self.host:
            self.host_current += delta
            self.host_peak = max(self.host_peak, self.host_current)
        else:
            self.current += delta
            self.peak = max(self.peak, self.current)
            if self.moment is not None and self.current > self.moment_peaks.get(self.moment, 0):
                self.moment_peaks[self.moment] = self.current

    def in_host(self, t: torch.Tensor) -> bool:
        storage = self._storage(t)
        return storage is not None and storage_key(storage) in self.host

    def to_host(self, t: torch.Tensor) -> None:
        """`t`'s storage is in host memory from now on (a GPU would hold a host copy of it and
        free its device original: FSDP's offloaded gradient)."""
        storage = self._storage(t)
        if storage is None:
            return
        key = storage_key(storage)
        if key not in self.live:
            self._track(t, host=True)
        elif key not in self.host:
            nbytes = self.live[key]
            self.current -= nbytes
            self.host.add(key)
            self.host_current += nbytes
            self.host_peak = max(self.host_peak, self.host_current)

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """Outputs of ops inside are device memory whatever their inputs (the copies a GPU makes
        of host tensors on the device: FSDP's all-gather inputs from offloaded shards)."""
        self._device_scope += 1
        try:
            yield
        finally:
            self._device_scope -= 1

    def _on_host(self, args, kwargs) -> bool:
        """An op's outputs are host memory when its tracked inputs of more than one element all are
        (scalars -- a learning rate, a norm -- go where they are needed, and cost nothing)."""
        if not self.host or self._device_scope:
            return False
        keys = []
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.numel() > 1:
                storage = self._storage(t)
                if storage is not None and storage_key(storage) in self.live:
                    keys.append(storage_key(storage))
        return bool(keys) and all(k in self.host for k in keys)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _saved(self, t: torch.Tensor) -> torch.Tensor:
        """Count a tensor autograd saves, and save it detached (the same storage). Saved as it is,
        a node's own output would hold the node (its grad_fn) from inside the node: a reference
        cycle that outlives the graph wherever a backward keeps the graph (retain_graph=True, as
        the zero-bubble schedules' input-gradient step does) -- the log-softmax output kept every
        micro-batch's whole last stage alive to the end of the step, in this tracker's runs only."""
        self._track(t)
        return t.detach()

    def __enter__(self):
        tracker, resize = self, torch.UntypedStorage.resize_

        def resize_and_track(storage, size):
            out = resize(storage, size)
            tracker._resized(storage, storage.nbytes())
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = resize_and_track
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._saved, lambda t: t)
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        out = super().__exit__(*exc)
        self._hooks.__exit__(*exc)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        host = self._on_host(args, kwargs)
        out = func(*args, **(kwargs or {}))
        # most ops return one tensor: no pytree walk (it cost as much as the tracking)
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, host=host)
        return out


def state_tensors(modules: list, optimizers: list, stages: list = (), extra: list = ()) -> list[torch.Tensor]:
    """Tensors that outlive a step: parameters, buffers, gradients, optimizer state, and the
    receive buffers of pipeline stages (runtime/pipeline_stage.py: those handed out and the free ones)."""
    out: list[torch.Tensor] = []
    for m in modules:
        for p in m.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
        out.extend(m.buffers())
    out.extend(extra)  # an engine's own buffers (ZeRO-1's gradient buffers and fp32 masters)
    for opt in optimizers:
        for state in opt.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    for stage in stages:
        recv = [getattr(d, "held", d.values)() for d in (stage.args_recv_info, stage.grad_recv_info)]
        for infos in (*recv[0], *recv[1]):
            out.extend(i.buffer for i in infos if isinstance(getattr(i, "buffer", None), torch.Tensor))
    return out


class TensorPeak:
    """Peak bytes of live tensors during a step.

    GPU: the allocator's max_memory_allocated (reset every step), exact and free, and beside it
    max_memory_reserved: what the caching allocator held from the device (allocated plus its cache
    and fragmentation) -- the number an OOM is about.
    CPU: `LiveTensorBytes` follows every allocation through a dispatch mode; that costs time, so
    only sampled steps are tracked: the first two this process runs (in a fresh job the second is
    the first with optimizer state, i.e. the steady-state peak; a resumed job has it from the first)."""

    def __init__(self, device: torch.device, samples: int = 2):
        self.device = device
        self.samples = samples  # steps still to track
        self.peak = 0  # running max over measured steps
        self.reserved = 0  # CUDA: running max of the allocator's reserved bytes (0 elsewhere)
        # the dry run of a GPU job with offload only: its host-resident state (() -> tensors), and
        # the running max of the host bytes live (LiveTensorBytes' `host`); a real run has none
        self.host_state = None
        self.host_peak = 0

    @contextlib.contextmanager
    def measure(self, modules: list, optimizers: list, stages: list = (), extra: list = ()) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
            self.reserved = max(self.reserved, torch.cuda.max_memory_reserved(self.device))
            return
        if self.samples <= 0:
            yield
            return
        self.samples -= 1
        host = self.host_state() if self.host_state is not None else []
        tracker = LiveTensorBytes(state_tensors(modules, optimizers, stages, extra), host=host)
        with tracker:
            yield
        self.peak = max(self.peak, tracker.peak)
        self.host_peak = max(self.host_peak, tracker.host_peak)
