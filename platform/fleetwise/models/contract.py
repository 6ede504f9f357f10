"""The model contract: what the runtime relies on in a model, as a typed Protocol, and a check of a
built module against it that says what is wrong and how to fix it.

Every model the runtime trains -- a family's (`fleetwise.families.<name>.model`) or a user's own
nn.Module (`model=custom`, adapted to this contract in place by `fleetwise.families.custom.model`)
-- is a plain nn.Module with no parallel code inside. The runtime applies the
layout to it from outside (`fleetwise.runtime.parallelize`), and for that it needs:

- `layers`: an nn.ModuleDict of the repeated blocks, keyed by index ("0", "1", ... in the order
  forward runs them). A pipeline split keeps a contiguous range of them (`models/pipeline.py`),
  FSDP shards each one as a unit, activation checkpointing recomputes each one and torch.compile
  compiles each one. Keys by index keep parameter names (`layers.7.attn.wq.weight`) the same
  however the model is cut, so checkpoints reshard across layouts and the initial values, drawn
  per parameter name, are the same in every layout. A model with no repeated blocks (CTR) has an
  empty ModuleDict and cannot be pipelined.
- `first_modules` / `last_modules`: the attribute names of the submodules only the first / last
  pipeline stage keeps (embedding; final norm and head). The other stages set them to None, so
  `forward` skips a submodule that is None.
- `forward(*inputs)`: on the first stage, the batch entries the family names (`ModelSpec.inputs`),
  in that order; on later stages `forward(hidden)`, the previous stage's output. The last stage's
  output is the first argument of the family's loss.
- how its parameters start (`models/init.py`): the runtime builds the model on `meta`, shards it,
  and only then draws each parameter's initial value from a generator of its own, so the model
  says how with `init_rule(module_name, module, attr, shape, generator) -> Tensor` or, when it
  keeps its own scheme (CTR), `initial_value(name, shape, seed) -> Tensor`.

This module lives in `models/` because the modules that rely on the contract sit at or above it
(`models/pipeline.py`, `models/init.py`, then `families/`, `runtime/`): all of them name it
importing downward. It never imports torch at import time (torch only for type checkers, and
inside `contract_problems` when it is called): the family record (`families/record.py`) names the
contract as the type its builders return, and `import fleetwise.families` stays torch-free.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from fleetwise.config.problems import Problem, did_you_mean

if TYPE_CHECKING:  # torch for type checkers only: importing the contract stays torch-free
    import torch
    from torch import nn

INIT_RULE_ARGS = ("module_name", "module", "attr", "shape", "generator")
INITIAL_VALUE_ARGS = ("name", "shape", "seed")


class InitRule(Protocol):
    """A parameter's (or buffer's) whole initial value, drawn from its own generator."""

    def __call__(
        self,
        module_name: str,
        module: nn.Module,
        attr: str,
        shape: tuple[int, ...],
        generator: torch.Generator,
    ) -> torch.Tensor: ...


class ModelContract(Protocol):
    """What `parallelize`, the pipeline split, activation checkpointing and init rely on (see the
    module docstring); `check_model` checks a built module against it. Besides these, a model
    has `init_rule: InitRule` or an `initial_value(name, shape, seed)` method."""

    layers: nn.ModuleDict
    first_modules: Sequence[str]
    last_modules: Sequence[str]

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor: ...


class ModelContractError(TypeError):
    """A built model breaks the contract; `problems` lists every break (where, what, the fix)."""

    def __init__(self, model_name: str, problems: Iterable[Problem]):
        self.problems = list(problems)
        lines = [f"{model_name} does not satisfy fleetwise's model contract (fleetwise.models.contract):"]
        lines += [f"- {p.loc}: {p.msg}\n  fix: {p.hint}" for p in self.problems]
        super().__init__("\n".join(lines))


def check_model(
    model: Any,
    *,
    inputs: Sequence[str] | None = None,
    num_layers: int | None = None,
    pipeline: bool = True,
    tp_paths: Iterable[str] = (),
) -> None:
    """Raise ModelContractError listing every problem `contract_problems` finds (none: return)."""
    problems = contract_problems(
        model, inputs=inputs, num_layers=num_layers, pipeline=pipeline, tp_paths=tp_paths
    )
    if problems:
        raise ModelContractError(type(model).__name__, problems)


def contract_problems(
    model: Any,
    *,
    inputs: Sequence[str] | None = None,
    num_layers: int | None = None,
    pipeline: bool = True,
    tp_paths: Iterable[str] = (),
) -> list[Problem]:
    """Every way the built (meta) `model` breaks the contract, as Problem(loc, what, fix) with loc
    `<Class>.<attribute>`. What the caller knows about the model sharpens the check:
    inputs: the batch entries the first stage's forward takes (ModelSpec.inputs);
    num_layers: the blocks the config says `layers` holds (what the planner counts);
    pipeline: whether the model may be pipelined; one that never is (CTR) is never cut into
      stages, so its first/last modules, where its state lives and forward(hidden) go unchecked;
    tp_paths: the submodule paths of its tensor-parallel plan (`*` for every block)."""
    from torch import nn

    name = type(model).__name__
    if not isinstance(model, nn.Module):
        return [Problem(name, f"is a {name}, not an nn.Module", "build the model as a torch.nn.Module")]
    problems = list(_layers_problems(model, name, num_layers, pipeline))
    if pipeline:
        problems += _stage_modules_problems(model, name)
        problems += _unsplit_state_problems(model, name)
    problems += _forward_problems(model, name, inputs, pipeline)
    problems += _init_problems(model, name)
    problems += _tp_plan_problems(model, name, tp_paths)
    return problems


def _layers_problems(
    model: nn.Module, name: str, num_layers: int | None, pipeline: bool
) -> Iterator[Problem]:
    from torch import nn

    loc = f"{name}.layers"
    layers = getattr(model, "layers", None)
    if layers is None:
        yield Problem(
            loc,
            f"missing: {name} has no `layers`",
            "keep the repeated blocks in `self.layers = nn.ModuleDict({str(i): Block(...) for i in "
            "range(num_layers)})` and run them in forward with `for block in self.layers.values()`: "
            "pipeline stages split them, FSDP and activation checkpointing wrap each one "
            "(a model with no repeated blocks sets `self.layers = nn.ModuleDict()`)",
        )
        return
    if not isinstance(layers, nn.ModuleDict):
        yield Problem(
            loc,
            f"is a {type(layers).__name__}, not an nn.ModuleDict",
            "build it as `nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})` and iterate "
            "`self.layers.values()` in forward: keyed by index, parameter names (`layers.3.…`) stay the "
            "same when a pipeline stage keeps only some of the blocks",
        )
        return
    keys, want = list(layers.keys()), [str(i) for i in range(len(layers))]
    if keys != want:
        shown = ", ".join(repr(k) for k in keys[:6]) + (", …" if len(keys) > 6 else "")
        yield Problem(
            loc,
            f"is keyed {shown}, not by the block indices '0'..'{len(keys) - 1}' in order",
            "key block i by str(i), in the order forward runs them: a pipeline split keeps a "
            "contiguous range of indices",
        )
    if num_layers is not None and pipeline and len(layers) != num_layers:
        yield Problem(
            loc,
            f"holds {len(layers)} blocks but the model config says num_layers={num_layers}",
            "build one block in `layers` per model.num_layers: the planner and the pipeline split "
            "count the blocks from the config",
        )
    elif num_layers is None and pipeline and len(layers) == 0:
        yield Problem(
            loc,
            "is empty, so a pipeline has no blocks to split",
            "put the repeated blocks in `layers`, or declare that the model cannot be pipelined",
        )


def _stage_modules_problems(model: nn.Module, name: str) -> Iterator[Problem]:
    """first_modules / last_modules: tuples naming submodules, disjoint, none of them `layers`."""
    named: dict[str, list[str]] = {}
    for attr, stage in (("first_modules", "first"), ("last_modules", "last")):
        loc, value = f"{name}.{attr}", getattr(model, attr, None)
        if value is None:
            yield Problem(
                loc,
                "missing",
                f"name the submodules only the {stage} pipeline stage keeps, e.g. "
                f"`{attr} = ({'embed' if stage == 'first' else 'head'!r},)`, or `{attr} = ()` when "
                "there are none",
            )
            continue
        if isinstance(value, str):
            yield Problem(
                loc,
                f"is the string {value!r}, not a tuple of names",
                f"write `{attr} = ({value!r},)` (a string is read letter by letter)",
            )
            continue
        if not isinstance(value, tuple | list) or not all(isinstance(v, str) for v in value):
            yield Problem(
                loc, f"is {value!r}", f"make it a tuple of attribute names, e.g. `{attr} = ('embed',)`"
            )
            continue
        named[attr] = list(value)
        yield from _named_submodules_problems(model, loc, stage, value)
    both = sorted(set(named.get("first_modules", ())) & set(named.get("last_modules", ())))
    if both:
        yield Problem(
            f"{name}.last_modules",
            f"{both} also in first_modules: a pipeline's first stage drops the last stage's modules "
            "and the last stage the first's",
            "use a module at one end only (untie a shared embedding and LM head: two modules)",
        )


def _named_submodules_problems(
    model: nn.Module, loc: str, stage: str, names: Sequence[str]
) -> Iterator[Problem]:
    from torch import nn

    cls = type(model).__name__
    children = [c for c, _ in model.named_children() if c != "layers"]
    for n in names:
        if n == "layers":
            yield Problem(
                loc,
                "names 'layers'",
                "leave `layers` out: pipeline stages split the blocks by index; name only the "
                f"modules before or after them ({', '.join(map(repr, children)) or 'none'})",
            )
        elif not hasattr(model, n):
            yield Problem(
                loc,
                f"names {n!r}, which {cls} does not have.{did_you_mean(n, children)}",
                f"name submodules (attributes) of {cls} that only the {stage} pipeline stage runs; "
                f"its submodules are {', '.join(map(repr, children)) or 'none'}",
            )
        elif not isinstance(getattr(model, n), nn.Module):
            yield Problem(
                loc,
                f"names {n!r}, a {type(getattr(model, n)).__name__}, not a submodule",
                "name only submodules: the other pipeline stages set them to None",
            )


def _unsplit_state_problems(model: nn.Module, name: str) -> Iterator[Problem]:
    """Parameters outside `layers` and the first/last modules: every pipeline stage would keep a
    copy of them and train it apart from the others'."""
    listed = [*_names(model, "first_modules"), *_names(model, "last_modules")]
    # a misspelt name already has its problem (with "Did you mean"): not the module it meant too
    modules = dict(model.named_children())
    meant = {c for n in listed if n not in modules for c in _close(n, modules)}
    split = {"layers", *listed, *meant}
    for child, module in modules.items():
        if child in split:
            continue
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            yield Problem(
                f"{name}.{child}",
                "is in neither `layers`, `first_modules` nor `last_modules`: every pipeline stage would "
                "keep a copy of its parameters and train it apart from the others'",
                f"add {child!r} to first_modules if the first stage runs it, to last_modules if the last "
                "stage does, or make it a block of `layers`",
            )
    own = [*model.named_parameters(recurse=False), *model.named_buffers(recurse=False)]
    for p, _ in own:
        yield Problem(
            f"{name}.{p}",
            "is a tensor of the root module: every pipeline stage would keep a copy of it",
            "move it into a submodule named in first_modules or last_modules (e.g. learned "
            "positions as an nn.Embedding inside the embedding module)",
        )


