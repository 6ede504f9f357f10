"""Your own nn.Module, adapted to the model contract (fleetwise.models.contract) in place.

The module keeps its class, its forward and its parameter names (`trunk.0.fc1.weight`): the
adapter gives the built instance a subclass of its own class that adds what the runtime relies
on, and nothing else:

- `layers`: the blocks (`model.blocks`), as a `BlockList` -- an nn.ModuleDict keyed '0', '1', …
  that iterates and indexes like the nn.ModuleList it replaces, so the user's `for b in self.trunk`
  runs whatever the runtime put there (checkpoint wrappers, compiled blocks, FSDP units);
- `first_modules` / `last_modules`: the root's children before and after the blocks, when the
  trace found forward to be that chain (then a pipeline stage runs its part of the chain);
- `forward(*inputs)`: the batch entries by position (`model.inputs`) or by name (forward(**batch));
  when forward returns the loss (no `model.loss`), the loss tensor;
- `initial_value(name, shape, seed)`: each module's tensors as `torch.manual_seed(seed);
  Module(**kwargs)` makes them. The constructor calls every module's reset_parameters in the order
  the modules are registered, drawing from one RNG stream; `InitReplay` replays that stream module
  by module on the host -- one module's tensors at a time, never the whole model -- and each rank
  keeps the slices of its shards. Equal in every layout, and equal to the plain eager build.
  A Hugging Face model (a transformers PreTrainedModel) is initialised by its own `_init_weights`,
  module by module from the same one stream: the values transformers gives weights it does not
  load (normal(0, initializer_range), norms at one, rotary frequencies computed). Not bit-equal to
  an eager `from_config` under the same seed: transformers builds each nested sub-model and runs
  its initialisation before constructing the next part, an order fleetwise does not replay.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fleetwise.families.custom.derive import Derived, output_loss
from fleetwise.families.custom.initializer import initializer


class BlockList(nn.ModuleDict):
    """An nn.ModuleDict keyed by block index that reads like the nn.ModuleList it replaces."""

    def __iter__(self):
        return iter(list(self.values()))

    def __getitem__(self, idx):
        if isinstance(idx, int | slice):
            return list(self.values())[idx]
        return super().__getitem__(idx)


class InitReplay:
    """The constructor's initialisation, replayed module by module (see the module docstring).

    Shared by the pipeline chunks of one model (deepcopy returns it), walked forward as the
    chunks' tensors are asked for in module order; asked for a tensor it has passed, it restarts."""

    def __init__(self, template: nn.Module):
        self.template = template  # the whole module on meta: shapes only
        self.seed: int | None = None
        self._walk = None
        self._current: dict[str, torch.Tensor] = {}

    def __deepcopy__(self, memo):
        return self

    def value(self, name: str, seed: int) -> torch.Tensor:
        if seed != self.seed or self._walk is None:
            self._restart(seed)
        for _ in range(2):
            if name in self._current:
                return self._current[name]
            for tensors in self._walk:
                self._current = tensors
                if name in tensors:
                    return tensors[name]
            self._restart(seed)
        raise KeyError(f"{name} is no parameter or buffer of the model")

    def _restart(self, seed: int) -> None:
        self.seed = seed
        self._walk = self._each_module(torch.Generator().manual_seed(seed).get_state())
        self._current = {}

    def _each_module(self, state: torch.Tensor):
        init_of = initializer(self.template)
        for mname, module in self.template.named_modules():
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            if not own:
                continue
            # this module alone on the host: a copy whose own tensors are allocated, its
            # children left on meta (its reset_parameters sets only its own)
            one = copy.deepcopy(module).to_empty(device="cpu", recurse=False)
            init = init_of(one)  # derive refused a module with tensors and no initializer
            outer = torch.get_rng_state()
            torch.set_rng_state(state)
            try:
                with torch.no_grad():
                    init()
                state = torch.get_rng_state()
            finally:
                torch.set_rng_state(outer)
            prefix = f"{mname}." if mname else ""
            yield {
                prefix + n: t.detach()
                for n, t in [*one.named_parameters(recurse=False), *one.named_buffers(recurse=False)]
            }


def adapt(net: nn.Module, m: Any, d: Derived) -> nn.Module:
    """`net` (built on meta) obeying the model contract, in place (see the module docstring)."""
    if m.blocks:
        parent_name, _, attr = m.blocks.rpartition(".")
        parent = net.get_submodule(parent_name) if parent_name else net
        blocks = BlockList({str(i): b for i, b in enumerate(getattr(parent, attr))})
        setattr(parent, attr, blocks)
    else:
        blocks = BlockList()
    first, last = d.chain if d.chain is not None else ((), ())
    replay = InitReplay(copy.deepcopy(net))
    cls = type(net)
    own_forward = cls.forward
    keys = tuple(m.inputs) if m.inputs else tuple(k for k in d.batch_keys if m.loss is None or k != m.label)
    positional = bool(m.inputs)
    returns_loss = m.loss is None
    blocks_path = m.blocks

    def forward(self, *inputs):
        if self._fw_chain_cut():
            return self._fw_chain(*inputs)
        out = (
            own_forward(self, *inputs)
            if positional
            else own_forward(self, **dict(zip(keys, inputs, strict=True)))
        )
        return output_loss(out) if returns_loss else out

    def _fw_chain_cut(self) -> bool:
        """A pipeline stage: some of the chain is gone (pipeline_chunk set it to None or dropped blocks)."""
        return any(getattr(self, n) is None for n in (*first, *last)) or len(self.layers) != d.num_blocks

    def _fw_chain(self, *inputs):
        x = inputs
        for name in first:
            module = getattr(self, name)
            if module is not None:
                x = (module(*x),)
        for block in self.layers.values():
            x = (block(*x),)
        for name in last:
            module = getattr(self, name)
            if module is not None:
                x = (module(*x),)
        return x[0]

    adapted = type(
        cls.__name__,
        (cls,),
        {
            "forward": forward,
            "_fw_chain_cut": _fw_chain_cut,
            "_fw_chain": _fw_chain,
            "layers": property(lambda self: self.get_submodule(blocks_path) if blocks_path else blocks),
            "first_modules": first,
            "last_modules": last,
            "initial_value": lambda self, name, shape, seed: replay.value(name, seed),
            "__module__": cls.__module__,
        },
    )
    net.__class__ = adapted
    return net


def build(m: Any) -> nn.Module:
    """The module, built (under the caller's meta device) and adapted."""
    from hydra.utils import instantiate

    from fleetwise.families.custom.derive import derived

    d = derived(m)
    if d.problems:
        raise ValueError("; ".join(f"{p.loc}: {p.msg}" for p in d.problems))
    return adapt(instantiate(m.module), m, d)


def make_loss(m: Any):
    """(output, label) -> scalar: the configured loss, or the loss forward already returned."""
    if m.loss is None:
        return lambda out, _label: out
    from hydra.utils import instantiate

    return instantiate(m.loss)
