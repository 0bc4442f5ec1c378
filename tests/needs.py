"""What a test needs beyond the core: a system tool or an optional extra's module.

Absent, the test is skipped with the reason, so README's test command passes on a machine
with only Python; with ``CALEXEC_REQUIRE_TOOLS=1`` (``.ci/run`` sets it after installing the
tools and extras) an absence fails the test instead, so CI can never pass by skipping.

- ``@pytest.mark.requires_tool("dot")`` on a test (checked before its fixtures run), or
  ``tool("promtool")`` inside one for the path;
- ``module("ray", "ray")`` at a test module's top, in place of ``import ray``.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest

REQUIRE_ENV = "CALEXEC_REQUIRE_TOOLS"

#: tool -> Debian package that provides it (installed by .ci/run and .ci/install-server-tools)
PACKAGES = {"dot": "graphviz", "promtool": "prometheus", "chromium": "chromium", "make": "make"}


def required() -> bool:
    return os.environ.get(REQUIRE_ENV) == "1"


def _absent(message: str, allow_module_level: bool = False) -> None:
    if required():
        pytest.fail(f"{message} ({REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(message, allow_module_level=allow_module_level)


def tool(name: str) -> str:
    """Path of a system tool; skip (or fail under CALEXEC_REQUIRE_TOOLS=1) when absent."""
    path = shutil.which(name)
    if path is None:
        package = PACKAGES.get(name, name)
        _absent(f"{name!r} is not on PATH: install Debian's {package!r} package "
                "(.ci/run does; promtool and chromium: bash .ci/install-server-tools)")
    return path


def module(name: str, extra: str, install: str | None = None) -> ModuleType:
    """Import an optional extra's module; skip the test module (or fail) when absent.
    ``install``: how to install it, when that is not ``pip install -e '.[extra]'``."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        how = install or f"pip install -e '.[{extra}]'"
        _absent(f"{name!r} is not installed ({exc}): {how}", allow_module_level=True)
        raise  # not reached: _absent raised
