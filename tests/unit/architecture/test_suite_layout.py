"""The suite's own layout: tests/unit/ mirrors the package, shared test code lives in tests/helpers/,
conftest.py holds fixtures and hooks only.

- A test of `fleetwise/<package>/…` lives in `tests/unit/<package>/…` (sub-folders mirror
  sub-packages, e.g. runtime/ps/); a test of a top-level module `fleetwise/<module>.py` is
  `tests/unit/test_<module>[_…].py`, or a folder `tests/unit/<module>/` when it has several (cli/).
  Besides these: architecture/ (rules over the whole package) and scripts/ (the repository's
  scripts/). tests/integration/ (ranks under torchrun) and tests/e2e/ (the console script,
  servers, a wheel) are grouped by what they start, not by package.
- Every other Python file under tests/ is a `test_*.py` file, conftest.py or a helper.
- Test files are imported by path (pytest's importlib mode), so one name may appear in several
  folders; a test file imports neither conftest nor another test file (what they share is in
  helpers/), and conftest.py defines only fixtures and `pytest_*` hooks."""

from __future__ import annotations

import ast

from helpers.repo import REPO

TESTS = REPO / "tests"
PACKAGE = REPO / "platform" / "fleetwise"
SUITE_FOLDERS = {"architecture", "scripts"}


def _places() -> tuple[set[str], set[str]]:
    """(folders a unit test may live in, relative to tests/unit; top-level module names)."""
    packages = {p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py")} - {"."}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    return packages | modules | SUITE_FOLDERS, modules


def _layout_problems() -> list[str]:
    folders, modules = _places()
    wrong = []
    for path in sorted((TESTS / "unit").rglob("*.py")):
        rel = path.relative_to(TESTS / "unit")
        folder = rel.parent.as_posix()
        if folder == ".":
            if not any(path.stem == f"test_{m}" or path.stem.startswith(f"test_{m}_") for m in modules):
                wrong.append(f"unit/{rel}: move it to unit/<package>/ (the package it tests)")
        elif folder not in folders and folder.split("/")[0] not in SUITE_FOLDERS:
            wrong.append(
                f"unit/{rel}: unit/{folder}/ is no package of fleetwise nor one of {sorted(SUITE_FOLDERS)}"
            )
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS)
        if rel.parts[0] != "helpers" and rel.name != "conftest.py" and not rel.name.startswith("test_"):
            wrong.append(f"{rel}: shared test code belongs in helpers/, tests in test_*.py files")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            wrong += [
                f"{rel} imports {n}: import it from helpers/" for n in names if n.split(".")[0] == "conftest"
            ]
            wrong += [
                f"{rel} imports the test file {n}" for n in names if n.split(".")[-1].startswith("test_")
            ]
    return wrong


def _conftest_problems() -> list[str]:
    wrong = []
    for node in ast.parse((TESTS / "conftest.py").read_text()).body:
        if isinstance(node, ast.FunctionDef):
            fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
            if not fixture and not node.name.startswith("pytest_"):
                wrong.append(f"conftest.py: {node.name} is no fixture nor hook: move it to helpers/")
        elif isinstance(node, ast.ClassDef | ast.Assign | ast.AnnAssign):
            wrong.append(f"conftest.py:{node.lineno}: constants and classes belong in helpers/")
    return wrong


def test_the_suite_mirrors_the_package_and_shares_code_through_helpers():
    wrong = _layout_problems() + _conftest_problems()
    assert not wrong, "\n".join(wrong)
