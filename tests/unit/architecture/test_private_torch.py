"""Torch behind one door: private torch names (a leading underscore: no promise across releases)
appear in fleetwise/compat.py and fleetwise/dryrun/patches.py only, where each states the torch
versions it was checked on. Anywhere else -- the package, and the tests, scripts, examples and
benchmarks beside it (`make test-torch` runs tests on other versions) -- a new torch release could
break a rank or a test with an AttributeError that no one reviewed.

What counts as naming a private torch name, read from the source (ast), not by running it:
- importing a torch module with a private part (`torch.utils._pytree`), or a private name from a
  torch module (`from torch.distributed.pipelining.stage import _RecvInfo`), or a string naming
  one (a logger or module name, `"torch.testing._internal…"`);
- a private attribute on anything reached from a torch name (`torch._foreach_norm`,
  `dist.distributed_c10d._resolve_process_group`, `_aten._local_scalar_dense` with `_aten = torch.ops.aten`);
- a private attribute of any other object that fleetwise itself does not define (`storage._cdata`,
  `schedule._stages`, `self._create_grad_recv_info` in a subclass of a torch class), and a private
  method defined in a subclass of a torch class (an override of torch's internals).
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.repo import REPO

PACKAGE = REPO / "platform" / "fleetwise"
DOORS = {"platform/fleetwise/compat.py", "platform/fleetwise/dryrun/patches.py"}
# every Python file of the repository is read but this one (its sample and what it must find name them)
SCANNED = ("platform/fleetwise", "tests", "scripts", "examples", "bench")

# Private names of torch objects that fleetwise once used (a regression on any of them fails even
# if fleetwise later defines a private name of its own that is spelled the same).
KNOWN_TORCH_PRIVATE = {
    "_cdata", "_local_tensor", "_parameters", "_buffers", "_modules", "_schema", "_overloadpacket", "_flatten",
    "_stages", "_stage", "_loss_fn", "_n_microbatches", "_get_fsdp_state", "_fsdp_param_groups",
    "_sharded_param_data", "_per_optimizer_states", "_get_metadata_path", "_create_grad_recv_info",
    "_create_grad_send_info", "_resolve_peer_global_rank", "_send_meta", "_recv_meta", "_rebuild_buckets",
    "_batch_p2p", "_initialize_pp_stages", "_setup_forward_recv_info", "_setup_backward_recv_info",
    "_prepare_forward_infra", "_prepare_backward_infra", "_stage_forward_initialized",
    "_stages_forward_initialized", "_stage_backward_initialized", "_stages_backward_initialized",
}  # fmt: skip

# Private names of other libraries, not torch's.
NOT_TORCH = {
    "_exit",  # os._exit
    "_run_exitfuncs",  # atexit's: the agent's exit without the interpreter's teardown (launcher/agent.py)
    "_get_node",  # omegaconf's node lookup (launcher/train.py)
    "_process",  # MLflow's system-metrics sampler thread (tracking/run_tracker.py)
    # the standard library's fork server, whose client state the agent sets (launcher/agent.py)
    "_forkserver_pid",
    "_forkserver_address",
    "_forkserver_alive_fd",
    "_init_weights",  # transformers' PreTrainedModel initializer, its documented hook (families/custom/initializer.py)
    "_gone_in_this_release",  # a made-up internal: compat's guard on a torch it was not checked on (test_compat_entries)
    "_fleetwise_agent_pool",  # the suite's own attribute on pytest's config: its warm agent pool (tests/conftest.py)
}

# Files allowed a private torch name besides the two doors (none: keep it that way).
ALLOWED_FOR_NOW: dict[str, set[str]] = {}

# names that exist from torch 2.13 only: a call on an older torch is an AttributeError
NEW_IN_2_13 = {"reduce_scatter_single", "all_gather_single"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _chain(node: ast.AST) -> list[str]:
    """`a.b.c` -> ["a", "b", "c"] (a call or subscript in the chain ends it at the left)."""
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out[::-1]


def _defined(trees: dict[str, ast.Module]) -> set[str]:
    """Private names fleetwise defines itself: functions, classes, module names, and attributes
    it assigns on `self` (not those it assigns on torch's objects: monkey-patches)."""
    out = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _chain(n)[:1] == ["self"]:
                out.add(n.attr)
    return out - KNOWN_TORCH_PRIVATE


def _torch_names(tree: ast.Module) -> set[str]:
    """Names bound to torch modules or objects in this file (imports, and aliases of them)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == "torch":
                    out.add(a.asname or "torch")
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "torch":
            out |= {a.asname or a.name for a in n.names}
    for n in ast.walk(tree):  # _aten = torch.ops.aten
        if isinstance(n, ast.Assign) and _chain(n.value)[:1] and _chain(n.value)[0] in out:
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return out


def _torch_subclasses(tree: ast.Module, torch_names: set[str]) -> list[ast.ClassDef]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and any(_chain(b)[:1] and _chain(b)[0] in torch_names for b in n.bases)
    ]


def _uses(tree: ast.Module, defined: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each private torch name this file names."""
    torch_names = _torch_names(tree)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "torch":
            if any(_private(p) for p in n.module.split(".")):
                out.append((n.lineno, n.module))
            out += [(n.lineno, f"{n.module}.{a.name}") for a in n.names if _private(a.name)]
        elif isinstance(n, ast.Import):
            out += [
                (n.lineno, a.name)
                for a in n.names
                if a.name.split(".")[0] == "torch" and any(_private(p) for p in a.name.split("."))
            ]
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("torch."):
            if any(_private(p) for p in n.value.split()[0].split(".")):
                out.append((n.lineno, n.value))
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id in ("getattr", "hasattr", "setattr")
            and len(n.args) >= 2
            and isinstance(n.args[1], ast.Constant)
            and isinstance(n.args[1].value, str)
            and _private(n.args[1].value)
            and n.args[1].value not in NOT_TORCH
            and (n.args[1].value in KNOWN_TORCH_PRIVATE or n.args[1].value not in defined)
        ):
            out.append((n.lineno, f"{n.func.id}(…, {n.args[1].value!r})"))
        elif isinstance(n, ast.Attribute):
            chain = _chain(n)
            if n.attr in NEW_IN_2_13 and chain[:1] and chain[0] in torch_names:
                out.append((n.lineno, ".".join(chain)))
            if not _private(n.attr) or n.attr in NOT_TORCH:
                continue
            from_torch = bool(chain) and chain[0] in torch_names
            if from_torch or n.attr in KNOWN_TORCH_PRIVATE or n.attr not in defined:
                out.append((n.lineno, ".".join(chain) or n.attr))
    for cls in _torch_subclasses(tree, torch_names):  # overrides of torch's private methods
        out += [
            (f.lineno, f"{cls.name}.{f.name}")
            for f in cls.body
            if isinstance(f, ast.FunctionDef) and _private(f.name) and f.name not in defined - {f.name}
        ]
    return out


