"""Layout-invariant initialisation: a parameter's initial value is a pure function of
(seed, its model name, its global shape), drawn from a generator of its own.

Why per-parameter generators: the runtime builds the model on the `meta` device, cuts it into
pipeline chunks, shards it (TP, FSDP) and only then allocates this rank's shards. No rank ever
holds the whole model, so a single RNG stream drawn in module order (the eager way) cannot be
replayed. With one generator per parameter, seeded by its name, each rank draws one whole
parameter at a time on the host, keeps its own slice (`distribute_tensor`, no communication) and
drops the rest, so every layout -- and one process -- starts from exactly the same weights. The
alternative, a seed checkpoint streamed from disk, needs a writer that holds every tensor once and
a file of the model's full size; drawing costs one parameter of host memory and nothing on disk.

Each model class says how its parameters are drawn with `init_rule(module_name, module, attr,
shape, generator)`; CTR models keep their own chunked scheme (the parameter server's servers rely on
it) through `initial_value(name, shape, seed)` (the model contract: `models/contract.py`). The rule
GPT and ERNIE share is here (`transformer_rule`); a family's own rule lives with its model.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

_MASK64 = (1 << 64) - 1

# the checkpoint wrapper first: its segment ends in "module." too
# Longest first: "module." is also the tail of "_checkpoint_wrapped_module.".
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def model_name(name: str) -> str:
    """A tensor's name in the plain model, without the DDP / activation-checkpoint / compile
    segments parallelizing adds: initial values, checkpoints and fault reports all use it, so a
    checkpoint written with recompute loads without it and vice versa."""
    for seg in WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


def mix_seed(*values: int) -> int:
    """splitmix64 over a tuple of ints: a well-spread seed for one generator per (seed, parameter
    name) here, per (seed, table, chunk) in the CTR family's tables."""
    x = 0x243F6A8885A308D3
    for v in values:
        x = (x ^ (v & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 31
    return x & ((1 << 63) - 1)


def generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(mix_seed(seed, zlib.crc32(name.encode())))


def full_value(root: nn.Module, module_name: str, module: nn.Module, attr: str, shape, seed: int):
    """The initial value of `module_name.attr` (whole, fp32, on the host)."""
    name = model_name(f"{module_name}.{attr}" if module_name else attr)
    if hasattr(root, "initial_value"):
        return root.initial_value(name, tuple(shape), seed)
    return root.init_rule(model_name(module_name), module, attr, tuple(shape), generator(seed, name))


@torch.no_grad()
def init_weights_(part: nn.Module, seed: int, root: nn.Module | None = None) -> None:
    """Fill every parameter and buffer of `part` (already materialised, possibly sharded DTensors
    or a pipeline chunk) with its slice of the layout-invariant initial value."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    root = part if root is None else root
    for mname, module in part.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for attr, t in tensors:
            full = full_value(root, mname, module, attr, t.shape, seed)
            if isinstance(t, DTensor):
                # src_data_rank=None: every rank cuts its own slice of the same full value, no collective
                local = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local()
                t.to_local().copy_(local)
            else:
                t.copy_(full)


def transformer_rule(std: float, num_layers: int):
    """GPT-2 initialisation: N(0, std) weights, zero biases, residual output projections scaled by
    1/sqrt(2·layers) so the residual stream does not grow with depth; LayerNorm ones/zeros."""

    def rule(mname: str, module: nn.Module, attr: str, shape, g: torch.Generator) -> torch.Tensor:
        if isinstance(module, nn.Linear | nn.Embedding) and attr == "weight":
            scale = 1 / math.sqrt(2 * num_layers) if mname.endswith(("attn.wo", "mlp.fc2")) else 1.0
            return torch.randn(shape, generator=g) * (std * scale)
        if isinstance(module, nn.LayerNorm) and attr == "weight":
            return torch.ones(shape)
        return torch.zeros(shape)  # biases

    return rule
