"""Design by contract on a chart: invariants per state, pre- and postconditions per event.

Declared in the chart's class, one way only: a function of the model decorated with
``@invariant(*states)``, ``@precondition(*events)`` or ``@postcondition(*events)``::

    class OrderWorkflow(StateMachine):
        ...
        @invariant("paid", "shipped")
        def paid_orders_were_authorized(order: Order) -> bool:
            return order.authorized

The function takes the run's model (the object that answers the guards) and returns whether
the contract holds. An invariant is checked after every transition into (or within) one of
its states (every active state's invariants: those of a target's ancestors and of the
children entered with it too); a precondition after the transition was selected (guards passed) and before the
state changes; a postcondition after the state changed. The decorator returns a ``Contract``
(python-statemachine ignores it; it is not a callback). One decorator per function
(stacking is a ``ValueError``): list several states or events in it.

Contracts are checked only while enabled (``enable_contracts(Chart)`` returns a
``ContractMonitor``; ``with contracts_checked(Chart) as monitor:``), by both run kinds:

- compiled runs (``compiled(Chart).run(model)``): the monitor sets the chart's ``checker``,
  so ``ChartRun.send`` calls it around the state change (off: one attribute test);
- python-statemachine instances of the class created while enabled: a class-level listener
  (``ContractListener``) calls the same checker from ``before_transition``/``after_transition``.

A violated contract is a ``ContractViolation`` naming the chart, the contract, its kind, the
state or transition and the model (``repr``, capped). The monitor records every violation in
``violations`` and, unless built with ``raise_on_violation=False`` (the interleaving explorer,
which must not break the threads it schedules), raises it from the ``send`` that broke it.
``check_invariants(Chart, state, model)`` checks a state's invariants at any time (a
hypothesis ``@invariant`` calls it between rules).
"""

from __future__ import annotations

import difflib
import functools
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from statemachine import StateChart
from statemachine.exceptions import InvalidDefinition
from statemachine.transition import Transition as DeclaredTransition

from calexec.machines.chart_support import ToolListener, alive, by_its_name
from calexec.machines.contract_decl import (
    Check as Check,
)
from calexec.machines.contract_decl import (
    Contract as Contract,
)
from calexec.machines.contract_decl import (
    Kind as Kind,
)
from calexec.machines.contract_decl import (
    Model as Model,
)
from calexec.machines.contract_decl import (
    invariant as invariant,
)
from calexec.machines.contract_decl import (
    postcondition as postcondition,
)
from calexec.machines.contract_decl import (
    precondition as precondition,
)

if TYPE_CHECKING:  # compiled imports charts, which declares its contracts with this module
    from calexec.machines.compiled import ChartLike, CompiledChart, Transition

#: how much of ``repr(model)`` a violation carries
REPR_LIMIT = 300


class ContractViolation(InvalidDefinition):
    """A contract that did not hold: ``chart``, ``contract`` (its function's name), ``kind``,
    ``state`` (the state whose invariant broke; for a pre/postcondition the transition's
    source/target), ``transition`` (``source --event--> target``, or None for an invariant
    checked outside a transition) and ``data`` (``repr`` of the model, or the error the check
    raised).

    An ``InvalidDefinition`` (an ``Exception``) because that is the one error
    python-statemachine does not turn into the internal ``error.execution`` event under
    ``StateChart`` semantics (``catch_errors_as_events``): any other would be swallowed there,
    not raised from ``send``, and would send the chart down its own error transitions. The
    general run (machines/statechart_run.py) lets it through the same way."""

    def __init__(self, chart: str, contract: Contract, state: str,
                 transition: Transition | None, data: str) -> None:
        self.chart, self.contract, self.kind = chart, contract.name, contract.kind
        self.state, self.data = state, data
        self.transition = (None if transition is None else
                           f"{transition.source} --{transition.event or '(eventless)'}--> "
                           f"{transition.target}")
        where = (f"in state {state!r}" if self.transition is None
                 else f"on {self.transition} (state {state!r})")
        super().__init__(f"{chart}: {contract.kind} {contract.name!r} violated {where}; "
                         f"model: {data}")


