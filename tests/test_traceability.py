"""docs/traceability.md names, for each spec item, the test that proves it: a row is only as
good as that test, so every test it names must exist (a renamed or moved test leaves a row
that proves nothing). ``file.py::name`` and the ``::name`` that follow it in the same row
name a function, class or assigned test case of that file; a name ending in ``_`` (written
``test_fi07_*``) is a prefix of at least one."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: a file reference, a ``::name`` after one, or both
REFERENCE = re.compile(r"(test_\w+\.py)|::(\w+)")
DEFINED = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)|^\s*class\s+(\w+)|^(Test\w+)\s*=", re.M)


def defined_tests() -> dict[str, set[str]]:
    """Test file name -> the names it defines (tests/ and the examples' tests)."""
    files = [*ROOT.glob("tests/test_*.py"), *ROOT.glob("examples/**/test_*.py")]
    found: dict[str, set[str]] = {}
    for path in files:
        names = found.setdefault(path.name, set())
        for match in DEFINED.finditer(path.read_text(encoding="utf-8")):
            names.add(next(group for group in match.groups() if group))
    return found


def unknown_references(text: str, tests: dict[str, set[str]]) -> list[str]:
    """Every ``file.py`` or ``file.py::name`` of ``text``'s table rows that names nothing."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            continue
        current = None
        for match in REFERENCE.finditer(line):
            file, name = match.groups()
            if file is not None:
                current = file
                if file not in tests:
                    problems.append(f"line {number}: {file}: no such test file")
                continue
            if current is None or current not in tests:
                continue
            names = tests[current]
            if name in names or (name.endswith("_") and any(n.startswith(name) for n in names)):
                continue
            problems.append(f"line {number}: {current}::{name}: not defined there")
    return problems


def test_every_test_the_traceability_table_names_exists():
    text = (ROOT / "docs" / "traceability.md").read_text(encoding="utf-8")
    problems = unknown_references(text, defined_tests())
    assert problems == [], "\n".join(problems)


def test_the_check_sees_a_renamed_a_moved_and_a_missing_test():
    tests = {"test_a.py": {"test_one", "test_fi07_hang", "TestMachine"}, "test_b.py": {"test_two"}}
    row = ("| item | code | `test_a.py::test_one`, `::test_fi07_*`, `::TestMachine`, "
           "`test_b.py::test_two` |")
    assert unknown_references(row, tests) == []
    bad = ("| item | code | `test_a.py::test_two`, `test_b.py::test_one`, `test_c.py`, "
           "`test_a.py::test_fi08_*` |")
    assert unknown_references(bad, tests) == [
        "line 1: test_a.py::test_two: not defined there",
        "line 1: test_b.py::test_one: not defined there",
        "line 1: test_c.py: no such test file",
        "line 1: test_a.py::test_fi08_: not defined there"]