def _findings() -> dict[str, list[tuple[int, str]]]:
    files = sorted(p for d in SCANNED for p in (REPO / d).rglob("*.py") if p != Path(__file__).resolve())
    trees = {p.relative_to(REPO).as_posix(): ast.parse(p.read_text()) for p in files}
    defined = _defined(trees)
    return {name: _uses(tree, defined) for name, tree in trees.items()}


def test_private_torch_names_only_behind_the_two_doors():
    wrong = []
    for name, uses in _findings().items():
        if name in DOORS:
            continue
        allowed = ALLOWED_FOR_NOW.get(name, set())
        wrong += [
            f"{name}:{line}: {what}" for line, what in uses if not any(what.startswith(a) for a in allowed)
        ]
    assert not wrong, "private torch names outside compat.py / dryrun/patches.py:\n" + "\n".join(wrong)


def test_the_scan_sees_what_it_must():
    """The rule's reader finds each kind of use (checked on a sample, so a blind scan cannot pass)."""
    sample = ast.parse(
        "import torch\nimport torch.distributed as dist\nfrom torch.utils._pytree import tree_flatten\n"
        "from torch.distributed.pipelining.stage import PipelineStage, _RecvInfo\n_aten = torch.ops.aten\n"
        "class S(PipelineStage):\n    def _setup_forward_recv_info(self, n, b):\n        self._create_grad_recv_info(1)\n"
        "x = torch._foreach_norm\ny = _aten._local_scalar_dense\nz = storage._cdata\n"
        "dist.reduce_scatter_single(a, b)\nlog = 'torch.distributed.tensor._redistribute'\n"
        "ok = os._exit\nmine = thing._own\ndef _own(): pass\nh = getattr(handler, '_state_holder', None)\n"
    )
    found = {what for _, what in _uses(sample, {"_own"})}
    assert found >= {
        "torch.utils._pytree",
        "torch.distributed.pipelining.stage._RecvInfo",
        "S._setup_forward_recv_info",
        "self._create_grad_recv_info",
        "torch._foreach_norm",
        "_aten._local_scalar_dense",
        "storage._cdata",
        "dist.reduce_scatter_single",
        "torch.distributed.tensor._redistribute",
        "getattr(…, '_state_holder')",
    }, found
    assert not any("_exit" in w or "_own" in w for w in found), found


