"""No module reads another module's private attributes, tests included (issue 25).

A leading underscore means "this module only". Shared state has one owner with a public API;
a test that needs to observe or pause something uses a public name of the component that owns
it (``ex.dispatch.snapshot()``, ``ex.completion.head()``, ``job_of(handle)``, a public method
patched with ``monkeypatch``), never ``ex._armed`` or ``handle._job``.

The check is static (``ast``), over every ``.py`` file of the package and its tests and
examples. A module may use the private names it defines itself (``def _x``, ``class _X``,
``self._x = ...``, ``_X = ...``, ``__slots__`` entries): an object of its own class reached
through another variable is its own business. Everything else is a violation:

- ``obj._name`` where ``obj`` is not ``self``/``cls``/``super()`` and ``_name`` is not one of
  the module's own private names;
- ``from calexec.x import _name`` (a private name of another module), except a module's own
  compiled extension (``alloccount.py`` importing ``_alloccount``);
- ``getattr``/``setattr``/``hasattr``/``delattr``/``monkeypatch.setattr`` with a private name
  on another object.

Being name-based it cannot tell two classes' ``_mu`` apart (a module that defines ``_mu``
could read another module's ``_mu`` unnoticed); it never flags a legitimate use.

Third-party internals with no public equivalent are listed in ``THIRD_PARTY`` with the reason
(the versions are pinned in constraints.txt, and the tests named there break if they move),
and in ``THIRD_PARTY_READ_IN`` the files that read them: elsewhere such a name is a violation
(it may be a calexec class's private of the same name).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", "__pycache__", "build", "dist", ".venv", "venv", "node_modules",
             ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache"}

#: namedtuple's public API is spelled with one underscore
NAMEDTUPLE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}

#: CPython's documented ``sys`` functions spelled with one underscore (the explorer's and the
#: stateful test's stack dumps)
SYS = {"_getframe", "_current_frames"}

#: CPython's documented ``os`` function spelled with one underscore: ``os._exit``, the exit
#: that waits for no thread (calexec/cli.py: a chart module's thread left running)
OS = {"_exit"}

#: private attributes of third-party objects we read, and why no public API does it
THIRD_PARTY = {
    "_invoke_handler": "python-statemachine's invoke wrapper (``_InvokeCallableWrapper``): the "
                       "handler object a state's ``invoke=`` was given, which no public name "
                       "gives back; machines/chart_support.py names an unsupported invoke by it "
                       "(``invoke timeout(0.15, on='expired')``, not ``'_Timeout'``: "
                       "tests/test_charts_toolkit_probe63.py::"
                       "test_an_invoked_timeout_is_named_as_declared)",
    "_specs": "python-statemachine Transition: its guard callback specs have no public "
              "accessor; machines/compiled.py builds the chart table from them and "
              "machines/mutants.py replaces one (tests/test_charts_compiled.py, "
              "tests/test_charts_mutate.py)",
    "_targets": "python-statemachine Transition: machines/mutants.py retargets a transition "
                "(tests/test_charts_mutate.py)",
    "_events": "python-statemachine StateMachine class: its declared events in declaration "
               "order (machines/compiled.py; tests/test_charts_compiled.py)",
    "_class_listeners": "python-statemachine chart class: the listeners every new instance "
                        "gets (the class's ``listeners`` attribute, collected at class "
                        "creation); machines/coverage.py ``track`` adds one for a test session "
                        "and removes it (tests/test_charts_toolkit.py)",
    "_listeners": "python-statemachine StateChart instance: the listeners added to it, by "
                  "id; python-statemachine 3.2 has ``add_listener`` and no call that removes "
                  "one, so machines/chart_support.py ``remove_listener`` takes a tool's "
                  "listener off again (tests/test_charts_toolkit_probe55.py::"
                  "test_enable_disable_cycles_leave_every_instance_s_listeners_as_they_were)",
    "_callbacks": "python-statemachine StateChart instance: its callbacks registry, where "
                  "``add_listener`` resolved the listener's callbacks; ``remove_listener`` "
                  "takes those out (same test)",
    "_registry": "python-statemachine CallbacksRegistry: its callback lists by key, which "
                 "``remove_listener`` replaces without the removed listener's (same test)",
    "_actions": "argparse.ArgumentParser: no public list of a parser's arguments "
                "(tests/test_cli.py checks that every flag has help)",
    "_iscoro": "python-statemachine CallbackWrapper: whether a resolved callback is a "
               "coroutine function; the registry's public ``has_async_callbacks`` says only "
               "that one is, machines/statechart_run.py names which ones it refuses "
               "(tests/test_charts_support.py::"
               "test_async_callbacks_of_the_model_or_a_listener_are_refused_naming_them)",
    "_send_error_execution": "python-statemachine BaseEngine (both engines): where an error "
                             "raised while ``error.execution`` is handled is dropped, logged "
                             "only (no event, no listener call, nothing public says so); "
                             "machines/error_events.py wraps it while a monitor is enabled, so "
                             "the explorer hears it (tests/test_charts_newcomer_probe66.py::"
                             "test_an_error_raised_while_handling_error_execution_fails_the_"
                             "schedule)",
}

#: the files that read each of ``THIRD_PARTY`` (paths from the repository's root), and no
#: other: a calexec class may have a private of the same name (``Job._callbacks``), which a
#: module not its owner must not read under cover of the third party's
THIRD_PARTY_READ_IN: dict[str, frozenset[str]] = {
    "_invoke_handler": frozenset({"machines/chart_support.py"}),
    "_specs": frozenset({"machines/chart_support.py", "machines/compiled.py",
                         "machines/mutants.py", "machines/paths.py",
                         "machines/statechart_run.py",
                         # (stop 74's paths.py, the reference of stop 75's exploration test)
                         "tests/paths_reference74.py"}),
    "_targets": frozenset({"machines/mutants.py"}),
    "_events": frozenset({"machines/compiled.py"}),
    "_class_listeners": frozenset({"machines/chart_support.py", "machines/coverage.py",
                                   "machines/inspector.py", "tests/test_charts_support.py"}),
    "_listeners": frozenset({"machines/chart_support.py",
                             "tests/test_charts_toolkit_probe55.py"}),
    "_callbacks": frozenset({"machines/chart_support.py"}),
    "_registry": frozenset({"machines/chart_support.py"}),
    "_actions": frozenset({"tests/test_cli.py"}),
    "_iscoro": frozenset({"machines/statechart_run.py"}),
    "_send_error_execution": frozenset({"machines/error_events.py"}),
}

ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_private_names(tree: ast.AST) -> set[str]:
    """The private names a module defines itself."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            own.update(elt.value for elt in ast.walk(node.value)
                       if isinstance(elt, ast.Constant) and isinstance(elt.value, str))
    return {name for name in own if _private(name)}


