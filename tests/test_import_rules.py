"""The dependency table of docs/architecture.md, checked on the source (issues 15 §5 and 25).

Every module of the ``calexec`` package counts: ``calexec/`` (the command layer), and the layer
folders ``contracts/``, ``machines/``, ``drivers/`` installed under it. Each module belongs to
one package of the table (``UNITS``: the longest name that prefixes it); an import of a module
of another package must be one the table allows (``MAY_IMPORT``). Between modules, no import
may close a cycle (except ``ALLOWED_FOR_NOW``, below).

What counts as an import: every ``import``/``from ... import`` of a calexec module, at module
level or inside a function or method (a lazy import is still a dependency), relative ones
resolved, and ``importlib.import_module("calexec...")`` with a literal name. Imports under
``if TYPE_CHECKING:`` do not count (they never run). ``from calexec.x import y`` is an import of
``calexec.x.y`` when that is a module (source or a cffi-compiled extension), else of
``calexec.x``. The check reads the AST, so it needs nothing installed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: source folder -> the package it installs as (setup.py's package_dir)
FOLDERS = {"calexec": "calexec", "contracts": "calexec.contracts",
           "machines": "calexec.machines", "drivers": "calexec.drivers"}

# ---- the table (docs/architecture.md, "Dependencies"; a test below keeps the two equal) -------
#: package of the table -> the module names it holds (each with everything below it)
UNITS: dict[str, tuple[str, ...]] = {
    "contracts": ("calexec.contracts",),
    "machines": ("calexec.machines",),
    "native": ("calexec.drivers.native",),
    "calrt": ("calexec.drivers.calrt",),
    "synthetic": ("calexec.drivers.synthetic",),
    "drivers": ("calexec.drivers",),
    "serving": ("calexec.drivers.serving",),
    "fleet": ("calexec.drivers.fleet",),
    "tools": ("calexec.drivers.tools",),
    "cliargs": ("calexec.cliargs", "calexec.commands"),
    "commands": ("calexec.cli", "calexec.serve", "calexec.__main__"),
}
#: the package root (``calexec/__init__.py``: ``__version__``): anyone may import it, and it
#: imports nothing
PACKAGE_ROOT = "calexec"
#: package -> the other packages it may import (directly; transitively follows)
MAY_IMPORT: dict[str, frozenset[str]] = {
    "contracts": frozenset(),
    "machines": frozenset({"contracts"}),
    "native": frozenset(),
    "calrt": frozenset({"contracts", "native"}),
    "synthetic": frozenset(),
    "drivers": frozenset({"contracts", "machines", "native", "calrt", "synthetic"}),
    "serving": frozenset({"contracts", "machines"}),
    "fleet": frozenset({"contracts", "machines", "calrt", "drivers", "serving"}),
    "tools": frozenset({"contracts", "machines", "native", "calrt", "synthetic", "drivers",
                        "serving", "cliargs"}),
    "cliargs": frozenset({"drivers"}),
    "commands": frozenset(set(UNITS) - {"commands"}),
}

#: Cycles tolerated: none. (Issue 25's restructuring of machines/ tolerated executor <->
#: stream <-> autoarm while it moved; stream, autoarm and the executor's components name the
#: executor only for type checking.) A cycle is allowed only if every module of it is in one
#: of these sets.
ALLOWED_FOR_NOW: tuple[frozenset[str], ...] = ()


# ---- the source ---------------------------------------------------------------------------------
def _module_of(folder: str, path: Path) -> str:
    parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([FOLDERS[folder], *parts])


SOURCES: dict[str, Path] = {
    _module_of(folder, path): path
    for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
    if not {".venv", "build", "__pycache__"} & set(path.relative_to(ROOT).parts)}
#: cffi-compiled modules, named by the build scripts (``ffibuilder.set_source("calexec...")``)
EXTENSIONS: set[str] = {
    name for path in SOURCES.values()
    for name in re.findall(r"set_source\(\s*[\"'](calexec[\w.]+)[\"']",
                           path.read_text(encoding="utf-8"))}
MODULES: set[str] = set(SOURCES) | EXTENSIONS


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module: str, source: str, filename: str = "<source>",
               package: bool = False, modules: set[str] | None = None) -> dict[str, int]:
    """calexec module imported -> the first line importing it, for the source of ``module``
    (``package``: the source is its ``__init__``). Skips ``if TYPE_CHECKING:`` bodies."""
    known = MODULES if modules is None else modules
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target == "calexec" or target.startswith("calexec."):
            found.setdefault(target, line)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                parts = module.split(".") if package else module.split(".")[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value, node.lineno)
        visit(node)

    visit(ast.parse(source, filename))
    return found


GRAPH: dict[str, dict[str, int]] = {
    module: imports_of(module, path.read_text(encoding="utf-8"), str(path),
                       package=path.name == "__init__.py")
    for module, path in SOURCES.items()}


def _within(module: str, name: str) -> bool:
    return module == name or module.startswith(name + ".")


def unit_of(module: str) -> str | None:
    """The package of the table holding ``module`` (None: the package root)."""
    if module == PACKAGE_ROOT:
        return None
    best = max(((len(name), unit) for unit, names in UNITS.items() for name in names
                if _within(module, name)), default=None)
    if best is None:
        raise AssertionError(f"{module} belongs to no package of the table (UNITS)")
    return best[1]


def _where(module: str, line: int) -> str:
    path = SOURCES.get(module)
    return f"{path.relative_to(ROOT)}:{line}" if path else f"{module}:{line}"


# ---- the checks (pure functions of a graph, so the tests below can feed them a probe) ----------
def violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports the table forbids, each naming the importing line, the import and the rule."""
    bad = []
    for module, targets in sorted(graph.items()):
        unit = unit_of(module)
        for target, line in sorted(targets.items()):
            if target == PACKAGE_ROOT:
                if unit is None:
                    bad.append(f"{_where(module, line)}: the package root imports {target}")
                continue
            other = unit_of(target)
            if unit is None:
                bad.append(f"{_where(module, line)}: {module} (the package root) imports "
                           f"{target}; it may import nothing")
            elif other != unit and other not in MAY_IMPORT[unit]:
                allowed = ", ".join(sorted(MAY_IMPORT[unit])) or "nothing of calexec"
                bad.append(f"{_where(module, line)}: {module} ({unit}) imports {target} "
                           f"({other}); {unit} may import {allowed}")
    return bad


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components of more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _one_loop(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """One cycle through ``component``'s first module, each step with its importing line."""
    start, members = component[0], set(component)
    came_from: dict[str, tuple[str, int]] = {}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for target, line in sorted(graph[node].items()):
            if target not in members:
                continue
            if target == start:
                steps = [(node, line)]
                while steps[-1][0] != start:
                    steps.append(came_from[steps[-1][0]])
                path = [f"{m} ({_where(m, n)})" for m, n in reversed(steps)]
                return " -> ".join(path + [start])
            if target not in came_from:
                came_from[target] = (node, line)
                todo.append(target)
    raise AssertionError(f"no cycle through {start} in {component}")  # pragma: no cover


def cycles(graph: dict[str, dict[str, int]],
           allowed: tuple[frozenset[str], ...] = ALLOWED_FOR_NOW) -> list[str]:
    """Import cycles between modules that are not inside an allowed set, one loop each."""
    return [_one_loop(graph, component) for component in _strongly_connected(graph)
            if not any(set(component) <= ok for ok in allowed)]


def documented_table() -> dict[str, frozenset[str]]:
    """The "may import" column of docs/architecture.md's dependency table."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "\n## Dependencies" in text, "docs/architecture.md has no '## Dependencies' section"
    section = text.split("\n## Dependencies", 1)[1].split("\n## ", 1)[0]
    table = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`\w+`", cells[0]):
            names = set(re.findall(r"`(\w+)`", cells[2]))
            table[cells[0].strip("`")] = frozenset(
                set(UNITS) - {"commands"} if "everything" in cells[2] else names)
    return table


# ---- the tests ----------------------------------------------------------------------------------
def test_the_source_tree_was_found():
    """The rules below would pass vacuously on an empty walk."""
    assert {"calexec.cli", "calexec.cliargs", "calexec.serve", "calexec.machines.executor",
            "calexec.contracts.status", "calexec.drivers.serving.server",
            "calexec.drivers.tools.demo", "calexec.drivers.native.fused_logits"} <= set(GRAPH)
    assert "calexec.contracts.status" in GRAPH["calexec.machines.executor"]
    assert "calexec.drivers.native._calexec_native" in EXTENSIONS
    for unit, names in UNITS.items():
        assert any(unit_of(m) == unit for m in GRAPH), f"no module in {unit} ({names})"


def test_every_import_is_one_the_table_allows():
    assert violations(GRAPH) == []


def test_no_import_cycle_between_modules():
    assert cycles(GRAPH) == []


def test_the_table_itself_has_no_loop():
    """Packages import each other in one direction only (so no cycle can span packages)."""
    graph = {unit: dict.fromkeys(targets, 0) for unit, targets in MAY_IMPORT.items()}
    assert set(MAY_IMPORT) == set(UNITS)
    assert _strongly_connected(graph) == []


def test_the_documented_table_is_the_enforced_one():
    assert documented_table() == MAY_IMPORT


def test_package_inits_import_nothing_of_calexec():
    """Importing a module runs its parents' ``__init__``: they must bring no dependency."""
    inits = {m: t for m, t in GRAPH.items() if SOURCES[m].name == "__init__.py"}
    assert len(inits) > 8
    assert {m: sorted(t) for m, t in inits.items() if t} == {}


@pytest.mark.parametrize("package", ["calexec.drivers.serving", "calexec.drivers.fleet"])
def test_serving_and_fleet_never_reach_the_tools_or_the_commands(package):
    """Transitively too: a server does not depend on what measures it, nor on a CLI."""
    bad = []
    for module in sorted(m for m in GRAPH if _within(m, package)):
        seen, todo = {module: ""}, [module]
        while todo:
            current = todo.pop()
            for target in GRAPH.get(current, ()):
                if target in GRAPH and target not in seen:
                    seen[target] = current
                    todo.append(target)
        for reached in seen:
            if unit_of(reached) in ("tools", "cliargs", "commands"):
                chain = [reached]
                while seen[chain[-1]]:
                    chain.append(seen[chain[-1]])
                bad.append(" -> ".join(reversed(chain)))
    assert bad == []


def test_no_two_modules_share_a_file_name():
    """One name, one module (issue 25): across the package, the tests and CI's scripts."""
    seen: dict[str, list[str]] = {}
    for folder in (*FOLDERS, "tests", ".ci"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = set(path.relative_to(ROOT).parts)
            if path.name not in ("__init__.py", "__main__.py") and not {
                    ".venv", "build", "__pycache__"} & parts:
                seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


# ---- the checker itself -------------------------------------------------------------------------
PROBE = '''
from typing import TYPE_CHECKING

from calexec.contracts.status import Status
from . import wire

if TYPE_CHECKING:
    from calexec.drivers.tools.demo import main

def lazily():
    from calexec.drivers.fleet import ray_serve
    import importlib
    importlib.import_module("calexec.cliargs")
'''


def test_the_checker_reads_lazy_relative_and_dynamic_imports_but_not_type_checking():
    found = imports_of("calexec.drivers.serving._probe", PROBE)
    assert found == {"calexec.contracts.status": 4, "calexec.drivers.serving.wire": 5,
                     "calexec.drivers.fleet.ray_serve": 11, "calexec.cliargs": 13}


def test_the_checker_sees_a_violation():
    """A serving module reaching the fleet and the command layer lazily, as serve.py once did,
    is named with its line and the rule it breaks."""
    graph = {**GRAPH, "calexec.drivers.serving._probe": imports_of(
        "calexec.drivers.serving._probe", PROBE)}
    found = [v for v in violations(graph) if "_probe" in v]
    assert len(found) == 2, found
    assert all("calexec.drivers.serving._probe (serving) imports" in v for v in found)
    assert any("calexec.drivers.fleet.ray_serve (fleet); serving may import contracts, "
               "machines" in v for v in found)
    assert any("calexec.cliargs (cliargs)" in v and ":13:" in v for v in found)


def test_the_checker_sees_a_cycle():
    """cliargs importing cli back (as it once did) closes cli -> cliargs -> cli; the loop is
    named step by step. A cycle inside an allowed set is tolerated, one leaving it is not."""
    graph = {m: dict(t) for m, t in GRAPH.items()}
    graph["calexec.cliargs"]["calexec.cli"] = 180
    found = [c for c in cycles(graph) if "calexec.cliargs" in c]
    assert len(found) == 1, found
    assert found[0].startswith("calexec.cli (calexec/cli.py:") and "-> calexec.cliargs (" \
        in found[0] and found[0].endswith("calexec/cliargs.py:180) -> calexec.cli"), found[0]
    assert not [c for c in cycles(graph, allowed=(frozenset({"calexec.cli", "calexec.cliargs"}),))
                if "calexec.cliargs" in c]

    def machines_loops() -> list[str]:
        return [c for c in cycles(graph) if "calexec.machines." in c]

    assert machines_loops() == []
    graph["calexec.machines.stream"]["calexec.machines.executor"] = 1  # at run time, not only
    assert len(machines_loops()) == 1  # for type checking: executor -> stream -> executor