def test_the_doors_say_which_torch_versions_they_were_checked_on():
    """Every entry of compat is in its CHECKED table, with 2.13 (the pin) among its versions, and
    is present on the installed torch; the dry run's patches name theirs too."""
    import inspect

    from fleetwise import compat

    own = {
        "VERSION",
        "MINOR",
        "TESTED",
        "CHECKED",
        "RECV_POOL_CHECKED",
        "Unsupported",
        "unsupported",
        "recv_api",
    }
    entries = {
        name
        for name, value in vars(compat).items()
        if not name.startswith("_")
        and name not in own
        and not inspect.ismodule(value)
        and getattr(value, "__module__", "fleetwise.compat") in ("fleetwise.compat", None)
        and name not in ("annotations", "log", "Callable", "Any")
    } | set(compat.__all__)
    assert entries <= set(compat.CHECKED), sorted(entries - set(compat.CHECKED))
    assert all("2.13" in versions for versions in compat.CHECKED.values())
    assert not [n for n in compat.CHECKED if isinstance(getattr(compat, n), compat._Missing)]
    assert "CHECKED = (" in (PACKAGE / "dryrun" / "patches.py").read_text()


def test_the_doors_are_not_imported_by_the_parent_side():
    """compat imports torch (seconds): `validate`, `plan` and the launcher must not pull it in
    (launcher/agent.py is torchrun's agent, a process of its own that imports torch)."""
    for sub in ("config", "plan", "launcher"):
        for p in (PACKAGE / sub).rglob("*.py"):
            if p.name == "agent.py":
                continue
            text = p.read_text()
            assert "fleetwise.compat" not in text and "from fleetwise import compat" not in text, p
    # the dry run's parent side too: only its rank processes import torch
    import subprocess
    import sys

    code = "import sys, fleetwise.dryrun.parent; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_a_missing_feature_is_refused_with_the_version_named():
    from fleetwise import compat

    err = compat.unsupported("the thing", ("2.11", "2.13"))
    assert isinstance(err, RuntimeError) and not isinstance(err, AttributeError)
    assert "2.11, 2.13" in str(err) and compat.VERSION.split(".")[0] in str(err) and "the thing" in str(err)


def test_compat_is_the_bottom_and_the_dry_run_sits_above_the_runtime():
    """compat imports nothing of fleetwise (it is the bottom of the import order); nothing the
    runtime, tracking, models, data, plan or config hold imports the dry run (it runs the runtime,
    not the other way round)."""
    compat = ast.parse((PACKAGE / "compat.py").read_text())
    assert not [
        n
        for n in ast.walk(compat)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("fleetwise")
    ]
    below = [
        p
        for sub in ("runtime", "tracking", "models", "data", "plan", "config")
        for p in (PACKAGE / sub).rglob("*.py")
    ]
    wrong = [
        str(p.relative_to(PACKAGE))
        for p in below
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("fleetwise.dryrun")
    ]
    assert not wrong, wrong
