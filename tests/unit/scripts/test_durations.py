"""scripts/durations.py: tests/DURATIONS.md sums each test file's tests from a JUnit report, slowest
file first, with the total and the slowest tests."""

from __future__ import annotations

import importlib.util

from helpers.repo import REPO

spec = importlib.util.spec_from_file_location("durations", REPO / "scripts" / "durations.py")
durations = importlib.util.module_from_spec(spec)
spec.loader.exec_module(durations)

# what pytest writes under importlib mode and xdist: dotted class names, no file attribute
REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.unit.plan.test_planner" name="test_a" time="1.25"/>
<testcase classname="tests.unit.plan.test_planner" name="test_b" time="0.75"/>
<testcase classname="tests.integration.test_parity.TestLayouts" name="test_c[dp]" time="30.0"/>
<testcase classname="tests.integration.test_parity.TestLayouts" name="test_c[mp]" time="12.5"/>
<testcase file="tests/e2e/test_cli.py" classname="tests.e2e.test_cli" name="test_d" time="4.0"/>
</testsuite></testsuites>
"""


def test_files_are_summed_sorted_and_totalled(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the dotted names are matched against the files of the checkout
    xml = tmp_path / "junit.xml"
    xml.write_text(REPORT)
    table = durations.render(xml, wall=25.0, workers=2, load="0.10 0.20 0.30")
    rows = [line for line in table.splitlines() if line.startswith("| tests/")]
    assert rows[:3] == [
        "| tests/integration/test_parity.py | 2 | 42.5 | 87.6% |",
        "| tests/e2e/test_cli.py | 1 | 4.0 | 8.2% |",
        "| tests/unit/plan/test_planner.py | 2 | 2.0 | 4.1% |",
    ]
    assert "| **total** | **5** | **48.5** | |" in table
    assert "- wall time of the run: 25 s (0.4 min)" in table
    assert "- load average at the start of the run: 0.10 0.20 0.30" in table
    slowest = table.split("## The 15 slowest tests")[1]
    assert (
        slowest.index("test_c[dp] | 30.0")
        < slowest.index("test_c[mp] | 12.5")
        < slowest.index("test_d | 4.0")
    )


def test_the_table_reads_back_as_the_order_files_run_in(tmp_path, monkeypatch):
    """conftest.py runs the longest files first by this table (helpers/durations.py): what render
    writes must read back, thousands separators included, or the suite silently runs in xdist's order."""
    from helpers.durations import file_seconds

    monkeypatch.chdir(REPO)
    xml = tmp_path / "junit.xml"
    xml.write_text(REPORT.replace('time="30.0"', 'time="1234.5"'))
    table = tmp_path / "DURATIONS.md"
    table.write_text(durations.render(xml, wall=25.0, workers=2, load="0.10 0.20 0.30"))
    assert file_seconds(table) == {
        "tests/integration/test_parity.py": 1247.0,
        "tests/e2e/test_cli.py": 4.0,
        "tests/unit/plan/test_planner.py": 2.0,
    }
    committed = file_seconds(REPO / "tests" / "DURATIONS.md")
    assert len(committed) > 100 and all((REPO / path).is_file() for path in list(committed)[:20])


def test_the_session_runs_its_files_longest_first_and_make_keeps_that_order(request):
    """The README's promise: the suite runs its files longest first by the table. conftest.py sorts
    the session's items; make's xdist flags must not let xdist re-sort them by number of tests."""
    import math
    from pathlib import Path

    from helpers.durations import file_seconds

    seconds = file_seconds(REPO / "tests" / "DURATIONS.md")
    root = Path(str(request.config.rootpath))
    order = [
        seconds.get(Path(str(i.fspath)).relative_to(root).as_posix(), math.inf) for i in request.session.items
    ]
    assert order == sorted(order, reverse=True)
    xdist = next(line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("XDIST"))
    assert "--dist loadfile" in xdist and "--no-loadscope-reorder" in xdist