def declared_contracts(chart: ChartLike) -> tuple[Contract, ...]:
    """The contracts declared in ``chart``'s class (and its bases), checked against the
    declaration: a contract naming an unknown state or event is a ``ValueError`` naming it."""
    from calexec.machines.compiled import compiled

    shared = compiled(chart)  # (async callbacks of its own: its instances are checked)
    found: dict[str, Contract] = {}
    for klass in reversed(shared.declaration.__mro__):
        for attr, value in vars(klass).items():
            if isinstance(value, Contract):
                found[attr] = value
    for contract in found.values():
        known = shared.states if contract.kind == "invariant" else shared.events
        for name in contract.names:
            if name not in known:
                what = "a state" if contract.kind == "invariant" else "an event"
                meant = by_its_name(shared.declaration, name,
                                    "state" if contract.kind == "invariant" else "event")
                near = difflib.get_close_matches(name, known, n=1)
                if not meant and near:  # (a typo: @precondition("job.clasify"))
                    meant = f"; did you mean {near[0]!r}?"
                raise ValueError(f"{shared.name}: @{contract.kind}({name!r}) on "
                                 f"{contract.name}: {name!r} is not {what} of the chart "
                                 f"(one of {', '.join(known)}){meant}")
    return tuple(found.values())


def _data(model: Model) -> str:
    text = repr(model)
    return text if len(text) <= REPR_LIMIT else text[:REPR_LIMIT] + "..."


def _stand_in(model: Model, err: Exception) -> str:
    """What to do when a contract reading the model's data raised ``AttributeError`` on a
    ``GuardTable``, the model of generated paths (docs/framework.md step 3), which answers the
    chart's guards only: ``--chart-contracts`` on the whole session failed every path test
    with the bare ``AttributeError``."""
    paths = sys.modules.get("calexec.machines.paths")
    table = getattr(paths, "GuardTable", None) if paths is not None else None
    if not (isinstance(err, AttributeError) and table is not None and isinstance(model, table)):
        return ""
    return ("; the model is a GuardTable, which answers the chart's guards only (a generated "
            "path forces their outcomes): check contracts reading the model's data on runs of "
            "your own model (a subclass whose guards answer the path's outcomes, as "
            "examples/charts/test_traffic_light.py's ForcedJunction), or enable them around "
            "the other tests only (contracts_checked)")


class ContractChecker:
    """The checks of one chart's contracts, indexed by state and event; the ``checker`` a
    ``ChartRun`` calls (``before``/``after``) and ``ContractListener`` calls for a
    python-statemachine instance. Reports each violation to its monitors."""

    def __init__(self, chart: CompiledChart, contracts: Iterable[Contract]) -> None:
        from calexec.machines.chart_support import dotted_event

        self.chart = chart
        self.monitors: tuple[ContractMonitor, ...] = ()
        self.invariants: dict[str, tuple[Contract, ...]] = {}
        self.pre: dict[str, tuple[Contract, ...]] = {}
        self.post: dict[str, tuple[Contract, ...]] = {}
        for contract in contracts:
            index = {"invariant": self.invariants, "precondition": self.pre,
                     "postcondition": self.post}[contract.kind]
            for name in contract.names:
                # ``done_state_x`` names the transition taken on ``done.state.x``
                spelled = {name, name if contract.kind == "invariant" else dotted_event(name)}
                for key in spelled:
                    index[key] = index.get(key, ()) + (contract,)

    def _check(self, contracts: tuple[Contract, ...], model: Model, state: str,
               transition: Transition | None) -> None:
        for contract in contracts:
            try:
                held = bool(contract.check(model))
                data = _data(model)
            except Exception as err:  # noqa: BLE001 (a check that raises is a violation, named)
                held, data = False, (f"{_data(model)} (the check raised {err!r}"
                                     f"{_stand_in(model, err)})")
            if not held:
                violation = ContractViolation(self.chart.name, contract, state, transition, data)
                # every monitor records it before any raises it
                if [monitor for monitor in self.monitors if monitor.report(violation)]:
                    raise violation

    def before(self, model: Model, transition: Transition) -> None:
        """Preconditions of ``transition``'s event, before the state changes."""
        contracts = self.pre.get(transition.event)
        if contracts:
            self._check(contracts, model, transition.source, transition)

    def listener(self, configuration: Callable[[], Iterable[str]] | None = None
                 ) -> ContractListener:
        """The listener that checks this chart's contracts on a run resolving callbacks as a
        python-statemachine instance does (the general run, ``StatechartRun``, which gives
        its ``configuration``: the active state ids)."""
        return ContractListener(self, configuration)

    def after(self, model: Model, transition: Transition,
              active: Iterable[str] | None = None) -> None:
        """Postconditions of the event, then the invariants of every ``active`` state (the
        run's configuration after the change: the target, the states entered with it and
        their ancestors; default: the target alone, a flat run's whole configuration)."""
        post = self.post.get(transition.event)
        if post:
            self._check(post, model, transition.target, transition)
        for state in (transition.target,) if active is None else active:
            held = self.invariants.get(state)
            if held:
                self._check(held, model, state, transition)


