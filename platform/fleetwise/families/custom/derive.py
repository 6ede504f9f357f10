"""Your own model, measured: its problems and its planner units, derived by tracing it.

A built-in family's planner units are written by hand from its code; a user's module is measured.
`derived(model_section)` imports the targets (families/custom/targets.py), reads two items of the
dataset, builds the module on the `meta` device and runs one forward and backward of it (and its
loss) under fake tensors at micro-batch sizes 1 and 2 -- no memory, no values. From that:

- parameters, their split under the tensor-parallel plan and their largest tensor: exact (counted
  on the built module);
- per unit (the modules before the blocks, each block, the modules after them and the loss):
  saved activation bytes (autograd's saved tensors, each storage once, parameters excluded), forward
  FLOPs (torch's FlopCounterMode), aten ops, matmul-like ops and elementwise output elements, as the
  dry run counts them -- all per sample: the slope between the two micro-batch sizes;
- the chain: whether forward runs the modules before the blocks, the blocks and the modules after
  them one into the next (then a pipeline can cut it between blocks), else why not.

The result is cached by a hash of the model and dataset sections, the torch version and the source
of the targets' folders: in the process, and on disk ($FLEETWISE_CACHE_DIR, else
~/.cache/fleetwise), so a second `plan` is as fast as a built-in one.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetwise.config.problems import Problem, did_you_mean
from fleetwise.families.custom.initializer import initializer
from fleetwise.families.custom.targets import target_problems
from fleetwise.plan.units import Acts, Unit

BATCHES = (1, 2)  # the micro-batch sizes traced: per-sample terms are the slope between them
FORMAT = 1  # of the disk cache


@dataclass
class Derived:
    """What tracing found: the problems (config paths), and when there are none the units."""

    problems: list[Problem] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)
    num_blocks: int = 0
    batch_keys: tuple[str, ...] = ()  # the dataset's item keys
    chain: tuple[tuple[str, ...], tuple[str, ...]] | None = None  # (first, last) children of the root
    no_chain: str = "model.blocks is not set"  # why forward is no chain (pipelining refused)
    tp_dims: dict[str, tuple[str, int]] = field(default_factory=dict)  # module -> (style, split size)
    sample_bytes: int = 0  # one item of the dataset
    measured: tuple[str, ...] = ()  # what the plan's numbers came from
    unchecked: tuple[str, ...] = ()  # targets held back (targets.holding): nothing imported or measured


_MEMO: dict[str, Derived] = {}


def derived(m: Any) -> Derived:
    """The derivation for model section `m` (cached in the process and on disk)."""
    from fleetwise.families.custom.targets import ensure_cwd_importable

    ensure_cwd_importable()
    sections = {
        "module": m.module,
        "blocks": m.blocks,
        "inputs": m.inputs,
        "label": m.label,
        "loss": m.loss,
        "tp_plan": m.tp_plan,
        "dataset": m.dataset,
    }
    from fleetwise.families.custom.targets import held

    if unchecked := held({"model": sections}):  # `fleetwise validate` of a recipe from elsewhere
        return Derived(units=fallback_units(), unchecked=tuple(unchecked), no_chain="")
    text = json.dumps(sections, sort_keys=True, default=str)
    memo = _MEMO.get(text)
    if memo is not None:
        return memo
    # a cached derivation is found without importing the targets (nor torch): a second `plan` is
    # as fast as a built-in one; the key covers the targets' source folders and torch's version
    key = _cache_key(text, m)
    path = cache_dir() / f"{key}.json" if key else None
    out = _read_cache(path) if path else None
    if out is None:
        located, problems = _locate_all(m)
        out = Derived(problems=problems, units=fallback_units()) if problems else _derive(m, located)
        if path and not out.problems:
            _write_cache(path, out)
    _MEMO[text] = out
    return out


def fallback_units() -> list[Unit]:
    """Units that let the other rules run while the model's own problems are reported."""
    return [Unit("first", "embedding"), Unit("last", "head")]


