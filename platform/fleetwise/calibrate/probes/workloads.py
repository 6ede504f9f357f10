"""What the probes run and count: the aten ops a region dispatches, and a chain of tiny blocks
whose forward + backward the host-cost probes time."""

from __future__ import annotations

import torch

from fleetwise.compat import TorchDispatchMode

GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "linear", "matmul"})


class OpCounter(TorchDispatchMode):
    """Counts the aten ops a region dispatches: all of them (`count`), the matmul-like ones
    (`gemms`: linear, conv, attention; `convs` of them convolutions) and the elements the other
    non-view ops write (`elements`): the planner's per-unit fwd_ops, fwd_gemms, fwd_convs and
    fwd_elementwise count the same things."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.gemms = 0
        self.convs = 0
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += 1
        name = func.overloadpacket.__name__  # "mm", "convolution", …
        if name in GEMM_OPS or name.startswith("_scaled_dot_product"):
            self.gemms += 1
            self.convs += name == "convolution"
        elif not func.is_view and name != "_unsafe_view":
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.elements += sum(o.numel() for o in outs if isinstance(o, torch.Tensor))
        return out


class Block(torch.nn.Module):
    """A pre-LN MLP block: the op mix of a transformer block at a width where FLOPs are negligible."""

    def __init__(self, width: int):
        super().__init__()
        self.ln = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, width)
        self.fc2 = torch.nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(h)), approximate="tanh"))


class Chain(torch.nn.Module):
    """`layers` blocks of `width` (made by `block`) in a row, summed: forward + backward of it is
    what the host-cost probes time."""

    def __init__(self, layers: int, width: int, block=Block):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): block(width) for i in range(layers)})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            h = block(h)
        return h.sum()
