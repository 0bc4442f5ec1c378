"""``MODULE:CLASS`` -> the chart class it names: how the commands (``calexec charts draw``,
``charts paths``, ``charts mutate``) and the pytest plugin (``--chart-coverage``) are told
which chart to work on. The module is imported as ``import MODULE`` would from the current
directory (it is put first on ``sys.path``), so a user's own chart needs no installing.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from statemachine import StateChart


class ChartRefError(ValueError):
    """``MODULE:CLASS`` does not name a chart class; the message is one line naming what was
    given and what was expected: ``'<ref>': <reason>``. ``ref`` and ``reason`` are the two
    parts, for a caller that names the reference itself (``--chart='<ref>': <reason>``)."""

    def __init__(self, ref: str, reason: str) -> None:
        super().__init__(f"{ref!r}: {reason}")
        self.ref = ref
        self.reason = reason


def load_chart(ref: str, cwd: str | None = None) -> type[StateChart[Any]]:
    """The python-statemachine chart class (a ``StateMachine`` or ``StateChart`` subclass)
    that ``ref`` (``MODULE:CLASS``, ``CLASS`` may be dotted) names; ``cwd`` (default: the
    current directory) goes first on ``sys.path``. Raises ``ChartRefError``."""
    module_name, sep, class_name = ref.partition(":")
    if not sep or not module_name or not class_name:
        raise ChartRefError(ref, "expected MODULE:CLASS, a chart class and the module "
                                 "that declares it (e.g. order_workflow:OrderWorkflow)")
    root = os.path.abspath(cwd or os.getcwd())
    if "/" in module_name or os.sep in module_name or (
            module_name.endswith(".py") and os.path.isfile(os.path.join(root, module_name))):
        dotted = _module_under(root, module_name)
        if dotted is not None and "." in dotted:
            raise ChartRefError(ref, f"{module_name!r} is a file path, not a module name: "
                                f"name the module, as imported from {root} (e.g. "
                                f"{dotted}:{class_name})")
        stem = os.path.splitext(os.path.basename(module_name))[0] or module_name
        raise ChartRefError(ref, f"{module_name!r} is a file path, not a module name: run "
                            f"from the directory that holds it and name the module "
                            f"(e.g. {stem}:{class_name})")
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - the user's module may raise anything at
        # import, sys.exit() and an argparse error (SystemExit) included
        why = str(err).splitlines()[0] if str(err) else ""
        raise ChartRefError(ref, f"cannot import module {module_name!r} from {root} "
                            f"({type(err).__name__}{_where(err, root)}: {why})") from err
    found: object = module
    for part in class_name.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise ChartRefError(ref, f"module {module_name!r} has no attribute "
                                f"{class_name!r} (expected a chart class there)")
    if not (isinstance(found, type) and issubclass(found, StateChart)):
        raise ChartRefError(ref, f"{class_name} is {type(found).__name__} {found!r:.60}, "
                            f"not a python-statemachine chart class (a StateMachine or "
                            f"StateChart subclass)")
    if not found.states:
        raise ChartRefError(ref, f"{class_name} declares no states (a base class of "
                            f"charts? name the subclass that declares them)")
    return found


def _where(err: BaseException, root: str) -> str:
    """`` in chart class Broken at bad_chart.py:7`` for an error raised while a module under
    ``root`` was imported: the chart class python-statemachine was creating when it refused
    the definition (its metaclass's ``cls``), and the last line of a file under ``root`` the
    error passed through; ``""`` when neither is known. The chart's own message names the
    problem, not the class: a module of several charts would leave the reader guessing."""
    chart = ""
    line = ""
    tb = err.__traceback__
    while tb is not None:
        made = tb.tb_frame.f_locals.get("cls") if tb.tb_frame.f_code.co_name == "__init__" else None
        if isinstance(made, type) and issubclass(made, StateChart):
            chart = made.__qualname__
        filename = tb.tb_frame.f_code.co_filename  # "<frozen importlib...>": no file
        if os.path.isabs(filename) and filename.startswith(root + os.sep):
            line = f"{os.path.relpath(filename, root)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return (f" in chart class {chart}" if chart else "") + (f" at {line}" if line else "")


def _module_under(root: str, path: str) -> str | None:
    """The dotted module name ``import`` finds file ``path`` (``pkg/chart.py``, ``pkg/chart``)
    by from ``root``, or None when it is not a module file under ``root`` (outside it, a
    part that is no identifier)."""
    full = os.path.normpath(os.path.join(root, path))
    if not full.endswith(".py"):
        full += ".py"
    if not os.path.isfile(full):
        return None
    relative = os.path.relpath(full, root)[:-len(".py")]
    parts = relative.split(os.sep)
    if not all(part.isidentifier() for part in parts):
        return None  # "..", a dash, ...: not importable by this name from root
    return ".".join(parts)