def cache_dir() -> Path:
    env = os.environ.get("FLEETWISE_CACHE_DIR")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "fleetwise") / "custom"


def _locate_all(m: Any) -> tuple[dict[str, Any], list[Problem]]:
    located: dict[str, Any] = {}
    problems: list[Problem] = []
    if m.dataset is None:
        problems.append(
            Problem(
                "data.dataset",
                "model=custom trains on your own Dataset, but data.dataset is not set",
                "use data=custom and set data.dataset._target_ (a Dataset class or a function returning one)",
            )
        )
    nodes = [("model.module", m.module, "module"), ("data.dataset", m.dataset, "dataset")]
    if m.loss is not None:
        nodes.append(("model.loss", m.loss, "loss"))
    for loc, node, kind in nodes:
        if node is None and kind == "dataset":
            continue
        obj, found = target_problems(loc, node, kind)
        problems += found
        located[kind] = obj
    if m.loss is not None and m.label is None:
        problems.append(
            Problem(
                "model.label",
                "model.loss is set but model.label is not",
                "set model.label=<batch key of the target>",
            )
        )
    return located, problems


def _cache_key(text: str, m: Any) -> str | None:
    """A hash of the sections, torch's version and the source folders of the targets, found with
    importlib.util.find_spec (which imports their parent packages, not the modules); None when a
    target's module is not found (then nothing is cached: its problem is reported instead)."""
    import importlib.metadata
    import importlib.util

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    h = hashlib.sha256(f"{FORMAT}|{torch_version}|{text}".encode())
    for node in (m.module, m.dataset, m.loss):
        if node is None:
            continue
        parts = str(node.get("_target_", "")).split(".")
        origin = None
        for i in range(len(parts) - 1, 0, -1):
            try:
                spec = importlib.util.find_spec(".".join(parts[:i]))
            except (ImportError, ValueError):
                spec = None
            if spec is not None:
                origin = spec.origin
                break
        if origin is None or not origin.endswith(".py"):
            return None
        for py in sorted(Path(origin).parent.glob("*.py")):  # the target's folder: its helpers too
            h.update(py.read_bytes())
    return h.hexdigest()[:32]


def _read_cache(path: Path) -> Derived | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    try:
        units = [_unit(u) for u in data.pop("units")]
        chain = data.pop("chain")
        return Derived(
            units=units,
            chain=(tuple(chain[0]), tuple(chain[1])) if chain else None,
            batch_keys=tuple(data.pop("batch_keys")),
            tp_dims={k: (v[0], v[1]) for k, v in data.pop("tp_dims").items()},
            measured=tuple(data.pop("measured")),
            **data,
        )
    except (KeyError, TypeError):
        return None


def _write_cache(path: Path, d: Derived) -> None:
    data = dataclasses.asdict(d)
    data.pop("problems")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs the next call a trace


def _unit(d: dict) -> Unit:
    acts_fields = {f.name for f in dataclasses.fields(Unit) if f.type in ("Acts", "Acts | None")}
    out = {}
    for k, v in d.items():
        if k == "acts":
            out[k] = {mode: Acts(**a) for mode, a in v.items()}
        elif k in acts_fields and v is not None:
            out[k] = Acts(**v)
        else:
            out[k] = v
    return Unit(**out)


# ------------------------------------------------------------------------------------------------
# the trace


