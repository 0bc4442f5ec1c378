"""The hot-path form of the declared charts: transition tables derived at import time.

python-statemachine 3.2.2 costs ~185 us to build a machine and ~85 us per ``send()``; the
executor needs a few microseconds. So at import each class of ``calexec.machines.charts`` is
introspected (states, initial, finals, and every transition's event, source, target, ``cond``
and ``unless`` guard names) into a frozen ``CompiledChart``. Nothing here hand-writes a
transition: the declaration stays the single source of truth, and a hypothesis test checks
that ``ChartRun`` and the real ``StateMachine`` agree on random event/guard sequences.

Semantics copied from ``StateMachine``: for ``(state, event)`` the candidate transitions are
tried in declaration order; the first whose ``cond`` guards are all true and ``unless`` guards
all false is taken. No candidate at all -> ``IllegalTransition``; candidates whose guards all
fail -> ``GuardRejected``. Guards are zero-argument methods of the owner's model object,
called by name. Final states have no transitions, so any event there is illegal.

Those semantics are the *flat fast path*. Any other chart (compound, parallel or history states,
validators, guard expressions, actions, ``StateChart`` semantics: ``CompiledChart.general``
names which) is compiled all the same (its table lists every declared transition of every
state, nested ones included) and ``CompiledChart.run`` returns the general run,
``statechart_run.StatechartRun``, which follows python-statemachine's own semantics.

Thread model: a ``ChartRun`` has exactly one owner at a time (the executor serialises the
events of a job, a txn, a slot); it takes no lock. Concurrent ``send`` on one run is a bug.
``CompiledChart`` objects are immutable and shared freely, except two monitoring fields: the
``taken`` counters and the ``listeners`` whoever wants each taken transition attaches
(``attach``/``detach``; the test suite's transition-coverage recorder,
``machines/coverage.py``, is one). With none attached, ``send`` pays one empty-tuple test.
"""

from __future__ import annotations

import difflib
import inspect
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Mapping
from types import MappingProxyType, MemberDescriptorType
from typing import Any, Protocol

import attrs
from statemachine import State, StateChart
from statemachine.callbacks import CallbackGroup
from statemachine.graph import iterate_states_and_transitions
from statemachine.signature import SignatureAdapter
from statemachine.transition import Transition as DeclaredTransition

from calexec.machines.chart_support import (
    ChartTransitionError as ChartTransitionError,  # re-exported: where runs raise them
)
from calexec.machines.chart_support import (
    GuardRejected as GuardRejected,
)
from calexec.machines.chart_support import (
    IllegalTransition as IllegalTransition,
)
from calexec.machines.chart_support import (
    UnsupportedChart as UnsupportedChart,  # re-exported: compile_chart and run raise it
)
from calexec.machines.chart_support import (
    actions,
    async_only,
    describe_transition,
    dotted_event,
    hierarchical,
    no_states,
    not_a_chart,
    refuse_unsupported,
    semantics,
)
from calexec.machines.charts import DECLARED
from calexec.machines.guard_expr import callable_name, shown


@attrs.frozen
class Transition:
    """One declared transition for one event. ``id`` is its index in ``chart.transitions``;
    ``key`` is ``(chart name, id)``, unique across the charts (the coverage recorder's key)."""

    source: str
    event: str
    target: str
    conds: tuple[str, ...]
    unless: tuple[str, ...]
    id: int
    key: tuple[str, int]

    @property
    def guards(self) -> tuple[str, ...]:
        """The guards in the toolkit's one notation (``guard_expr.shown``), as diagrams draw
        them, paths write a step's outcomes and every tool names them: ``!name`` for an
        ``unless``, an expression's conditions that must all hold each on its own
        (``cond="a and not b"``: ``a``, ``!b``)."""
        return tuple(part for name in self.conds for part in shown(name)) + tuple(
            part for name in self.unless for part in shown(name, expected=False))


class TransitionChecker(Protocol):
    """What a ``ChartRun`` calls around a state change when its chart has a ``checker``
    (``chart_contracts``: pre/postconditions and invariants); either may raise."""

    def before(self, model: object, transition: Transition) -> None: ...

    def after(self, model: object, transition: Transition) -> None: ...

    def listener(self, configuration: Callable[[], Iterable[str]] | None = None) -> object:
        """A python-statemachine listener calling ``before``/``after`` around each declared
        transition (``before_transition``/``after_transition``): how the general run of a
        hierarchical chart, which resolves callbacks as an instance does, checks contracts
        (``configuration``: the run's active state ids, whose invariants ``after`` checks)."""
        ...