def _names(model: nn.Module, attr: str) -> tuple[str, ...]:
    value = getattr(model, attr, ())
    if isinstance(value, str):  # its own problem; the module it names is still meant
        return (value,)
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, tuple | list) else ()


def _close(word: str, choices: Iterable[str]) -> list[str]:
    return difflib.get_close_matches(word, list(choices), n=2, cutoff=0.6)  # as did_you_mean


def _forward_problems(
    model: nn.Module, name: str, inputs: Sequence[str] | None, pipeline: bool
) -> Iterator[Problem]:
    from torch import nn

    loc = f"{name}.forward"
    if type(model).forward is nn.Module.forward:
        yield Problem(loc, "is not defined", "define forward(*inputs) -> output")
        return
    sig = inspect.signature(model.forward)
    if inputs is not None and not _binds(sig, len(inputs)):
        call = ", ".join(f"batch[{k!r}]" for k in inputs)
        yield Problem(
            loc,
            f"forward{sig} cannot be called as forward({call})",
            f"the first pipeline stage passes the batch inputs {tuple(inputs)} positionally, in that "
            "order: take them so, and give any other argument a default",
        )
    if pipeline and (inputs is None or len(inputs) != 1) and not _binds(sig, 1):
        yield Problem(
            loc,
            f"forward{sig} cannot be called with one tensor (the hidden states)",
            "later pipeline stages call forward(hidden): give the other arguments defaults (e.g. "
            "`token_types=None`) and skip the first modules when they are None",
        )


