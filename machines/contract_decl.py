"""How a chart declares its contracts: ``@invariant(*states)``, ``@precondition(*events)``,
``@postcondition(*events)`` on a function of the model in the chart's class (docs/framework.md,
"Contracts on a chart"). Only the declaration: ``chart_contracts`` checks them. Imports nothing
of calexec, so a chart module (``machines/charts.py``) declares contracts without importing the
checker, which needs the compiled charts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import attrs

Kind = Literal["invariant", "precondition", "postcondition"]
#: the model as a contract sees it: any object (the chart's guard provider)
Model = object
#: a contract's check: called with the model (its parameter may be typed as the chart's own
#: model class or a Protocol of it, hence the open signature), true when the contract holds
Check = Callable[..., object]


@attrs.frozen
class Contract:
    """One declared contract: ``kind`` on ``names`` (states for an invariant, events for a
    pre/postcondition); ``check(model)`` says whether it holds."""

    kind: Kind
    names: tuple[str, ...]
    check: Check
    name: str


def _decorator(kind: Kind, names: tuple[str, ...]) -> Callable[[Check], Contract]:
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"@{kind}{names!r}: name at least one "
                         f"{'state' if kind == 'invariant' else 'event'} (a non-empty str)")

    def wrap(func: Check) -> Contract:
        if isinstance(func, Contract):  # stacked decorators: one contract per decorator
            raise ValueError(f"@{kind} on {func.name}: stack contracts by listing several "
                             f"names in one decorator")
        return Contract(kind, names, func, getattr(func, "__name__", repr(func)))

    return wrap


def invariant(*states: str) -> Callable[[Check], Contract]:
    """Declare that ``func(model)`` holds whenever a run is in one of ``states``."""
    return _decorator("invariant", states)


def precondition(*events: str) -> Callable[[Check], Contract]:
    """Declare that ``func(model)`` holds when one of ``events`` is taken, before the state
    changes."""
    return _decorator("precondition", events)


def postcondition(*events: str) -> Callable[[Check], Contract]:
    """Declare that ``func(model)`` holds right after one of ``events`` was taken."""
    return _decorator("postcondition", events)