@attrs.frozen
class CompiledChart:
    """Immutable transition table of one declared chart."""

    name: str
    declaration: type[StateChart[Any]]
    states: tuple[str, ...]
    initial: str
    finals: frozenset[str]
    events: tuple[str, ...]
    transitions: tuple[Transition, ...]
    table: Mapping[tuple[str, str], tuple[Transition, ...]]
    guard_names: frozenset[str]
    # (id(declared statemachine Transition), event) -> Transition, for the coverage listener.
    by_declared: Mapping[tuple[int, str], Transition] = attrs.field(repr=False)
    #: times each transition (by id) was taken in this process, for live transition rates
    #: (/debug/statecharts), by every run but those whose owner counts apart (``ChartRun.
    #: tally``: the executor's golden jobs and armed jobs no client asked for). Plain ``+=``
    #: from several threads: monitoring only, it may undercount under contention; never used
    #: for a decision.
    taken: list[int] = attrs.field(repr=False, eq=False, factory=list)
    #: called with each ``Transition`` a run of this chart takes, after the state changed, on
    #: the thread that sent the event (so a listener must be quick and must not raise).
    #: Replaced whole by ``attach``/``detach``, never mutated, so a ``send`` on any thread sees
    #: the old tuple or the new one; ``attach``/``detach`` themselves are set-up calls, made by
    #: one thread at a time (the pytest plugin at configure, a test around its scenario).
    listeners: tuple[Callable[[Transition], None], ...] = attrs.field(
        default=(), repr=False, eq=False)
    #: why the flat fast path (``ChartRun``) does not apply, one entry per construct (compound,
    #: parallel or history states, validators, guard expressions, actions, StateChart
    #: semantics: ``chart_support``); empty for a flat chart. ``run`` then returns the general
    #: ``statechart_run.StatechartRun``.
    general: tuple[str, ...] = attrs.field(default=(), repr=False)
    #: the python-statemachine transition each record of ``transitions`` was derived from
    #: (same index): the general run's skeleton takes one by its record
    declared: tuple[DeclaredTransition, ...] = attrs.field(default=(), repr=False, eq=False)
    #: None (production), or what checks the chart's contracts around every transition a run
    #: takes (``chart_contracts.enable_contracts`` sets it; ``send`` then pays one more test)
    checker: TransitionChecker | None = attrs.field(default=None, repr=False, eq=False)
    #: model class -> the guards it answers with a coroutine function (``run`` refuses them):
    #: looked up once per class, since ``run`` is on the executor's per-job path
    async_guards: dict[type, tuple[str, ...]] = attrs.field(factory=dict, repr=False, eq=False)
    #: model class -> the guards it answers with a value rather than a method (a property, a
    #: class attribute: python-statemachine reads those, ``AttributeGuardRun`` does too),
    #: looked up once per class as ``async_guards`` is
    value_guards: dict[type, frozenset[str]] = attrs.field(factory=dict, repr=False, eq=False)
    #: the callbacks python-statemachine looks up on an instance's model by naming convention
    #: (``on_enter_<state>``, ``after_<event>``, ``before_transition``, ``prepare_event``,
    #: ``on_invoke_<state>``, ...): a flat chart whose model answers one takes the general run,
    #: which calls them (the flat fast path calls none)
    conventions: frozenset[str] = attrs.field(default=frozenset(), repr=False)
    #: model class -> the ``conventions`` it answers, looked up once per class as
    #: ``async_guards`` is
    model_actions: dict[type, tuple[str, ...]] = attrs.field(factory=dict, repr=False, eq=False)
    #: model class -> whether it keeps ``state`` in a slot (``_saved_state``), looked up once
    #: per class as ``async_guards`` is (calexec's ``Job`` is slotted: a look-up at each run
    #: made ``JOB.run`` some ten times slower)
    state_slots: dict[type, bool] = attrs.field(factory=dict, repr=False, eq=False)
    #: where a flat run starts when neither its model nor the caller names a state: the
    #: chart's ``start_configuration_values`` (python-statemachine 3) if it declares one,
    #: else ``initial`` (which diagrams and paths keep drawing as the declared initial state)
    start: str = ""
    #: the chart's own async callbacks (``chart_support.async_only``): drawn and enumerated,
    #: never run (``run`` and ``refuse_runs`` refuse the chart, naming them); empty mostly
    unrunnable: tuple[str, ...] = attrs.field(default=(), repr=False)
    #: True: ``run`` makes a flat run a ``ChartRun`` (``send(event)``, no event data: the
    #: executor's hot path) for calexec's own charts (``charts.DECLARED``); False: an ``EventDataRun``
    #: (``send(event, *args, **data)``, as an instance's) for any other chart
    keyword_free: bool = attrs.field(default=False, repr=False)
    #: whether an event without a dot can match a declared descriptor other than itself
    #: (``error.*``, ``error.``, ``*``): else ``matching`` answers such an event at once
    wildcards: bool = attrs.field(default=False, repr=False)

    def declared_states(self) -> dict[str, State]:
        """The chart's python-statemachine ``State`` of each state id (history states not
        included). Read states by id through this, never through the declaration's
        ``states_map``: python-statemachine keys that by value, which a state declared with
        ``value=`` (or from an Enum: ``States.from_enum``) makes differ from the id every tool,
        configuration and run names it by."""
        return {str(state.id): state for state in self.declaration.states_map.values()}

    def refuse_runs(self, tool: str = "the compiled form") -> None:
        """Raise ``UnsupportedChart`` when no compiled run of this chart can be made (its own
        async callbacks): what ``run``, ``StatechartRun`` and ``recording`` (compiled runs
        only) call first. Coverage (``track``), contracts, the live view and mutation take
        such a chart's python-statemachine instances (since stop 70), which its async engine
        runs: the refusal says so."""
        if self.unrunnable:
            raise UnsupportedChart(
                f"{self.name}: {tool} does not support yet: {'; '.join(self.unrunnable)} "
                f"(a compiled run of it is refused: test instances of {self.declaration.__name__}, "
                f"which python-statemachine's async engine runs (await machine.send(...)) and "
                f"coverage, contracts, the live view and mutation follow; diagrams and paths "
                f"take the chart)")

    def record_of(self, transition: DeclaredTransition, event: object) -> Transition | None:
        """The record of ``transition`` (a python-statemachine ``Transition`` of the
        declaration) taken on ``event``, as a listener of an instance is called
        (``after_transition(event, transition)``; ``event`` is None for an eventless one);
        None for the initial pseudo-transition, which is not declared. An event the
        transition took as a descriptor match (``door`` taking ``door.slam``) is its record
        of the first of its events that matches."""
        record = self.by_declared.get((id(transition), "" if event is None else str(event)))
        if record is None and event is not None and not getattr(transition, "initial", True):
            found = _selecting((r for r in self.transitions if self.declared[r.id] is transition),
                               self.declared, transition.source.id, str(event))
            record = found[0] if found else None
        return record

    def history_defaults(self, transition: DeclaredTransition,
                         recorded: Container[str]) -> tuple[Transition, ...]:
        """The records of the history defaults a python-statemachine instance took with
        ``transition``: the default (``h.to(c)``) of each history state it targets that had
        recorded nothing (``recorded``: the ids of the histories that have, after the
        transition; its own exits record before it enters, so one absent was empty)."""
        found = []
        for target in transition.targets:
            if getattr(target, "is_history", False) and target.id not in recorded:
                found += [record for default in target.transitions
                          if (record := self.by_declared.get((id(default), ""))) is not None]
        return tuple(found)

    def matching(self, state: str, event: object) -> tuple[Transition, ...] | None:
        """The records a flat run tries for ``event`` in ``state`` when the table has no slot
        for it: those whose declared transition matches it as an SCXML event descriptor, as
        python-statemachine selects (``door`` takes ``door.slam``; ``_selecting``); None when
        none does (or ``event`` is no string). Only a refused lookup pays for this."""
        if not isinstance(event, str) or not event or ("." not in event and not self.wildcards):
            return None  # (the table holds every slot such an event can select)
        return _selecting(self.transitions, self.declared, state, event) or None

    def set_checker(self, checker: TransitionChecker | None) -> None:
        """Install (or with None remove) the contract checker every run of this chart calls
        (``chart_contracts.enable_contracts``: a set-up call, like ``attach``)."""
        object.__setattr__(self, "checker", checker)

    def attach(self, listener: Callable[[Transition], None]) -> None:
        """Call ``listener(transition)`` for every transition a run of this chart takes."""
        # attrs.frozen: the one field replaced after construction
        object.__setattr__(self, "listeners", self.listeners + (listener,))

    def detach(self, listener: Callable[[Transition], None]) -> None:
        """Stop calling ``listener`` (attached once per ``attach``); ValueError if it is not
        attached."""
        rest = list(self.listeners)
        rest.remove(listener)
        object.__setattr__(self, "listeners", tuple(rest))

    def notify(self, transition: Transition) -> None:
        """Tell the listeners ``transition`` was taken elsewhere than by a ``ChartRun`` (a
        python-statemachine instance of the declaration: ``coverage.TransitionListener``)."""
        for listener in self.listeners:
            listener(transition)

    def run(self, model: object, state: str | None = None, *, state_field: str = "state",
            start_value: object = None) -> ChartRun:
        """A new run on ``model`` (the guard provider), in ``state`` or the initial state.

        For a chart the flat fast path does not cover (``general`` names why) this is a
        ``statechart_run.StatechartRun`` (``model`` is then python-statemachine's ``model=``;
        ``state`` must be None: it starts in the declared initial configuration), which has
        ``send``/``can``/``state``/``final`` as ``ChartRun`` has plus event data.

        ``state_field`` and ``start_value`` are an instance's (``Chart(model,
        state_field="status", start_value=20)``): the model attribute a saved state is read
        from (the run writes none), and the state's value a run starts in when the model holds
        none there (until stop 70 ``state`` alone was read: a model keeping its state in
        another column started in the initial state, or was refused on a ``state`` of its own
        that is no chart state)."""
        if self.unrunnable:
            self.refuse_runs()
        if state_field != "state" and (  # (the executor's per-job runs: one comparison)
                not isinstance(state_field, str) or not state_field.isidentifier()):
            raise ValueError(f"{self.name}: state_field={state_field!r}: expected the name of "
                             f"the model's attribute holding its state (python-statemachine's "
                             f"state_field, 'state' by default)")
        start = None if start_value is None else self.start_state(start_value)
        answered: tuple[str, ...] = ()
        own: dict[str, Any] = {}
        if not self.general:  # (the executor's per-job path: a lookup per model class)
            cls = type(model)
            known = self.model_actions.get(cls)
            answered = self._model_actions(cls) if known is None else known
            own = getattr(model, "__dict__", None) or own
            if own and not self.conventions.isdisjoint(own):  # set on the model itself
                answered = tuple(sorted({*answered, *(
                    name for name in own if name in self.conventions and callable(own[name]))}))
        if self.general or answered:
            if state is not None:
                raise ValueError(
                    f"{self.name}: state={state!r}: a hierarchical run starts in its declared "
                    f"initial configuration" if self.general else
                    f"{self.name}: state={state!r}: the model answers naming-convention "
                    f"callback(s) {', '.join(map(repr, answered))}, which only the general run "
                    f"calls, and it starts in the chart's initial state")
            saved = _saved_state(model, self.state_slots, state_field)
            if saved is not None:  # an instance would start there; this run would not
                raise UnsupportedChart(
                    f"{self.name}: the model already holds {state_field}={saved!r} (a python-"
                    f"statemachine instance restores it): a general run starts in the declared "
                    f"initial configuration; give it a model whose {state_field} is None"
                    f"{_other_field(state_field)}, or, to "
                    f"run both on one model (a stateful test comparing them), make the run "
                    f"before the python-statemachine instance: the run writes no state")
            from calexec.machines.statechart_run import StatechartRun  # imports this module

            return StatechartRun(  # type: ignore[return-value]
                self, model, state_field=state_field, start_value=start_value)
        coroutines = self.async_guards.get(cls)
        if coroutines is None:  # once per model class (a racing thread computes the same)
            coroutines = self.async_guards[cls] = tuple(
                name for name in sorted(self.guard_names)
                if inspect.iscoroutinefunction(getattr(cls, name, None)))
        values = self.value_guards.get(cls)
        if values is None:
            values = self.value_guards[cls] = frozenset(
                name for name in self.guard_names if _answers_by_value(cls, name))
        mine = [name for name in self.guard_names if name in own] if own else None
        if mine:  # a guard set on the instance itself (it hides the class's)
            extra = [name for name in mine if inspect.iscoroutinefunction(own[name])]
            if extra:
                coroutines = tuple(sorted({*coroutines, *extra}))
            values = values.difference(mine).union(
                name for name in mine if not callable(own[name]))
        if coroutines:  # the flat run calls a guard and takes its coroutine for True
            raise UnsupportedChart(
                f"{self.name}: the compiled form does not support yet: async guard(s) "
                f"{', '.join(map(repr, coroutines))} of the model (python-statemachine runs "
                f"such an instance on its async engine)")
        if state is None:
            # a model that already holds a state (persisted, or a run before this one) starts
            # there, as a python-statemachine instance restores it (the state's value: its id
            # unless declared with value=)
            saved = _saved_state(model, self.state_slots, state_field)
            if saved is None:
                state = start or self.start or self.initial
            else:
                state = self.state_of(saved)
                if state is None:
                    hint = "" if saved in self.states else _other_field(state_field)
                    raise ValueError(f"{self.name}: the model's {state_field}={saved!r} is the "
                                     f"value of none of the chart's states "
                                     f"{_values_text(self.declaration, self.states)}{hint}")
        elif state not in self.states:
            raise ValueError(f"{self.name}: state={state!r} is not one of {self.states}")
        if values:  # (a guard answered by an attribute: read, as an instance reads it)
            return AttributeGuardRun(self, state, model, values)
        return (ChartRun if self.keyword_free else EventDataRun)(self, state, model)

    def _model_actions(self, cls: type) -> tuple[str, ...]:
        """The naming-convention callbacks a model of ``cls`` answers (python-statemachine
        calls them on an instance's model), by name: a flat run of such a model is a general
        run. Kept per class (a racing thread computes the same)."""
        answered = self.model_actions[cls] = tuple(
            name for name in sorted(self.conventions) if callable(getattr(cls, name, None)))
        return answered

    def start_state(self, start_value: object) -> str:
        """The id of the state whose value is ``start_value`` (python-statemachine's argument
        of an instance: where it starts when its model holds no state); a ``ValueError``
        naming it and the chart's states' values when none has it."""
        state = self.state_of(start_value)
        if state is None:
            values = self.declared_states()
            hint = (f"; {start_value!r} is the id of state {start_value}: give its value, "
                    f"{values[start_value].value!r}" if isinstance(start_value, str)
                    and start_value in values else "")
            raise ValueError(f"{self.name}: start_value={start_value!r} is the value of none of "
                             f"the chart's states "
                             f"{_values_text(self.declaration, self.states)}{hint}")
        return state

    def state_of(self, saved: object) -> str | None:
        """The id of the state whose value a model's state field ``saved`` holds, as
        python-statemachine reads it: the ``value=`` a state was declared with, else its id;
        None: no state."""
        return _state_of(self.declaration, self.states, saved)

    def outgoing(self, state: str) -> tuple[Transition, ...]:
        """Declared transitions leaving ``state``, in declaration order."""
        return tuple(t for t in self.transitions if t.source == state)


