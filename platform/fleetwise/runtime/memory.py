"""Peak memory of a rank: CUDA allocator statistics on GPU; on CPU the process's peak RSS and
the exact bytes of live tensors, counted on sampled steps."""

from __future__ import annotations

import contextlib
import resource
import sys
import weakref
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten


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
    transient buffers inside one compiled block."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.live: dict[int, int] = {}
        # the dry run counts fake tensors (they are its whole model); a real run holds none
        self.fake = any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
        self.current = 0
        self.peak = 0
        for t in tensors:
            self._track(t)

    def _track(self, t: torch.Tensor) -> None:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            t = t._local_tensor
        if t.device.type != "cpu" or t.is_meta:
            return
        if not self.fake and is_fake(t):  # torch.compile's tracing tensors, not this rank's memory
            return
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # wrapper subclasses without storage
            return
        key = storage._cdata
        if key in self.live:
            return
        nbytes = storage.nbytes()
        self.live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def _resized(self, storage, nbytes: int) -> None:
        """A storage resized in place: FSDP2 frees a resharded parameter with `resize_(0)` and
        re-allocates it for the next all-gather, on the same storage object and outside dispatch."""
        key = storage._cdata
        if key not in self.live:
            return
        self.current += nbytes - self.live[key]
        self.live[key] = nbytes
        self.peak = max(self.peak, self.current)

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
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
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
        tracker = LiveTensorBytes(state_tensors(modules, optimizers, stages, extra))
        with tracker:
            yield
        self.peak = max(self.peak, tracker.peak)