def _derive(m: Any, located: dict[str, Any]) -> Derived:
    from hydra.utils import instantiate

    items, problems = _items(m, instantiate)
    if problems:
        return Derived(problems=problems, units=fallback_units())
    net, problems = _build(m, instantiate)
    if net is None:
        return Derived(problems=problems, units=fallback_units())
    blocks, found = _blocks(m, net)
    problems += found
    tp_dims, found = _tp_plan(m, net)
    problems += found
    problems += _init_problems(net)
    if problems:
        return Derived(problems=problems, units=fallback_units())
    loss = instantiate(m.loss) if m.loss is not None else None
    try:
        traces = [_trace(m, net, blocks, items, loss, b) for b in BATCHES]
    except _TraceProblem as err:
        return Derived(problems=[err.problem], units=fallback_units())
    except Exception as err:  # noqa: BLE001 - the user's forward failing on fake tensors: say where
        return Derived(
            problems=[
                Problem(
                    "model.module",
                    f"forward/backward of {type(net).__name__} failed on fake tensors (batch of "
                    f"{BATCHES[0]}): {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                    "forward must run on any device without reading values (no .item(), no "
                    "data-dependent shapes); check it with a batch of your dataset's items",
                )
            ],
            units=fallback_units(),
        )
    return _assemble(m, net, blocks, items, tp_dims, traces)


class _TraceProblem(Exception):
    def __init__(self, problem: Problem):
        super().__init__(problem.msg)
        self.problem = problem


def _items(m: Any, instantiate) -> tuple[list[dict], list[Problem]]:
    import torch

    path = m.dataset["_target_"]
    try:
        ds = instantiate(m.dataset)
    except Exception as err:  # noqa: BLE001
        return [], [
            Problem(
                "data.dataset",
                f"building {path} failed: {type(err).__name__}: {err}",
                "fix its arguments or code",
            )
        ]
    if not (hasattr(ds, "__getitem__") and hasattr(ds, "__len__")):
        return [], [
            Problem(
                "data.dataset",
                f"{path} gave a {type(ds).__name__}, not a map-style Dataset",
                "return a torch.utils.data.Dataset with __len__ and __getitem__",
            )
        ]
    if len(ds) < 1:
        return [], [Problem("data.dataset", f"{path} is empty (len 0)", "give it samples")]
    items = []
    for i in (0, 1 % len(ds)):
        try:
            item = ds[i]
        except Exception as err:  # noqa: BLE001
            return [], [
                Problem("data.dataset", f"{path}[{i}] failed: {type(err).__name__}: {err}", "fix __getitem__")
            ]
        bad = (
            not isinstance(item, dict)
            or not item
            or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in item.items())
        )
        if bad:
            shown = (
                type(item).__name__
                if not isinstance(item, dict)
                else {k: type(v).__name__ for k, v in item.items()}
            )
            return [], [
                Problem(
                    "data.dataset",
                    f"{path}[{i}] is {shown}: items must be dicts of tensors",
                    "return e.g. {'x': torch.tensor(...), 'y': torch.tensor(...)} from __getitem__",
                )
            ]
        items.append(item)
    keys = list(items[0])
    problems = []
    for loc, wanted in (("model.label", [m.label] if m.label else []), ("model.inputs", m.inputs or [])):
        for k in wanted:
            if k not in keys:
                problems.append(
                    Problem(
                        loc,
                        f"batch key {k!r} is not in the dataset's items ({', '.join(keys)}).{did_you_mean(k, keys)}",
                        f"name one of: {', '.join(keys)}",
                    )
                )
    return items, problems


def _build(m: Any, instantiate):
    import torch
    from torch import nn

    path = m.module["_target_"]
    try:
        with torch.device("meta"):
            net = instantiate(m.module)
    except Exception as err:  # noqa: BLE001
        return None, [
            Problem(
                "model.module",
                f"building {path} on the meta device failed: {type(err).__name__}: {err}",
                "build parameters with the module's own constructors (nn.Linear, nn.Parameter(torch.empty(...))); "
                "read no tensor values in __init__",
            )
        ]
    if not isinstance(net, nn.Module):
        return None, [
            Problem(
                "model.module._target_",
                f"{path} returned a {type(net).__name__}, not an nn.Module",
                "return an nn.Module",
            )
        ]
    return net, []