def _state_of(declaration: type[StateChart[Any]], states: tuple[str, ...],
              saved: object) -> str | None:
    """``CompiledChart.state_of`` before the chart exists (``compiled`` reads the start)."""
    for declared in declaration.states_map.values():
        try:
            if declared.value == saved and declared.id in states:
                return str(declared.id)
        except (TypeError, ValueError):  # an == that raises (an array...): no state
            continue
    return None


def _values_text(declaration: type[StateChart[Any]], states: tuple[str, ...]) -> str:
    """The states a value was looked for in: their ids (``('off', 'on')``) when each state's
    value is its id, else each id with its value (``(off='OFF', on='ON', broken=99)``: a
    chart declared with ``value=`` or from an Enum, where the ids alone named the very
    word refused)."""
    values = {str(s.id): s.value for s in declaration.states_map.values() if s.id in states}
    if all(values.get(state) == state for state in states):
        return str(states)
    return f"({', '.join(f'{state}={values.get(state)!r}' for state in states)})"


def _start_state(name: str, declaration: type[StateChart[Any]], states: tuple[str, ...],
                 flat: bool) -> str:
    """The state a flat run of ``declaration`` starts in when its model holds none: its
    ``start_configuration_values`` (one value, a state's ``value=`` as an instance reads it);
    "" when it declares none or the chart takes the general run (which reads them itself).
    A value no state has, or several for a flat chart, is a ValueError naming them (an
    instance raises ``InvalidStateValue`` when it is made)."""
    values = list(getattr(declaration, "start_configuration_values", None) or [])
    if not values or not flat:
        return ""
    if len(values) > 1:
        raise ValueError(f"{name}: start_configuration_values={values!r}: a flat chart starts "
                         f"in one state")
    state = _state_of(declaration, states, values[0])
    if state is None:
        raise ValueError(f"{name}: start_configuration_values={values!r}: {values[0]!r} is the "
                         f"value of none of the chart's states "
                         f"{_values_text(declaration, states)}")
    return state


