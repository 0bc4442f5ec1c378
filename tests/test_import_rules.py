"""The layer rules of docs/architecture.md, checked on the source (issue 15 §5).

- ``contracts`` imports nothing of calexec but itself;
- ``machines`` imports only ``contracts`` and itself (no cffi, no driver);
- ``drivers/serving`` and ``drivers/fleet`` never import ``drivers/tools`` (a server does not
  depend on the benchmarks and gates that measure it), directly or through another module.

Every import statement counts, module level or inside a function (a lazy import is still a
dependency). The check reads the AST, so it needs nothing installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("contracts", "machines", "drivers")


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "calexec." + ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every calexec module ``path`` imports (``from calexec.x import y`` counts as
    calexec.x.y when that is a module, else calexec.x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("calexec"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("calexec"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


SOURCES = {_module_of(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))
           if ".venv" not in p.parts}
MODULES = set(SOURCES)
GRAPH = {module: _imports(path) for module, path in SOURCES.items()}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _reachable(start: str) -> dict[str, str]:
    """Modules reachable from ``start`` through calexec imports -> the module importing it."""
    seen, todo = {start: ""}, [start]
    while todo:
        current = todo.pop()
        for target in GRAPH.get(current, ()):
            if target in MODULES and target not in seen:
                seen[target] = current
                todo.append(target)
    return seen


def _chain(seen: dict[str, str], end: str) -> str:
    chain = [end]
    while seen[chain[-1]]:
        chain.append(seen[chain[-1]])
    return " -> ".join(reversed(chain))


def test_the_source_tree_was_found():
    """The rules below would pass vacuously on an empty walk."""
    assert "calexec.machines.executor" in GRAPH and "calexec.contracts.status" in GRAPH
    assert "calexec.drivers.serving.server" in GRAPH and "calexec.drivers.tools.demo" in GRAPH
    assert "calexec.contracts.status" in GRAPH["calexec.machines.executor"]


@pytest.mark.parametrize("layer, allowed", [
    ("calexec.contracts", ("calexec.contracts",)),
    ("calexec.machines", ("calexec.contracts", "calexec.machines")),
])
def test_inner_layers_import_only_inward(layer, allowed):
    bad = sorted(f"{module} imports {target}"
                 for module, targets in GRAPH.items() if _within(module, layer)
                 for target in targets
                 if not any(_within(target, ok) for ok in allowed) and target != "calexec")
    assert bad == []


@pytest.mark.parametrize("package", ["calexec.drivers.serving", "calexec.drivers.fleet"])
def test_serving_and_fleet_never_reach_the_tools(package):
    bad = []
    for module in sorted(m for m in GRAPH if _within(m, package)):
        seen = _reachable(module)
        bad += [_chain(seen, m) for m in seen if _within(m, "calexec.drivers.tools")]
    assert bad == []


def test_the_rule_check_sees_a_violation(tmp_path):
    """The checker itself: an import of a tool from a serving module is found."""
    GRAPH["calexec.drivers.serving._probe"] = {"calexec.drivers.tools.demo"}
    MODULES.add("calexec.drivers.serving._probe")
    try:
        with pytest.raises(AssertionError):
            test_serving_and_fleet_never_reach_the_tools("calexec.drivers.serving")
    finally:
        del GRAPH["calexec.drivers.serving._probe"]
        MODULES.discard("calexec.drivers.serving._probe")