def violations(source: str, path: str = "<string>") -> list[str]:
    """Every read or write of another module's private name in ``source``."""
    tree = ast.parse(source, path)
    own = own_private_names(tree)
    stem = Path(path).stem
    third_party = {name for name, files in THIRD_PARTY_READ_IN.items() if path in files}
    found: list[tuple[int, str]] = []

    def add(node: ast.AST, what: str) -> None:
        found.append((getattr(node, "lineno", 0), what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) \
                    and base.func.id == "super":
                continue
            if node.attr in own or node.attr in NAMEDTUPLE or node.attr in third_party or (
                    node.attr in SYS and isinstance(base, ast.Name) and base.id == "sys") or (
                    node.attr in OS and isinstance(base, ast.Name) and base.id == "os"):
                continue
            add(node, ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and (node.level or (
                node.module or "").split(".")[0] == "calexec"):
            for alias in node.names:
                if _private(alias.name) and alias.name != f"_{stem}":
                    add(node, f"from {'.' * node.level}{node.module or ''} import {alias.name}")
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            target, attr = node.args[0], node.args[1]
            if name in ACCESSORS and isinstance(attr, ast.Constant) \
                    and isinstance(attr.value, str) and _private(attr.value) \
                    and not (isinstance(target, ast.Name) and target.id in ("self", "cls")) \
                    and attr.value not in own and attr.value not in third_party:
                add(node, ast.unparse(node)[:120])
    return [f"{path}:{line}: {what}" for line, what in sorted(found)]


def project_files() -> list[Path]:
    return sorted(path for path in ROOT.rglob("*.py")
                  if not set(path.relative_to(ROOT).parts[:-1]) & SKIP_DIRS)


def test_no_module_reads_another_modules_private_attributes():
    files = project_files()
    assert len(files) > 100, f"only {len(files)} files found under {ROOT}"
    found = [v for path in files
             for v in violations(path.read_text(encoding="utf-8"),
                                 str(path.relative_to(ROOT)))]
    assert not found, ("private names of another module (use a public name of the owning "
                       "component):\n" + "\n".join(found))


def test_the_check_finds_each_kind_of_violation():
    source = '''
from calexec.machines.job import _hidden
from calexec.drivers import _alloccount
import threading

class Mine:
    def __init__(self):
        self._mine = 1

    def ok(self, other):
        return self._mine + other._mine

def bad(ex, handle, monkeypatch):
    ex._armed.append(handle._job)
    monkeypatch.setattr(ex, "_prepare", None)
    return getattr(handle, "_job")
'''
    found = violations(source, "drivers/alloccount.py")
    assert [line.split(": ", 1)[1] for line in found] == [
        "from calexec.machines.job import _hidden",
        "ex._armed",
        "handle._job",
        "monkeypatch.setattr(ex, '_prepare', None)",
        "getattr(handle, '_job')",
    ], found
    # importing one's own compiled extension is allowed only to that module
    assert any("import _alloccount" in v for v in violations(source, "drivers/other.py"))


def test_a_third_party_private_is_read_only_where_listed():
    """A ``THIRD_PARTY`` name is allowed only in the files listed for it: ``Job._callbacks``
    read outside machines/job.py is a reach-in, though python-statemachine's ``_callbacks``
    may be read in machines/chart_support.py."""
    assert set(THIRD_PARTY_READ_IN) == set(THIRD_PARTY)
    assert all((ROOT / f).is_file() for files in THIRD_PARTY_READ_IN.values() for f in files)
    source = """
def count(job, machine):
    return len(job._callbacks or ()) + hasattr(machine, "_callbacks")
"""
    assert violations(source, "machines/chart_support.py") == []
    found = violations(source, "machines/executor.py")
    assert [line.split(": ", 1)[1] for line in found] == [
        "hasattr(machine, '_callbacks')", "job._callbacks"], found