def _other_field(state_field: str) -> str:
    """The hint of a refused saved state read from ``state``: a model may keep the chart's
    state in another attribute, as an instance is told by ``state_field``."""
    return ("" if state_field != "state" else
            " (a model keeping the chart's state in another attribute, as Chart(model, "
            "state_field='status') reads it: run(model, state_field='status'))")


def _saved_state(model: object, slots: dict[type, bool], field: str = "state") -> object:
    """The state a model instance holds in its own ``state`` attribute (None: none): in its
    ``__dict__``, or in a slot (``@dataclass(slots=True)``, or a slotted base's beneath a
    ``__dict__``: until stop 65 a slotted model's saved state was not read, and the run started
    in the initial state where an instance restores it). Only the instance's own attributes:
    a class-level property (calexec's models read their run) is no saved state. ``slots``: the
    chart's ``state_slots``, where the slot is looked for once per model class. A ``field``
    other than ``state`` (python-statemachine's ``state_field``, given by the caller) is read
    as an instance reads it, ``getattr``: a property or an ORM column's descriptor too."""
    if field != "state":  # a model's own field (``state_field``): read as an instance reads
        return getattr(model, field, None)  # it, a property or a column descriptor too
    own = getattr(model, "__dict__", None)
    if own and "state" in own:
        return own["state"]
    cls = type(model)
    slotted = slots.get(cls)
    if slotted is None:  # (a racing thread computes the same)
        slotted = slots[cls] = isinstance(inspect.getattr_static(cls, "state", None),
                                          MemberDescriptorType)
    return getattr(model, "state", None) if slotted else None  # (an unset slot: none)


#: One entry of a run's trail (``keep_trail``): ``(event, source, target, None, t)`` for a
#: taken transition, ``(event, source, None, refusing guards, t)`` for a refused event.
TrailEntry = tuple[str, str, str | None, tuple[str, ...] | None, float]