def _blocks(m: Any, net) -> tuple[Any, list[Problem]]:
    from torch import nn

    if m.blocks is None:
        return None, []
    try:
        blocks = net.get_submodule(m.blocks)
    except AttributeError:
        names = [n for n, _ in net.named_modules() if n]
        lists = [n for n, x in net.named_modules() if isinstance(x, nn.ModuleList)]
        return None, [
            Problem(
                "model.blocks",
                f"{type(net).__name__} has no submodule {m.blocks!r}.{did_you_mean(m.blocks, names)}",
                f"name its nn.ModuleList of repeated blocks ({', '.join(lists) or 'it has none'})",
            )
        ]
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        return None, [
            Problem(
                "model.blocks",
                f"{m.blocks} is a {type(blocks).__name__}{' (empty)' if isinstance(blocks, nn.ModuleList) else ''}, "
                "not an nn.ModuleList of blocks",
                "keep the repeated blocks in an nn.ModuleList and name it, or set model.blocks=null",
            )
        ]
    return blocks, []


def pattern_matches(pattern: str, name: str) -> bool:
    """A tp_plan pattern matches a module name part by part (`*` is one part), as torch's
    parallelize_module reads it."""
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(fnmatch.fnmatchcase(h, w) for w, h in zip(want, have, strict=True))


def _tp_plan(m: Any, net) -> tuple[dict[str, tuple[str, int]], list[Problem]]:
    from torch import nn

    dims: dict[str, tuple[str, int]] = {}
    problems = []
    names = [(n, x) for n, x in net.named_modules() if n]
    for pattern, style in m.tp_plan.items():
        matched = [(n, x) for n, x in names if pattern_matches(pattern, n)]
        if not matched:
            problems.append(
                Problem(
                    f"model.tp_plan.{pattern}",
                    f"pattern {pattern!r} matches no module of {type(net).__name__}."
                    f"{did_you_mean(pattern, [n for n, _ in names])}",
                    "write module names as named_modules() gives them, `*` for one part (e.g. 'trunk.*.fc1')",
                )
            )
            continue
        for n, x in matched:
            if style == "sequence":
                continue
            if isinstance(x, nn.Linear):
                dims[n] = (style, x.out_features if style == "colwise" else x.in_features)
            elif isinstance(x, nn.Embedding):
                dims[n] = (style, x.embedding_dim if style == "colwise" else x.num_embeddings)
            else:
                problems.append(
                    Problem(
                        f"model.tp_plan.{pattern}",
                        f"{n} is a {type(x).__name__}: {style} splits nn.Linear and nn.Embedding only",
                        "name the Linear layers inside it, or use 'sequence' for a norm",
                    )
                )
    return dims, problems


def _init_problems(net) -> list[Problem]:
    """Every module that owns tensors must say how they start (reset_parameters): fleetwise builds on
    meta and replays the constructor's initialisation module by module (families/custom/model.py)."""
    init_of = initializer(net)
    out = []
    for name, x in net.named_modules():
        own = [*x.named_parameters(recurse=False), *x.named_buffers(recurse=False)]
        if own and init_of(x) is None:
            out.append(
                Problem(
                    "model.module",
                    f"{name or '<root>'} ({type(x).__name__}) owns {', '.join(n for n, _ in own)} but has no "
                    "reset_parameters(): fleetwise builds the model on the meta device and initialises each "
                    "module's shard by calling its reset_parameters()",
                    f"give {type(x).__name__} a reset_parameters() that sets {', '.join(n for n, _ in own)} "
                    "(and call it from __init__), or keep them in a torch module that has one (nn.Linear, nn.LayerNorm, …)",
                )
            )
    return out[:5]


# ------------------------------------------------------------------------------------------------
# one traced step


