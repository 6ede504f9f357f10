"""The import order (README, "layout of the code"), every part of the package in it:

    cli → launcher → (dryrun, calibrate) → tracking → runtime → families/plan → config/models/data → compat

A module imports from its own level and the levels below it, never above: a rank never pulls in
the launcher, the planner never the runtime, nothing the command line. Parts on one level may
import each other (test_import_cycles.py keeps their files from forming a cycle). Every import
counts, inside functions and under `if TYPE_CHECKING:` too. The package's own top-level modules
have their places: `fleetwise/__init__.py` (`load_model`) and `__main__` beside the command line,
`loading` (a run's model back) beside tracking, `rundir` (what crosses the process boundary) and
`hostnet` (a node's network, which calibrate's inter-node probe uses too) below the runtime.
A new package or top-level module fails here until it is given a level."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers.repo import REPO

ROOT = REPO / "platform"

LEVELS = (
    ("cli", "__main__", "__init__"),
    ("launcher",),
    ("dryrun", "calibrate"),
    ("tracking", "loading"),
    ("runtime",),
    ("rundir", "hostnet"),
    ("families", "plan"),
    ("config", "models", "data"),
    ("compat",),
)

# (importing module or package, imported part): why the import goes up. Each entry must still be
# needed (a stale one fails), and nothing else may go up.
EXCEPTIONS = {
    ("fleetwise.config.model", "families"): (
        "the `model` section is the union of the families' schemas, built from their registry; the "
        "families import only config's leaves (base, problems), so this is no cycle"
    ),
    ("fleetwise.config.rules", "families"): (
        "a config rule asks the model's family what it supports (its shapes, tables, strategies); "
        "the families' own schemas live with them"
    ),
}


def _part(dotted: str) -> str:
    """The level-holding part a `fleetwise…` module name belongs to."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("").parts
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _imported(path: Path, name: str, top: set[str]) -> set[str]:
    """The `fleetwise…` modules the file imports; `from fleetwise import x` names `fleetwise.x` when x
    is one of the package's modules (`top`), else the package's `__init__`."""
    anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
            out |= (
                {f"fleetwise.{a.name}" if a.name in top else base for a in node.names}
                if base == "fleetwise"
                else {base}
            )
    return {n for n in out if n.split(".")[0] == "fleetwise"}


def upward_imports(root: Path = ROOT, levels=LEVELS) -> tuple[list[tuple[str, str, str, str]], set[str]]:
    """(module, what it imports, its part, the imported part) for each import that goes up the order;
    and the parts that have no level."""
    rank = {part: i for i, level in enumerate(levels) for part in level}
    pkg = root / "fleetwise"
    top = {p.stem for p in pkg.glob("*.py")} | {p.parent.name for p in pkg.glob("*/__init__.py")}
    wrong, unplaced = [], {part for part in top if part not in rank}
    for path in sorted(pkg.rglob("*.py")):
        name = _module(path, root)
        mine = _part(name)
        for target in sorted(_imported(path, name, top)):
            theirs = _part(target)
            if theirs != mine and rank.get(theirs, -1) < rank.get(mine, -1) and theirs in rank:
                wrong.append((name, target, mine, theirs))
    return wrong, unplaced


def _describe(up: tuple[str, str, str, str]) -> str:
    return "{} imports {} ({} is below {})".format(*up)


def _exception(up: tuple[str, str, str, str]) -> tuple[str, str] | None:
    module, _, _, theirs = up
    return next(
        (key for key in EXCEPTIONS if f"{module}.".startswith(f"{key[0]}.") and theirs == key[1]), None
    )


def test_every_import_follows_the_order():
    wrong, unplaced = upward_imports()
    assert not unplaced, f"give these a level in LEVELS (and the README's order): {sorted(unplaced)}"
    unexcused = [_describe(up) for up in wrong if _exception(up) is None]
    assert not unexcused, unexcused
    stale = set(EXCEPTIONS) - {_exception(up) for up in wrong}
    assert not stale, f"these imports no longer go up: delete their EXCEPTIONS entries {sorted(stale)}"
    # What keeps the exceptions safe: the families take only config's leaves (paths: Llama reads the
    # model group's defaults to tell a value set from one left alone; it imports nothing of fleetwise).
    families = (ROOT / "fleetwise" / "families").rglob("*.py")
    taken = {t for p in families for t in _imported(p, _module(p), {"config"}) if _part(t) == "config"}
    assert taken <= {"fleetwise.config.base", "fleetwise.config.problems", "fleetwise.config.paths"}, taken


def test_the_check_sees_an_upward_import_and_an_unplaced_part(tmp_path):
    pkg = tmp_path / "fleetwise"
    for sub in ("launcher", "runtime", "plan"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("__version__ = '0'\n")
    (pkg / "rundir.py").write_text("from fleetwise.plan import records\n")
    (pkg / "sweeps.py").write_text("")
    (pkg / "runtime" / "worker.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fleetwise import rundir\n"
        "def main():\n    from fleetwise.launcher.job import run\n    from fleetwise.plan import make_plan\n"
    )
    (pkg / "plan" / "search.py").write_text("from fleetwise import __version__, sweeps\n")
    levels = (("__init__",), ("launcher",), ("runtime",), ("rundir",), ("plan",))
    wrong, unplaced = upward_imports(tmp_path, levels)
    assert [_describe(up) for up in wrong] == [
        "fleetwise.plan.search imports fleetwise (plan is below __init__)",
        "fleetwise.runtime.worker imports fleetwise.launcher.job (runtime is below launcher)",
    ]
    assert unplaced == {"sweeps"}


def test_importing_fleetwise_imports_no_torch():
    """`import fleetwise` (for `fleetwise.load_model`) stays torch-free, as the README promises:
    torch is imported when load_model is called, not before."""
    import subprocess
    import sys

    code = "import sys, fleetwise; assert callable(fleetwise.load_model); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