class ChartRun:
    """A lightweight run of a ``CompiledChart``: ``state`` is the current state id.

    One owner at a time (see the module docstring); ``model`` answers the guards.

    ``trail``: None, or a bounded ``deque`` the run appends each taken transition to as
    ``(event, source, target, None, t)`` and each refused event to as ``(event, source, None,
    refusing guards, t)`` (``t`` from the clock given to ``keep_trail``, by default
    ``time.monotonic()``): the path of one job, for design review (``DeviceExecutor.job_trail``).
    """

    __slots__ = ("chart", "state", "model", "_table", "trail", "_now", "tally")

    def __init__(self, chart: CompiledChart, state: str, model: object) -> None:
        self.chart = chart
        self.state = state
        self.model = model
        self._table = chart.table
        self.trail: deque[TrailEntry] | None = None
        self._now: Callable[[], float] = time.monotonic
        #: where the run counts each transition it takes: the chart's ``taken`` (the live
        #: rates), or a list of the owner's (``DeviceExecutor``: a job nobody asked for yet,
        #: counted apart from the clients' until it is fired for one)
        self.tally: list[int] = chart.taken

    def keep_trail(self, trail: deque[TrailEntry], now: Callable[[], float]) -> None:
        """Append every taken and refused event to ``trail`` (a bounded deque), stamped with
        ``now()`` (the owner's clock: virtual time under the interleaving explorer)."""
        self.trail = trail
        self._now = now

    @property
    def final(self) -> bool:
        """Whether the run is in a final state (no event can be taken any more)."""
        return self.state in self.chart.finals

    def select(self, event: str) -> Transition:
        """The transition ``send(event)`` would take now (guards evaluated), without taking it.
        Raises ``IllegalTransition`` or ``GuardRejected``."""
        # One try around the whole success path: free in 3.11 when nothing raises (the same
        # instructions as without it), so the errors' context costs the hot path nothing.
        try:
            candidates = self._table.get((self.state, event))
            if candidates is None:  # (no slot: a declared descriptor may match, 'door.slam')
                candidates = self.chart.matching(self.state, event)
                if candidates is None:
                    raise IllegalTransition(self.chart.name, self.state, event,
                                            self.chart.events)
            model = self.model
            for transition in candidates:
                for name in transition.conds:
                    if not getattr(model, name)():
                        break
                else:
                    for name in transition.unless:
                        if getattr(model, name)():
                            break
                    else:
                        return transition
        except ChartTransitionError:
            raise
        except Exception as err:  # (a guard's own error too: it gains a note naming the guard)
            named = _select_error(self, event, locals().get("name"), err)
            if named is err:
                raise
            raise named from (None if isinstance(named, IllegalTransition) else err)
        guards = tuple(dict.fromkeys(g for t in candidates for g in t.guards))
        if self.trail is not None:
            self.trail.append((event, self.state, None, guards, self._now()))
        raise GuardRejected(self.chart.name, self.state, event, guards)

    def send(self, event: str) -> str:
        """Take ``event``; return the new state id. Raises ``IllegalTransition`` or
        ``GuardRejected`` (the state is then unchanged)."""
        transition = self.select(event)
        chart = self.chart
        checker = chart.checker
        if checker is not None:  # contracts enabled (tests, the explorer): preconditions
            checker.before(self.model, transition)
        if self.trail is not None:
            self.trail.append((event, self.state, transition.target, None, self._now()))
        self.state = transition.target
        self.tally[transition.id] += 1
        listeners = chart.listeners
        if listeners:
            for listener in listeners:
                listener(transition)
        if checker is not None:  # postconditions, the target's invariants
            checker.after(self.model, transition)
        return transition.target

    def can(self, event: str) -> bool:
        """Whether ``send(event)`` would succeed now (guards are evaluated)."""
        try:
            self.select(event)
        except ChartTransitionError:
            return False
        return True

    def __repr__(self) -> str:
        return f"ChartRun({self.chart.name}, state={self.state!r})"


#: what python-statemachine gives every callback on top of ``send``'s data (``EventData.
#: extended_kwargs``): a flat run has none of them to give
_INJECTED = frozenset({"event_data", "machine", "event", "model", "transition", "state",
                       "source", "target"})


class EventDataRun(ChartRun):
    """The flat run of any chart but calexec's own (``CompiledChart.keyword_free`` False): ``send`` and
    ``can`` take event data as a python-statemachine instance's do. With none, ``send(event)``
    is ``ChartRun.send``; with some (``send("pay", 20, amount=5)``), each guard is called as
    python-statemachine calls it, with the positional arguments and the keywords its signature
    names (``def big(self, amount=0)`` gets ``amount=5``; one that names none gets none). A
    guard naming what only an instance injects (``event``, ``source``, ``target``, ``state``,
    ``transition``, ``model``, ``machine``, ``event_data``) or taking ``**kwargs`` is a
    ``TypeError`` naming the chart, the event, the state and the guard: the general run
    (``StatechartRun(compiled(Chart), model)``) passes those."""

    __slots__ = ()

    def send(self, event: str, *args: object, **data: object) -> str:
        """Take ``event`` with its data; return the new state id. Raises ``IllegalTransition``
        or ``GuardRejected`` (the state is then unchanged)."""
        if not args and not data:
            return ChartRun.send(self, event)
        return self._take(event, self._select_with(event, args, data))

    def can(self, event: str, *args: object, **data: object) -> bool:
        """Whether ``send(event, *args, **data)`` would succeed now (guards are evaluated)."""
        try:
            self._select_with(event, args, data)
        except ChartTransitionError:
            return False
        return True

    def _take(self, event: str, transition: Transition) -> str:
        """What ``ChartRun.send`` does once ``select`` chose ``transition`` (inlined there)."""
        chart = self.chart
        checker = chart.checker
        if checker is not None:
            checker.before(self.model, transition)
        if self.trail is not None:
            self.trail.append((event, self.state, transition.target, None, self._now()))
        self.state = transition.target
        self.tally[transition.id] += 1
        for listener in chart.listeners:
            listener(transition)
        if checker is not None:
            checker.after(self.model, transition)
        return transition.target

    def _select_with(self, event: str, args: tuple[object, ...],
                     data: dict[str, object]) -> Transition:
        """``select`` calling each guard with the data its signature names."""
        try:
            candidates = self._table.get((self.state, event))
        except TypeError:  # an unhashable event (a list)
            candidates = None
        if candidates is None:
            candidates = self.chart.matching(self.state, event)  # ('door' takes 'door.slam')
        if candidates is None:
            return self.select(event)  # the same refusal (or the same error) as without data
        for transition in candidates:
            if (all(self._guard(event, name, args, data) for name in transition.conds)
                    and not any(self._guard(event, name, args, data)
                                for name in transition.unless)):
                return transition
        guards = tuple(dict.fromkeys(g for t in candidates for g in t.guards))
        if self.trail is not None:
            self.trail.append((event, self.state, None, guards, self._now()))
        raise GuardRejected(self.chart.name, self.state, event, guards)

    def _guard(self, event: str, name: str, args: tuple[object, ...],
               data: dict[str, object]) -> bool:
        where = (f"{self.chart.name}: event {event!r} with data "
                 f"({_data_text(args, data)}) in state {self.state!r}: guard {name!r}")
        guard = getattr(self.model, name, None)
        if not callable(guard):
            if guard is None:
                raise AttributeError(f"{where}: the model, {type(self.model).__name__}, has no "
                                     f"attribute {name!r}{_missing_guard(self.model, name)}")
            raise TypeError(f"{where}: model.{name} is {type(guard).__name__} {guard!r}, not "
                            f"a method")
        try:
            parameters = inspect.signature(guard).parameters.values()
        except (TypeError, ValueError):  # no signature (a builtin): called with none
            return bool(guard())
        injected = sorted(p.name for p in parameters if p.name in _INJECTED
                          or p.kind is inspect.Parameter.VAR_KEYWORD)
        if injected:
            raise TypeError(
                f"{where}: {type(self.model).__name__}.{name} takes {', '.join(injected)}, "
                f"which python-statemachine gives it and the flat run cannot; run "
                f"StatechartRun(compiled({self.chart.name}), model), which passes them")
        bound = SignatureAdapter.from_callable(guard).bind_expected(*args, **data)
        try:
            return bool(guard(*bound.args, **bound.kwargs))
        except Exception as err:
            err.add_note(f"(raised evaluating {where})")
            raise


