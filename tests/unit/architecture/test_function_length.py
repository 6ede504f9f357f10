"""Functions a reader can take in: none in platform/ is longer than 120 lines (issue 37), nested
functions and methods included, each counted from its `def` to its last line."""

from __future__ import annotations

import ast

from helpers.repo import REPO

PACKAGE = REPO / "platform" / "fleetwise"
MAX_LINES = 120


def _lengths(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node, node.end_lineno - node.lineno + 1


def test_no_function_in_the_package_is_longer_than_120_lines():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100 and PACKAGE / "plan" / "planner.py" in files  # the whole package is read
    long = [
        f"{p.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)"
        for p in files
        for node, lines in _lengths(p)
        if lines > MAX_LINES
    ]
    assert not long, long