class ContractListener(ToolListener):
    """python-statemachine listener checking a chart's contracts on a real instance of its
    class (``enable_contracts`` adds one to the class for every instance created while it is
    enabled; give one instance ``listeners=[ContractListener(checker)]`` to check only it).
    The invariants checked after a transition are those of every active state: read from
    ``configuration`` when given, else from the instance (``machine``)."""

    def __init__(self, checker: ContractChecker,
                 configuration: Callable[[], Iterable[str]] | None = None) -> None:
        super().__init__()
        self.checker = checker
        self.configuration = configuration
        #: False once the contracts it was added for are disabled: it then checks nothing
        self.listening = True

    def _declared(self, event: object, transition: DeclaredTransition) -> Transition | None:
        if not self.listening:
            return None
        # the initial pseudo-transition is not a declared one
        return self.checker.chart.record_of(transition, event)

    def before_transition(self, event: object, transition: DeclaredTransition, model: Model) -> None:
        taken = self._declared(event, transition)
        if taken is not None:
            self.checker.before(model, taken)

    def after_transition(self, event: object, transition: DeclaredTransition, model: Model,
                         machine: StateChart[object]) -> None:
        taken = self._declared(event, transition)
        if taken is not None:
            active = (self.configuration() if self.configuration is not None
                      else [state.id for state in machine.configuration])
            self.checker.after(model, taken, active)


class ContractMonitor:
    """Contracts of some charts, checked while enabled (``disable()`` stops it). Every
    violation is appended to ``violations``; raised too when ``raise_on_violation``."""

    def __init__(self, raise_on_violation: bool = True) -> None:
        self.raise_on_violation = raise_on_violation
        self.violations: list[ContractViolation] = []
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    def report(self, violation: ContractViolation) -> bool:
        """Record ``violation``; whether this monitor wants it raised."""
        with self._lock:
            self.violations.append(violation)
        return self.raise_on_violation

    def disable(self) -> None:
        """Stop checking (idempotent)."""
        while self._undo:
            self._undo.pop()()


_CHECKERS: dict[int, ContractChecker] = {}  # id(CompiledChart): one per shared chart
_SETUP = threading.Lock()