class AttributeGuardRun(EventDataRun):
    """The flat run of a model that answers some guards with a value rather than a method: a
    property (``@property def paid(self)``) or a plain attribute (``self.paid = True``) named
    by ``cond="paid"``. python-statemachine reads such a guard (its ``attr_method``) where it
    calls a method; this run does the same for the names in ``values`` and calls the others
    as ``EventDataRun`` does. ``CompiledChart.run`` makes one only for such a model, so the
    runs of models whose guards are all methods keep the fast path."""

    __slots__ = ("values",)

    def __init__(self, chart: CompiledChart, state: str, model: object,
                 values: frozenset[str]) -> None:
        super().__init__(chart, state, model)
        self.values = values

    def select(self, event: str) -> Transition:
        """``ChartRun.select``, each guard in ``values`` read instead of called."""
        try:
            candidates = self._table.get((self.state, event))
        except TypeError:  # an unhashable event (a list)
            candidates = None
        if candidates is None and self.chart.matching(self.state, event) is None:
            return ChartRun.select(self, event)  # the same refusal as a flat run's
        return self._select_with(event, (), {})

    def _guard(self, event: str, name: str, args: tuple[object, ...],
               data: dict[str, object]) -> bool:
        if name in self.values:
            try:
                return bool(getattr(self.model, name))
            except Exception as err:
                err.add_note(f"(raised reading {self.chart.name}: event {event!r} in state "
                             f"{self.state!r}: guard {name!r}, model.{name})")
                raise
        return super()._guard(event, name, args, data)

    def __repr__(self) -> str:
        return f"AttributeGuardRun({self.chart.name}, state={self.state!r})"


def _answers_by_value(cls: type, name: str) -> bool:
    """Whether instances of the model class ``cls`` answer guard ``name`` with a value, as
    python-statemachine sees it (not callable): a property, or a class attribute that is not
    callable (a method, a function, a staticmethod, a callable object are called)."""
    missing = object()
    found = inspect.getattr_static(cls, name, missing)
    if found is missing:
        return False
    if isinstance(found, property):
        return True
    if isinstance(found, (staticmethod, classmethod)) or inspect.isfunction(found):
        return False
    if hasattr(type(found), "__get__") and not callable(found):
        return True  # another descriptor (functools.cached_property, ...): read
    return not callable(found)


def _missing_guard(model: object, name: str) -> str:
    """What to do about guard ``name`` that ``model`` does not answer: the name it has that
    ``name`` resembles (a typo, ``has_cerdit`` for ``has_credit``), and either fix."""
    close = difflib.get_close_matches(
        name, [n for n in dir(model) if not n.startswith("__")], n=1)
    meant = f"; did you mean {close[0]!r}?" if close else ""
    return (f"{meant} (a python-statemachine instance refuses this model as it is made, "
            f"InvalidDefinition: give {type(model).__name__} a method {name}, or correct the "
            f"guard's name in the chart)")


def _data_text(args: tuple[object, ...], data: dict[str, object]) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in data.items()]
    return ", ".join(shown)[:120]


def _select_error(run: ChartRun, event: str, name: str | None, err: Exception) -> Exception:
    """What ``run.select(event)`` raises for ``err``: an unhashable event (a list: the table
    lookup's ``TypeError``) is an ``IllegalTransition`` naming it; ``err`` raised as guard
    ``name`` was evaluated gains the chart, the event, the state and the guard: a guard the
    model does not have, or one that cannot be called with no argument (the flat run passes
    no event data) is a new error of the same type saying so; any other error the guard raised
    itself is ``err`` with that as a note."""
    try:
        hash(event)
    except TypeError:
        return IllegalTransition(run.chart.name, run.state, event, run.chart.events)
    if name is None:  # (not from a guard: an event whose __eq__ raised)
        return err
    chart, model = run.chart.name, run.model
    where = f"{chart}: event {event!r} in state {run.state!r}: guard {name!r}"
    guard = getattr(model, name, None)
    if guard is None and isinstance(err, AttributeError):
        return AttributeError(f"{where}: the model, {type(model).__name__}, has no attribute "
                              f"{name!r} (the flat run calls model.{name}() with no argument)"
                              f"{_missing_guard(model, name)}")
    if isinstance(err, TypeError) and callable(guard):
        try:
            inspect.signature(guard).bind()
        except TypeError as unbound:
            return TypeError(
                f"{where}: {type(model).__name__}.{name} cannot be called with no argument "
                f"({unbound}); the flat run passes no event data: give the parameter a default, "
                f"or run StatechartRun(compiled({chart}), model), which passes send's keywords")
        except ValueError:  # no signature (a builtin): the guard's own error, below
            pass
    if isinstance(err, TypeError) and guard is not None and not callable(guard):
        return TypeError(f"{where}: model.{name} is {type(guard).__name__} {guard!r}, not a "
                         f"method (the flat run calls model.{name}())")
    err.add_note(f"(raised evaluating {where})")
    return err


def _guard_names(transition: Any, expected: bool, named_only: bool = True) -> tuple[str, ...]:
    """The guards of ``transition`` (``cond`` when ``expected``, else ``unless``) as text: a
    method name, an expression, or a callable's name (only names when ``named_only``)."""
    names = []
    for spec in transition._specs:
        if spec.group != CallbackGroup.COND or spec.expected_value is not expected:
            continue
        if _constant(spec) is not None:
            continue
        if not named_only and not (isinstance(spec.func, str) and spec.func.isidentifier()):
            names.append(spec.func if isinstance(spec.func, str) else callable_name(spec.func))
            continue
        if not isinstance(spec.func, str) or not spec.func.isidentifier():
            raise ValueError(
                f"guard {_describe_guard(spec.func)} on transition {describe_transition(transition)}: "
                f"the compiled form supports named guards only (one method name per guard, no "
                f"expressions or callables)"
            )
        names.append(spec.func)
    return tuple(names)