@dataclass
class _Trace:
    """What one forward+backward at batch size `batch` measured, per unit name."""

    batch: int
    saved: dict[str, float]  # bytes autograd saved
    flops: dict[str, float]  # forward FLOPs
    ops: dict[str, int]
    gemms: dict[str, int]
    elementwise: dict[str, float]  # output elements of non-matmul, non-view ops
    out: dict[str, float]  # elements of the unit's output
    calls: list[tuple[str, Any, Any]]  # (top-level child, first input id, output id), in call order
    forward_inputs: tuple[int, ...] = ()
    forward_output: int = 0
    loss_shape: tuple[int, ...] = ()


_GEMMS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product")


def _trace(m: Any, net, blocks, items: list[dict], loss, batch: int) -> _Trace:
    import copy

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import fleetwise.compat as compat
    from fleetwise.models.flops import cpu_attention_formulas

    t = _Trace(batch, *({} for _ in range(6)), [])
    stack = ["first"]  # the unit running now: first, block<i>, last
    mode = compat.FakeTensorMode(allow_non_fake_inputs=True)
    fake = copy.deepcopy(net)
    with mode:
        fake.to_empty(device="cpu")
    params = {compat.storage_key(p.untyped_storage()) for p in fake.parameters()}
    seen: set[int] = set()
    hooks = [child.register_forward_hook(_call_hook(t, name)) for name, child in fake.named_children()]
    if blocks is not None:
        for i, b in enumerate(fake.get_submodule(m.blocks)):
            hooks.append(b.register_forward_pre_hook(lambda *_a, i=i: stack.append(f"block{i}")))
            hooks.append(b.register_forward_hook(_block_done(t, stack, f"{m.blocks}.{i}", f"block{i}")))

    def pack(x):
        if isinstance(x, torch.Tensor):
            key = compat.storage_key(x.untyped_storage())
            if key not in params and key not in seen:
                seen.add(key)
                t.saved[stack[-1]] = t.saved.get(stack[-1], 0) + x.untyped_storage().nbytes()
        return x

    counter = _op_counter(t, stack)
    flop = FlopCounterMode(display=False, custom_mapping=cpu_attention_formulas())
    real = {k: torch.stack([items[i % len(items)][k] for i in range(batch)]) for k in items[0]}
    with mode:
        fake_batch = {k: mode.from_tensor(v) for k, v in real.items()}
        args, kwargs = _forward_args(m, fake_batch, loss)
        t.forward_inputs = tuple(id(a) for a in args)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), flop, counter:
            out = fake(*args, **kwargs)
            t.forward_output = id(out)
            stack[:] = ["last"]  # the loss, and anything after the blocks
            value = _loss_value(m, out, fake_batch, loss)
        if value.numel() != 1:
            raise _TraceProblem(
                Problem(
                    "model.loss" if loss is not None else "model.module",
                    f"the loss has shape {tuple(value.shape)}, not a scalar",
                    "reduce it (e.g. .mean()) so that backward() can run",
                )
            )
        value.backward()
    for h in hooks:
        h.remove()
    t.flops = _flops_per_unit(flop, m, fake)
    return t


def _block_done(t: _Trace, stack: list[str], name: str, unit: str):
    import torch

    def hook(_module, inputs, output):
        stack.pop()
        stack[0] = "last"  # after a block, the root's own code counts to the modules after them
        t.calls.append((name, tuple(id(x) for x in inputs), id(output)))
        if isinstance(output, torch.Tensor):
            t.out[unit] = float(output.numel())

    return hook


def _call_hook(t: _Trace, name: str):
    def hook(_module, inputs, output):
        t.calls.append((name, tuple(id(x) for x in inputs), id(output)))

    return hook