def _init_problems(model: nn.Module, name: str) -> Iterator[Problem]:
    if hasattr(model, "initial_value"):
        yield from _callable_problems(f"{name}.initial_value", model.initial_value, INITIAL_VALUE_ARGS)
    elif hasattr(model, "init_rule"):
        yield from _callable_problems(f"{name}.init_rule", model.init_rule, INIT_RULE_ARGS)
    else:
        yield Problem(
            f"{name}.init_rule",
            f"missing: {name} has neither `init_rule` nor `initial_value`",
            "the runtime builds the model on `meta` and draws each parameter's initial value after "
            "sharding it (fleetwise.models.init): set `self.init_rule = rule`, rule(module_name, module, "
            "attr, shape, generator) -> the whole tensor (e.g. fleetwise.models.init.transformer_rule"
            "(0.02, num_layers)), or define initial_value(name, shape, seed)",
        )


def _callable_problems(loc: str, fn: Any, args: tuple[str, ...]) -> Iterator[Problem]:
    if not callable(fn):
        yield Problem(
            loc, f"is a {type(fn).__name__}, not callable", f"make it a function of ({', '.join(args)})"
        )
        return
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    if not _binds(sig, len(args)):
        yield Problem(
            loc,
            f"takes {sig}, not the {len(args)} arguments ({', '.join(args)})",
            f"define it as a function of ({', '.join(args)}) returning the whole tensor",
        )


def _binds(sig: inspect.Signature, n: int) -> bool:
    try:
        sig.bind(*range(n))
    except TypeError:
        return False
    return True


def _tp_plan_problems(model: nn.Module, name: str, paths: Iterable[str]) -> Iterator[Problem]:
    """Every path of a tensor-parallel plan names a submodule (`*` checked on the first block)."""
    layers = getattr(model, "layers", None)
    first = next(iter(layers.keys()), None) if hasattr(layers, "keys") else None
    modules = [n for n, _ in model.named_modules() if n]
    for path in paths:
        if "*" in path and first is None:
            continue  # no blocks to match: the layers problem says so
        try:
            model.get_submodule(path.replace("*", str(first)))
        except AttributeError:
            yield Problem(
                f"{name}.tp_plan",
                f"the tensor-parallel plan names {path!r}, which {name} does not have."
                f"{did_you_mean(path.replace('*', str(first)), modules)}",
                "name submodules by their path in the model (`layers.*.attn.wq`: `*` for every block)",
            )