def _describe_guard(func: Any) -> str:
    return repr(func) if isinstance(func, str) else f"{callable_name(func)!r} (a callable)"


def _constant(spec: Any) -> bool | None:
    """The fixed answer of a constant guard (``machines.mutants.constant_guard``, used by chart
    mutation testing), else ``None``."""
    value = getattr(spec.func, "calexec_constant", None)
    return value if isinstance(value, bool) else None


def _blocked(transition: Any) -> bool:
    """Whether a constant guard of ``transition`` always refuses it."""
    return any(
        spec.group == CallbackGroup.COND and _constant(spec) is not None
        and _constant(spec) is not spec.expected_value
        for spec in transition._specs
    )


def _selecting(transitions: Iterable[Transition], declared: tuple[Any, ...], source: str,
               event: str) -> tuple[Transition, ...]:
    """The records of ``source`` python-statemachine tries for ``event``, in its order: those
    whose declared transition matches ``event`` as an SCXML event descriptor
    (``Transition.match``: ``door`` takes ``door.slam`` too, ``error.*`` takes ``error`` and
    ``error.execution``), in declaration order, one per declared transition (the record of
    ``event`` itself when it has one, else its first matching one)."""
    found: dict[int, Transition] = {}
    for record in transitions:
        if record.source != source or not record.event:
            continue
        origin = declared[record.id]
        known = found.get(id(origin))
        if known is not None:
            if record.event == event and known.event != event:
                found[id(origin)] = record
            continue
        if origin.match(event):
            found[id(origin)] = record
    return tuple(found.values())


#: what every toolkit function takes as a chart: the declared class, or its compiled form
ChartLike = type[StateChart[Any]] | CompiledChart

#: the attribute of a chart class holding its one ``CompiledChart`` (set by ``compiled``, read
#: from the class's own ``__dict__``: a subclass has its own). On the class, not in a module
#: dict: a dict keyed by the class kept every class ever compiled (and its table) for the
#: process's life, and a weak-keyed one would too, since the compiled chart refers to its
#: class. On the class, the two live and go together (a cycle the collector frees).
_COMPILED = "_calexec_compiled"
#: ``compiled`` makes one compiled chart per class when threads ask at once
_COMPILING = threading.RLock()


def compiled(declaration: ChartLike, name: str | None = None) -> CompiledChart:
    """The one ``CompiledChart`` of the chart class ``declaration`` in this process, compiled on
    first use (a ``CompiledChart`` is returned as is). Every tool (diagrams, coverage, paths)
    and every ``ChartRun`` of a class share it, so a listener attached to it hears every run.
    ``name`` (default: the class name) names it in reports and coverage keys; it is fixed by
    the first call, and a later call naming it otherwise raises ``ValueError``.
    """
    if isinstance(declaration, CompiledChart):
        return declaration
    if not (isinstance(declaration, type) and issubclass(declaration, StateChart)):
        raise not_a_chart(declaration)
    _check_name(name)
    chart = vars(declaration).get(_COMPILED)
    if not isinstance(chart, CompiledChart):
        with _COMPILING:
            chart = vars(declaration).get(_COMPILED)
            if not isinstance(chart, CompiledChart):
                chart = compile_chart(declaration, name)
                setattr(declaration, _COMPILED, chart)
    if name is not None and chart.name != name:
        raise ValueError(f"{declaration.__name__} is already compiled as {chart.name!r}, "
                         f"not {name!r}")
    return chart


