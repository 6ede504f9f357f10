"""No import cycle between files of the package: every `import` counts, inside functions and under
`if TYPE_CHECKING:` too (a cycle of type hints is still two modules that cannot be read apart).

Package `__init__` files count as the files they are; importing `a.b.c` is an edge to `a/b/c.py`
only (Python runs `a/b/__init__.py` first, but a registry package that imports its submodules
would otherwise be a cycle with each of them). `from a.b import c` names the package too: it is an
edge to `a/b/__init__.py` as well as to `a/b/c.py` (write `from a.b.c import x` or `import a.b.c`
where the package's `__init__` imports the file back)."""

from __future__ import annotations

import ast

from helpers.repo import REPO

ROOT = REPO / "platform"


def _modules(root) -> dict[str, object]:
    out = {}
    for path in (root / "fleetwise").rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _edges(name: str, path, modules) -> set[str]:
    """The package's files `name` imports (`from a import b` names a/b.py when that is a module)."""
    anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_cycles(root=ROOT) -> list[frozenset[str]]:
    """The strongly connected components of more than one file (Tarjan)."""
    modules = _modules(root)
    graph = {m: _edges(m, p, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycle():
    cycles = [sorted(c) for c in import_cycles()]
    assert not cycles, cycles


def test_the_check_sees_a_cycle_through_type_hints(tmp_path):
    pkg = tmp_path / "fleetwise"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from fleetwise.b import B\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fleetwise.a import A\n"
    )
    assert import_cycles(tmp_path) == [frozenset({"fleetwise.a", "fleetwise.b"})]


def test_the_check_sees_a_cycle_through_a_package_init(tmp_path):
    """`from fleetwise.pkg import mod` names the package: with the package's `__init__` importing a
    file that does so, the two are a cycle (as `fleetwise` ↔ `fleetwise.loading` ↔
    `fleetwise.runtime.checkpoint` and `fleetwise.runtime.ps` ↔ `fleetwise.runtime.ps.trainer` were);
    the same import written `import fleetwise.pkg.mod` is none."""
    pkg = tmp_path / "fleetwise" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "fleetwise" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("def run():\n    from fleetwise.pkg import user\n")
    (pkg / "mod.py").write_text("")
    (pkg / "user.py").write_text("from fleetwise.pkg import mod\n")
    assert import_cycles(tmp_path) == [frozenset({"fleetwise.pkg", "fleetwise.pkg.user"})]
    (pkg / "user.py").write_text("import fleetwise.pkg.mod as mod\n")
    assert import_cycles(tmp_path) == []