def _op_counter(t: _Trace, stack: list[str]):
    """A dispatch mode counting aten ops per unit (the dry run's per-op host cost), matmul-like
    ones, elementwise elements (defined here: families import torch only when a rank calls them)."""
    import fleetwise.compat as compat

    class OpCounter(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            unit = stack[-1]
            t.ops[unit] = t.ops.get(unit, 0) + 1
            if getattr(func, "__name__", str(func)).startswith(_GEMMS):
                t.gemms[unit] = t.gemms.get(unit, 0) + 1
            elif not _is_view(func):
                t.elementwise[unit] = t.elementwise.get(unit, 0) + _numel(out)
            return out

    return OpCounter()


def _is_view(func) -> bool:
    try:
        return bool(func.is_view)
    except AttributeError:
        return False


def _numel(out) -> float:
    import torch

    import fleetwise.compat as compat

    return float(sum(x.numel() for x in compat.tree_flatten(out)[0] if isinstance(x, torch.Tensor)))


def _flops_per_unit(flop, m: Any, fake) -> dict[str, float]:
    """Forward FLOPs per unit from FlopCounterMode's per-module table (keys: module paths)."""
    counts = flop.get_flop_counts()
    root = type(fake).__name__  # the table names modules `<RootClass>.<path>`

    def of(key: str) -> float:
        return float(sum(counts.get(key if key == "Global" else f"{root}.{key}", {}).values()))

    out: dict[str, float] = {}
    if m.blocks:
        for i in range(len(fake.get_submodule(m.blocks))):
            out[f"block{i}"] = of(f"{m.blocks}.{i}")
    first, _ = _first_last_params(m, fake)
    out["first"] = sum(of(c) for c in first) if m.blocks else of("Global")
    out["last"] = max(0.0, of("Global") - sum(out.values()))
    return out


def _first_last_params(m: Any, net) -> tuple[list[str], list[str]]:
    children = [n for n, _ in net.named_children()]
    if not m.blocks or m.blocks not in children:
        return children, []
    at = children.index(m.blocks)
    return children[:at], children[at + 1 :]


def _forward_args(m: Any, batch: dict, loss) -> tuple[list, dict]:
    if m.inputs:
        return [batch[k] for k in m.inputs], {}
    keys = [k for k in batch if loss is None or k != m.label]
    return [], {k: batch[k] for k in keys}


def _loss_value(m: Any, out, batch: dict, loss):
    if loss is not None:
        return loss(out, batch[m.label])
    return output_loss(out)


def output_loss(out):
    """The loss a forward returned: a tensor, or an object / dict with `loss` (Hugging Face)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    value = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if not isinstance(value, torch.Tensor):
        raise _TraceProblem(
            Problem(
                "model.loss",
                f"model.loss is not set, and forward returned a {type(out).__name__} without a `loss` tensor",
                "set model.loss (output, label) -> scalar and model.label, or return the loss from forward",
            )
        )
    return value


# ------------------------------------------------------------------------------------------------
# from two traces to units


def _assemble(m: Any, net, blocks, items: list[dict], tp_dims, traces: list[_Trace]) -> Derived:
    a, b = traces
    span = b.batch - a.batch

    def slope(field_name: str, unit: str) -> float:
        return max(0.0, (getattr(b, field_name).get(unit, 0) - getattr(a, field_name).get(unit, 0)) / span)

    first_names, last_names = _first_last_params(m, net)
    chain, why = _chain(m, net, a, first_names, last_names)
    split = _split_params(net, tp_dims)
    groups = {"first": [net.get_submodule(c) for c in first_names]}
    if blocks is not None:
        groups.update({f"block{i}": [blk] for i, blk in enumerate(blocks)})
    groups["last"] = [net.get_submodule(c) for c in last_names]
    if blocks is None:  # no blocks: the whole module is one unit
        groups = {"first": [net], "last": []}
    rowwise = {n for n, (s, _) in tp_dims.items() if s == "rowwise"}
    units = []
    for unit, modules in groups.items():
        params = [(pn, p) for mod in modules for pn, p in _named_params(net, mod)]
        saved = slope("saved", unit) / 4  # fp32 elements (the trace runs in fp32)
        kind = "block" if unit.startswith("block") else ("embedding" if unit == "first" else "head")
        boundary = slope("out", unit) if unit.startswith("block") else 0.0
        in_unit = {n for mod in modules for n, _ in _prefixed(net, mod)}
        units.append(
            Unit(
                name=unit,
                kind=kind,
                params_split=sum(p.numel() for pn, p in params if pn in split),
                params_whole=sum(p.numel() for pn, p in params if pn not in split),
                fwd_flops=slope("flops", unit),
                acts={
                    "none": Acts(whole=saved),
                    "selective": Acts(whole=saved),
                    "full": Acts(whole=boundary),
                },
                mp_allreduces=len(rowwise & in_unit),
                boundary_elements=boundary,
                fwd_ops=a.ops.get(unit, 0),
                fwd_gemms=a.gemms.get(unit, 0),
                fwd_elementwise=slope("elementwise", unit),
                param_tensors=len(params),
                largest_split=max((p.numel() for pn, p in params if pn in split), default=0),
                largest_whole=max((p.numel() for pn, p in params if pn not in split), default=0),
            )
        )
    sample = sum(v.numel() * v.element_size() for v in items[0].values())
    return Derived(
        units=units,
        num_blocks=len(blocks) if blocks is not None else 0,
        batch_keys=tuple(items[0]),
        chain=chain,
        no_chain=why,
        tp_dims=tp_dims,
        sample_bytes=sample,
        measured=(
            "parameters: counted on the module built on the meta device",
            f"activations, FLOPs, ops: one fake forward+backward at micro-batch {a.batch} and {b.batch}, per sample",
        ),
    )


def _named_params(net, mod) -> list[tuple[str, Any]]:
    return [
        (f"{prefix}.{n}" if prefix else n, p)
        for prefix, sub in _prefixed(net, mod)
        for n, p in sub.named_parameters(recurse=False)
    ]


def _prefixed(net, mod) -> list[tuple[str, Any]]:
    ids = {id(x) for x in mod.modules()}
    return [(n, x) for n, x in net.named_modules() if id(x) in ids]


def _split_params(net, tp_dims: dict[str, tuple[str, int]]) -> set[str]:
    """Parameters tensor parallelism divides: colwise weight and bias, rowwise weight."""
    out = set()
    for name, (style, _) in tp_dims.items():
        out.add(f"{name}.weight")
        if style == "colwise" and getattr(net.get_submodule(name), "bias", None) is not None:
            out.add(f"{name}.bias")
    return out


def _chain(m: Any, net, t: _Trace, first: list[str], last: list[str]) -> tuple[Any, str]:
    """(first, last) when forward is a chain: the children before the blocks, each block and the
    children after them, each run once, each taking the previous one's output (the first one the
    forward's inputs, positionally), the last one's output returned."""
    if not m.blocks:
        return None, "model.blocks is not set: there is nothing to split between stages"
    if m.blocks not in dict(net.named_children()):
        return (
            None,
            f"model.blocks={m.blocks} is not a child of the root module, so forward cannot be cut around it",
        )
    if not m.inputs or m.loss is None:
        return None, (
            "a pipeline needs model.inputs (passed positionally to the first stage) and model.loss "
            "(run on the last stage's output)"
        )
    n = len(net.get_submodule(m.blocks))
    want = [*first, *[f"{m.blocks}.{i}" for i in range(n)], *last]
    order = [c[0] for c in t.calls]
    if order != want:
        return None, f"forward runs {order} rather than each of {want} once, in order"
    previous = t.forward_inputs
    for name, inputs, output in t.calls:
        if inputs != previous:
            return (
                None,
                f"{name} does not take {'the forward inputs' if name == want[0] else 'the output of the module before it'} alone",
            )
        previous = (output,)
    if previous != (t.forward_output,):
        return None, f"forward does not return the output of {want[-1]}"
    return (tuple(first), tuple(last)), ""


__all__ = ["Derived", "cache_dir", "derived", "fallback_units", "output_loss", "pattern_matches"]