def _check_name(name: object) -> None:
    """``name=`` of ``compiled``/``compile_chart``: None or a non-blank str (it keys coverage
    and names the chart in every report), else a ``TypeError``/``ValueError`` naming it."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name={name!r}: expected a str (the chart's name in reports and "
                        f"coverage) or None (the class name)")
    if name is not None and not name.strip():
        raise ValueError(f"name={name!r}: expected a non-blank str, or None (the class name)")


def compile_chart(declaration: type[StateChart[Any]], name: str | None = None) -> CompiledChart:
    """Derive a new ``CompiledChart`` of the chart class ``declaration`` (``compiled`` returns
    the shared one; this one has listeners of its own). ``name`` defaults to the class name.

    A constant guard (only chart mutation testing declares one) is folded: one that always
    passes is left out of the transition's guards; one that always refuses leaves the
    transition out of the table while its ``(state, event)`` slot stays, so the event is
    ``GuardRejected`` as ``StateMachine`` refuses it.
    """
    if not (isinstance(declaration, type) and issubclass(declaration, StateChart)):
        raise not_a_chart(declaration, compiled_form=False)
    _check_name(name)
    if name is None:
        name = declaration.__name__
    if not declaration.states:  # an abstract base: python-statemachine checks it no further
        raise ValueError(f"{name}: declaration "
                         f"{no_states(declaration, lambda subclass: subclass.__name__)}")
    refuse_unsupported(declaration, "the compiled form", runs=False)  # async: at run
    if declaration.initial_state is None:
        raise ValueError(f"{name}: declaration {declaration.__name__} has no initial state")
    general = tuple(hierarchical(declaration) + actions(declaration)
                    + list(filter(None, [semantics(declaration)])))
    every_state = list(declaration.states_map.values())
    states = tuple(state.id for state in every_state)
    transitions: list[Transition] = []
    by_declared: dict[tuple[int, str], Transition] = {}
    table: dict[tuple[str, str], tuple[Transition, ...]] = {}
    sources: list[Any] = []
    for state in every_state:
        for declared in state.transitions:
            if declared.initial:
                continue
            if _blocked(declared):  # never taken, but the event is refused, not illegal
                for event in declared.events:
                    table.setdefault((state.id, str(event)), ())
                continue
            conds = _guard_names(declared, True, named_only=not general)
            unless = _guard_names(declared, False, named_only=not general)
            events = [str(e) for e in declared.events]
            # ``done_state_x`` also declares ``done.state.x`` (psm registers both): one record,
            # the dotted event psm raises, reached by either name
            aliases = {e: dotted_event(e) for e in events
                       if dotted_event(e) != e and dotted_event(e) in events}
            for event in [e for e in events if e not in aliases] or [""]:  # "": eventless
                index = len(transitions)
                transition = Transition(
                    source=state.id,
                    event=str(event),
                    target=declared.target.id if declared.target is not None else state.id,
                    conds=conds,
                    unless=unless,
                    id=index,
                    key=(name, index),
                )
                transitions.append(transition)
                by_declared[(id(declared), str(event))] = transition
                sources.append(declared)
            for alias, dotted in aliases.items():
                by_declared[(id(declared), alias)] = by_declared[(id(declared), dotted)]
    # a history state's default (``h.to(c)``: where entering ``box.h`` lands while the
    # history has recorded nothing) is a declared transition too, eventless from the history
    # pseudo-state (not among ``states``): coverage counts it when a run enters an empty
    # history, mutation mutates it (python-statemachine keeps it on the history state only)
    for history in (h for state in every_state for h in getattr(state, "history", ()) or ()):
        for declared in history.transitions:
            if declared.target is None:
                continue
            index = len(transitions)
            # no guards: python-statemachine enters a default whatever its ``cond`` says
            transition = Transition(source=history.id, event="", target=declared.target.id,
                                    conds=(), unless=(), id=index, key=(name, index))
            transitions.append(transition)
            by_declared[(id(declared), "")] = transition
            sources.append(declared)
    for transition in transitions:
        slot = (transition.source, transition.event)
        table[slot] = table.get(slot, ()) + (transition,)
    # python-statemachine tries every transition whose descriptor matches the sent event, in
    # declaration order: ('b', 'door.slam') tries 'door' first when it leaves 'b' before
    leaving: dict[str, list[Transition]] = {}
    for transition in transitions:
        leaving.setdefault(transition.source, []).append(transition)
    origins = tuple(sources)
    for (source, event), exact in list(table.items()):
        selecting = _selecting(leaving.get(source, ()), origins, source, event) if event else ()
        if selecting and selecting != exact:
            table[(source, event)] = selecting
    return CompiledChart(
        name=name,
        declaration=declaration,
        states=states,
        initial=declaration.initial_state.id,
        finals=frozenset(state.id for state in every_state if state.final),
        # (an Event of several ids, ``Event(t, id="freeze lock")``, is each of them, as
        # python-statemachine's transitions take them: until stop 75 "freeze lock" was one)
        events=tuple(dict.fromkeys(name for event in declaration._events
                                   for name in str(event).split(" ") if name)),
        transitions=tuple(transitions),
        table=MappingProxyType(table),
        guard_names=frozenset(g for t in transitions for g in t.conds + t.unless
                              if g.isidentifier()),
        by_declared=MappingProxyType(by_declared),
        taken=[0] * len(transitions),
        general=general,
        declared=tuple(sources),
        start=_start_state(name, declaration, states, not general),
        unrunnable=tuple(async_only(declaration)),
        conventions=frozenset(
            spec.func for spec in [*declaration._specs, *(
                spec for visited in iterate_states_and_transitions(declaration.states)
                for spec in visited._specs)]
            if spec.is_convention and isinstance(spec.func, str)),
        # calexec's own charts: the executor sends them events without data, and a **data
        # parameter costs every send ~40 ns (8 %); any other chart's flat run takes data
        keyword_free=declaration in DECLARED.values(),
        wildcards=any(t.event == "*" or t.event.endswith(".") or t.event.endswith(".*")
                      for t in transitions),
    )


#: chart name -> CompiledChart, same order as ``charts.DECLARED``.
CHARTS: Mapping[str, CompiledChart] = MappingProxyType(
    {name: compiled(declaration, name) for name, declaration in DECLARED.items()}
)
JOB = CHARTS["job"]
KV_TXN = CHARTS["kv_txn"]
LIFECYCLE = CHARTS["lifecycle"]
BUFFER_SLOT = CHARTS["buffer_slot"]


#: chart name -> the prefix of its generated names (machines/chart_names.py)
NAME_PREFIX = {"job": "JOB", "kv_txn": "KV", "lifecycle": "LIFECYCLE", "buffer_slot": "SLOT"}


def _upper_snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper()


def name_constants() -> dict[str, str]:
    """Constant name -> state or event id of every declared chart: ``JOB_SUBMITTED`` ->
    ``"Submitted"`` (a state), ``JOB_EV_DELIVER`` -> ``"deliver"`` (an event)."""
    names: dict[str, str] = {}
    for chart_name, chart in CHARTS.items():
        prefix = NAME_PREFIX[chart_name]
        pairs = [(f"{prefix}_{_upper_snake(s)}", s) for s in chart.states]
        pairs += [(f"{prefix}_EV_{e.upper()}", e) for e in chart.events]
        for constant, value in pairs:
            if constant in names:  # two names of one chart spelt alike: say so, never shadow
                raise ValueError(f"chart {chart_name}: {value!r} and {names[constant]!r} both "
                                 f"name the constant {constant}")
            names[constant] = value
    return names


def names_source() -> str:
    """The text of machines/chart_names.py (``calexec charts names`` writes it; a test fails
    when the committed file differs)."""
    lines = ['"""State and event names of the declared charts (machines/charts.py), one constant',
             "each. GENERATED by ``calexec charts names`` from the declarations: do not edit.",
             "",
             "Code names a state or event by importing its constant, so a misspelt name fails at",
             "import (``from calexec.machines.chart_names import JOB_SUBMITED`` raises",
             "ImportError), and a chart whose declaration lost a name fails here at import.",
             '"""', "", "from calexec.machines.compiled import name_constants as _declared"]
    name_constants()  # raises when two names of a chart would share a constant
    for chart_name, chart in CHARTS.items():
        prefix = NAME_PREFIX[chart_name]
        lines += ["", f"# ---- {chart_name}: states"]
        lines += [f'{prefix}_{_upper_snake(s)} = "{s}"' for s in chart.states]
        lines += [f"# ---- {chart_name}: events"]
        lines += [f'{prefix}_EV_{e.upper()} = "{e}"' for e in chart.events]
    lines += ["", "",
              "_names = _declared()",
              "_stale = sorted(k for k, v in globals().items() if k.isupper() and _names.get(k) != v)",
              "if _stale:",
              "    raise ImportError(f\"machines/chart_names.py is stale (`calexec charts names`): \"",
              "                      f\"{_stale} no longer match the declared charts\")",
              ""]
    return "\n".join(lines)