def enable_contracts(*charts: ChartLike, raise_on_violation: bool = True) -> ContractMonitor:
    """Check the declared contracts of ``charts`` on their compiled runs and on the
    python-statemachine instances of their classes created from now on, until the returned
    monitor's ``disable()``. Several monitors may be enabled at once (each hears every
    violation). ``ValueError`` for a contract naming an unknown state or event, and for a
    chart that declares no contract (nothing of it would be checked: as the pytest option
    ``--chart-contracts`` and the explorer's ``charts`` refuse it); no chart at all is a
    monitor that checks nothing."""
    from calexec.machines.compiled import compiled

    for chart in charts:
        if isinstance(chart, (list, tuple, set, frozenset)):
            raise TypeError(f"enable_contracts({chart!r:.60}): give the chart classes as "
                            f"arguments, not in a {type(chart).__name__}: "
                            f"enable_contracts(*charts)")
    # every chart checked before any is enabled: a refusal leaves nothing enabled
    declared = [(shared, declared_contracts(shared)) for shared in map(compiled, charts)]
    for shared, contracts in declared:
        if not contracts:  # (enable_contracts(Lamp) of a Lamp with none silently checked nothing)
            raise ValueError(f"enable_contracts({shared.name}): {shared.name} declares no "
                             f"contracts, so none would be checked (declare them in the class "
                             f"with @invariant, @precondition or @postcondition from "
                             f"calexec.machines.chart_contracts, or leave it out)")
    monitor = ContractMonitor(raise_on_violation)
    for shared, contracts in declared:
        with _SETUP:
            checker = _CHECKERS.get(id(shared))
            if checker is None:
                checker = _CHECKERS[id(shared)] = ContractChecker(shared, contracts)
            checker.monitors += (monitor,)
            if len(checker.monitors) == 1:
                _install(shared, checker)
        monitor._undo.append(functools.partial(_remove, shared, checker, monitor))
    return monitor


# python-statemachine 3 collects a class's ``listeners`` attribute at class creation into this
# list and adds each (non-callable) entry to every instance created later (coverage.track)
def _class_listeners(declaration: type[StateChart[object]]) -> list[object]:
    found: list[object] = declaration._class_listeners
    return found


def _install(shared: CompiledChart, checker: ContractChecker) -> None:
    shared.set_checker(checker)
    listener = ContractListener(checker)
    _class_listeners(shared.declaration).append(listener)
    # and the instances alive already: one the chart's module made as it was imported
    # (``KETTLE = Kettle(WATER)`` under the class), which ``--chart-contracts`` imports first
    for machine in alive(shared.declaration):
        listener.join(machine)
    _LISTENERS[id(checker)] = listener


_LISTENERS: dict[int, ContractListener] = {}  # id(ContractChecker) -> its class listener


def _remove(shared: CompiledChart, checker: ContractChecker, monitor: ContractMonitor) -> None:
    with _SETUP:
        checker.monitors = tuple(m for m in checker.monitors if m is not monitor)
        if not checker.monitors:
            shared.set_checker(None)
            listener = _LISTENERS.pop(id(checker))
            listener.listening = False
            # from the class, its subclasses declared meanwhile and every instance it joined
            listener.leave_class(shared.declaration)


@contextmanager
def contracts_checked(*charts: ChartLike,
                      raise_on_violation: bool = True) -> Iterator[ContractMonitor]:
    """``enable_contracts`` for the ``with`` block."""
    monitor = enable_contracts(*charts, raise_on_violation=raise_on_violation)
    try:
        yield monitor
    finally:
        monitor.disable()


def check_invariants(chart: ChartLike, state: str, model: Model) -> list[ContractViolation]:
    """The invariants of ``state`` that do not hold for ``model`` now (empty: all hold),
    whether or not contracts are enabled; ``ValueError`` for an unknown state."""
    from calexec.machines.compiled import compiled

    shared = compiled(chart)
    if state not in shared.states:
        raise ValueError(f"{shared.name}: state={state!r} is not one of {shared.states}"
                         f"{by_its_name(shared.declaration, state, 'state')}")
    checker = ContractChecker(shared, declared_contracts(shared))
    monitor = ContractMonitor(raise_on_violation=False)
    checker.monitors = (monitor,)
    checker._check(checker.invariants.get(state, ()), model, state, None)
    return monitor.violations
