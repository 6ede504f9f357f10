"""The README's import rule: `cli` → `launcher` → `config`/`plan`/`families`/`runtime`/`tracking` → `models`/`data`.
Nothing below the parent side imports it (a rank must never pull in the launcher), and nothing
imports the command line."""

from __future__ import annotations

import ast

from helpers.repo import REPO

PACKAGE = REPO / "platform" / "fleetwise"
BELOW_LAUNCHER = ("config", "plan", "families", "runtime", "tracking", "models", "data")


def _imports(path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):  # function-level imports count too
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_nothing_below_the_launcher_imports_it_or_the_cli():
    files = [p for sub in BELOW_LAUNCHER for p in (PACKAGE / sub).rglob("*.py")] + [PACKAGE / "rundir.py"]
    wrong = [
        f"{p.relative_to(PACKAGE)} imports {name}"
        for p in files
        for name in sorted(_imports(p))
        if name.startswith(("fleetwise.launcher", "fleetwise.cli"))
    ]
    assert not wrong, wrong


def test_models_and_data_import_nothing_above_them():
    files = [p for sub in ("models", "data") for p in (PACKAGE / sub).rglob("*.py")]
    above = ("fleetwise.runtime", "fleetwise.tracking", "fleetwise.plan")
    wrong = [
        f"{p.relative_to(PACKAGE)} imports {name}"
        for p in files
        for name in sorted(_imports(p))
        if name.startswith(above)
    ]
    assert not wrong, wrong


def test_importing_fleetwise_imports_no_torch():
    """`import fleetwise` (for `fleetwise.load_model`) stays torch-free, as the README promises:
    torch is imported when load_model is called, not before."""
    import subprocess
    import sys

    code = "import sys, fleetwise; assert callable(fleetwise.load_model); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
