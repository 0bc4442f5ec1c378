"""The lifecycle is a component with a declared host (issue 25): ``DeviceLifecycle`` reaches
the executor only through the members ``LifecycleHost`` lists, and ``DeviceExecutor`` has every
one of them. A new use of the executor from machines/device_lifecycle.py that is not in the
protocol fails here, as does a protocol member the executor lost.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from calexec.machines import device_lifecycle
from calexec.machines.device_lifecycle import DeviceLifecycle, LifecycleHost
from executor_harness import make_executor, write_calbin

SOURCE = Path(inspect.getfile(device_lifecycle))


def _host_names(tree: ast.AST) -> dict[str, int]:
    """Every attribute read or called on the host: ``host.X`` (a local bound to the host) and
    ``self._host.X``; name -> first line."""
    used: dict[str, int] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        on_host = (isinstance(base, ast.Name) and base.id == "host") or (
            isinstance(base, ast.Attribute) and base.attr == "_host"
            and isinstance(base.value, ast.Name) and base.value.id == "self")
        if on_host:
            used.setdefault(node.attr, node.lineno)
    return used


def _protocol_members() -> set[str]:
    members = set(getattr(LifecycleHost, "__annotations__", {}))
    members |= {name for name, value in vars(LifecycleHost).items()
                if callable(value) and not name.startswith("_")}
    return members


def test_the_lifecycle_uses_only_what_its_host_protocol_declares():
    used = _host_names(ast.parse(SOURCE.read_text()))
    assert used, "no host access found: the scan no longer matches the module"
    undeclared = {name: line for name, line in used.items() if name not in _protocol_members()}
    assert not undeclared, (
        f"machines/device_lifecycle.py uses executor members LifecycleHost does not declare "
        f"(name: line): {undeclared}")


def test_the_scan_sees_a_host_access_outside_the_protocol():
    """The check above can fail: a use of an undeclared member is found."""
    tree = ast.parse("def f(self, host):\n    host.submit_mu\n    self._host._armed\n")
    assert set(_host_names(tree)) - _protocol_members() == {"submit_mu", "_armed"}


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    ex = make_executor(write_calbin(tmp_path_factory.mktemp("lifecycle_component")),
                       threads=False)
    try:
        yield ex
    finally:
        ex.shutdown(grace=1.0)


def test_the_executor_is_the_host_it_declares(executor):
    missing = sorted(name for name in _protocol_members() if not hasattr(executor, name))
    assert not missing, f"DeviceExecutor lacks LifecycleHost members: {missing}"
    assert isinstance(executor.life, DeviceLifecycle)
    # every member the protocol declares is used: the protocol is not a wish list
    unused = _protocol_members() - set(_host_names(ast.parse(SOURCE.read_text())))
    assert not unused, f"LifecycleHost declares members the lifecycle never uses: {unused}"
