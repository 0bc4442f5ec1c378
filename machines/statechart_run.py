"""The general compiled run: any python-statemachine chart, hierarchical or not (issue 26).

``compiled.CompiledChart.run`` returns a ``StatechartRun`` for every chart its flat fast path
(``compiled.ChartRun``: atomic states, named guards, no actions, ``StateMachine`` semantics)
does not cover: compound, parallel and history (shallow and deep) states, final states and
their ``done.state.<id>`` events, transitions declared on ancestors, eventless transitions,
guards of any form (``cond``/``unless`` names, boolean expressions such as ``"a and not b"``,
callables), ``validators``, actions (state enter/exit, transition before/on/after, declared or
by naming convention such as ``on_enter_<state>``/``on_<event>``, generic ``on_enter_state``,
``prepare_event``) and event data.

Semantics are python-statemachine 3.2.2's own (``statemachine/engines/base.py`` and
``sync.py``, SCXML's algorithm), ported step for step: the same selection (atomic states in
configuration order, the first transition of the state or an ancestor whose validators pass
and whose guards hold, conflicting transitions filtered by exit sets), the same exit set
(reverse document order, history recorded on exit), the same entry set (initial children,
every region of a parallel state, history restored or its default), the same callback order
(``before``, exits, ``on``, enters, ``after``), the same macrostep (internal events and
eventless transitions to quiescence) and the same flags read from the chart class:
``allow_event_without_transition`` (``StateChart``: a refused event is ignored; a
``StateMachine`` raises), ``catch_errors_as_events`` (callback errors become the internal
``error.execution`` event), ``enable_self_transition_entries`` and
``atomic_configuration_update``. Callbacks are resolved and called by python-statemachine's
own dependency injection (``statemachine.dispatcher.Listeners`` into a ``CallbacksRegistry``),
so a callback receives the event's positional arguments and the keyword arguments it names,
``event``, ``source``, ``target``, ``state``, ``model``, ``machine``, ``transition``,
``event_data`` included, exactly as python-statemachine passes them.

What differs from a python-statemachine instance, on purpose:

- A refused event under ``StateMachine`` semantics raises calexec's ``IllegalTransition`` (no
  transition for the event in the active configuration) or ``GuardRejected`` (transitions
  exist but none is enabled), not ``TransitionNotAllowed``; both are ``ChartTransitionError``.
  The run's ``state`` in those errors is the active configuration, ``"a,b"``.
- ``machine`` (and ``self`` of the chart's methods) is a bare instance of the chart class whose
  configuration and engine are this run's: a callback may read and write its own attributes
  and ``self.model``, read ``configuration``/``configuration_values`` (so ``In('id')`` guards
  hold as on an instance), and ``send``/``raise_`` events or call one as a method: queued as
  python-statemachine queues them (``raise_``: within the macrostep; ``send``: after it). A
  delayed send from a callback is refused (``UnsupportedSend`` naming the chart, raised from
  ``send`` under either semantics), as is assigning
  the configuration. The model's state field is not written.
- Class-level ``listeners`` are attached as an instance attaches them (a class is made and
  its ``setup`` called, per run); pass more observer objects as ``listeners=`` (coverage
  listens to the compiled chart: ``CompiledChart.attach``).

Refused at compile time (``chart_support.unsupported``): ``invoke``, delayed events,
multi-target transitions (other than a compound state's initial) and async callbacks.

Chart listeners (``CompiledChart.attach``) have the flat run's shape: each is called with the
``compiled.Transition`` record of every transition taken, after the microstep that took it.
Thread model as ``ChartRun``: one owner at a time, no lock.
"""

from __future__ import annotations

import difflib
import re
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from statemachine import State, StateChart
from statemachine.callbacks import CallbacksRegistry
from statemachine.dispatcher import Listener, Listeners
from statemachine.event import BoundEvent, Event
from statemachine.event_data import EventData, TriggerData
from statemachine.exceptions import InvalidDefinition
from statemachine.graph import iterate_states_and_transitions
from statemachine.orderedset import OrderedSet
from statemachine.signature import SignatureAdapter
from statemachine.transition import Transition as DeclaredTransition

from calexec.machines.chart_support import (
    INVOKE_REMEDY,
    ChartTransitionError,
    GuardRejected,
    IllegalTransition,
    UnsupportedChart,
    class_listeners,
)
from calexec.machines.error_events import report_dropped, report_untaken
from calexec.machines.guard_expr import holds

if TYPE_CHECKING:  # compiled builds a StatechartRun (lazily), so no import back at run time
    from calexec.machines.compiled import CompiledChart, TrailEntry, Transition

_ERROR_EXECUTION = "error.execution"
_INITIAL = "__initial__"
#: no event of a processing loop enabled a transition yet (psm's ``_sentinel``)
_NOTHING = object()


class _Step:
    """One state entered or exited for one transition (psm's ``StateTransition``: equal and
    hashed by its state only)."""

    __slots__ = ("transition", "state")

    def __init__(self, transition: Any, state: Any) -> None:
        self.transition = transition
        self.state = state

    def __hash__(self) -> int:
        return hash(self.state)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Step) and self.state == other.state


class _RunView:
    """A part of a run that the run's ``machine`` (a callback's ``self``) holds: it refers to
    the run weakly, so that the machine does not keep the run alive."""

    __slots__ = ("_run",)

    def __init__(self, run: StatechartRun) -> None:
        self._run = weakref.ref(run)  # no cycle: a run goes when its owner lets it go

    @property
    def run(self) -> StatechartRun:
        run = self._run()
        if run is None:
            raise ReferenceError("the compiled run of this machine is gone")
        return run


class _ConfigurationView(_RunView):
    """The run's configuration where python-statemachine's ``StateChart`` keeps its own
    (``machine._config``): ``machine.configuration``, ``configuration_values``,
    ``current_state_value`` and ``In('id')`` guards read the run's active states."""

    __slots__ = ()

    @property
    def states(self) -> OrderedSet[State]:
        return OrderedSet(self.run._config)

    @states.setter
    def states(self, _: object) -> None:
        self._refuse()

    @property
    def values(self) -> OrderedSet[Any]:
        return OrderedSet(state.value for state in self.run._config)

    @property
    def value(self) -> Any:
        values = [state.value for state in self.run._config]
        if not values:
            return None
        return values[0] if len(values) == 1 else OrderedSet(values)

    @value.setter
    def value(self, _: object) -> None:
        self._refuse()

    @property
    def current_state(self) -> Any:
        states = self.states
        return next(iter(states)) if len(states) == 1 else states

    def _refuse(self) -> None:
        raise TypeError(f"{self.run.chart.name}: a callback of a compiled run may not assign "
                        f"its configuration (send an event)")


class UnsupportedSend(UnsupportedChart, InvalidDefinition):
    """A callback sent a delayed event, which no compiled run follows; an
    ``InvalidDefinition`` too, so ``StateChart`` semantics raise it from ``send`` rather than
    turn it into ``error.execution``."""


class UnsupportedInit(UnsupportedChart, InvalidDefinition):
    """A callback read an attribute of the chart's ``self`` that the chart's own ``__init__``
    sets (``self.total = 0``): a compiled run makes the chart without calling its
    ``__init__``, so the callback would fail where an instance's does not (under
    ``StateChart`` semantics silently: its ``AttributeError`` became ``error.execution`` and
    the run stayed where the instance moved on). An ``InvalidDefinition`` too, so it reaches
    the caller of ``send`` under either semantics."""


def _own_init(declaration: type) -> Any:
    """The ``__init__`` the chart class (or a base of the user's, not python-statemachine's)
    defines itself, or None."""
    for cls in declaration.__mro__:
        if cls.__module__.split(".")[0] == "statemachine" or cls is object:
            return None
        init = cls.__dict__.get("__init__")
        if init is not None:
            return init
    return None


def _init_skipped(run: StatechartRun, error: BaseException) -> UnsupportedInit | None:
    """``error`` as ``UnsupportedInit`` when it is a callback's read of an attribute of the
    run's ``machine`` that the chart's own ``__init__`` names; None otherwise (a chart's own
    mistake: it reaches the caller, or ``error.execution``, as on an instance)."""
    if not isinstance(error, AttributeError) or getattr(error, "obj", None) is not run.machine:
        return None
    name = getattr(error, "name", None)
    init = _own_init(run.declaration)
    code = getattr(init, "__code__", None)
    if not name or code is None or name not in code.co_names:
        return None
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    callback = f"callback {tb.tb_frame.f_code.co_name!r} " if tb is not None else "a callback "
    owner = init.__qualname__.rpartition(".")[0] or run.declaration.__name__
    where = f" ({code.co_filename.rpartition('/')[2]}:{code.co_firstlineno})"
    return UnsupportedInit(
        f"{run.chart.name}: {callback}read self.{name}, which {owner}.__init__{where} sets; "
        f"a compiled run makes the chart without calling its __init__, so self.{name} is not "
        f"there: keep such state on the model (self.model.{name}, the model given to "
        f"run(model)), or test an instance of {run.declaration.__name__}")


class _EngineView(_RunView):
    """What ``machine.send``, ``machine.raise_`` and ``machine.<event>()`` reach from a
    callback (python-statemachine's engine): the run's queues, as its engine queues them: an
    internal event joins the macrostep running, an external one waits for it to end."""

    __slots__ = ()

    @property
    def running(self) -> bool:
        return self.run.running

    def put(self, trigger: TriggerData, internal: bool = False) -> None:
        run = self.run
        delay = getattr(trigger.event, "delay", 0)
        if delay or trigger.send_id is not None:
            raise UnsupportedSend(f"{run.chart.name}: a callback's send("
                                  f"{str(trigger.event)!r}, {'delay' if delay else 'send_id'}"
                                  f"=...) is not supported by a compiled run (no delayed sends:"
                                  f" python-statemachine delivers it from a timer of its own, "
                                  f"which no run follows): send it without delay= and send_id= "
                                  f"from a timer of yours, or test an instance of "
                                  f"{run.chart.name}")
        if not run.running and not run.allow_event_without_transition:
            raise IllegalTransition(run.chart.name, run.state, str(trigger.event))
        (run._internal if internal and run._processing else run._external).append(trigger)

    def processing_loop(self) -> object:
        return self.run._processing_loop(None)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{self.run.chart.name}: a callback of a compiled run reached "
                             f"machine._engine.{name}, which the run does not offer")


def _made_class_listeners(declaration: type[StateChart[Any]], machine: Any,
                          kwargs: Mapping[str, object]) -> list[object]:
    """The chart's class-level listeners as python-statemachine's ``__init__`` makes them (a
    callable entry called, its ``setup(sm, ...)`` given the start's keyword arguments), but
    those of calexec's tools (``chart_support.class_listeners``)."""
    made: list[object] = []
    for entry in class_listeners(declaration):
        if not callable(entry):
            made.append(entry)
            continue
        instance = entry()
        setup = getattr(instance, "setup", None)
        if setup is not None:
            bound = SignatureAdapter.from_callable(setup).bind_expected(machine, **kwargs)
            try:
                setup(*bound.args, **bound.kwargs)
            except TypeError as err:
                raise TypeError(f"Error calling setup() on listener {type(instance).__name__}: "
                                f"{err}") from err
        made.append(instance)
    return made


def _data(kwargs: dict[str, object]) -> dict[str, Any]:
    """Event data as python-statemachine's untyped ``build_trigger`` takes it."""
    return kwargs


def _protected(declaration: type[StateChart[Any]]) -> set[str]:
    """The chart's attributes python-statemachine never resolves as callbacks (its
    ``_protected_attrs``, recomputed here from public names)."""
    return {"_abstract", "model", "state_field", "start_value", "initial_state", "final_states",
            "states", "_events", "states_map", "send"} | {s.id for s in declaration.states_map.values()}


def _not_compiled(chart: object) -> str:
    """What ``StatechartRun(chart, ...)`` says of a ``chart`` that is no ``CompiledChart``: the
    chart class itself (the usual slip) is named with the call to make."""
    if isinstance(chart, type) and issubclass(chart, StateChart):
        return (f"StatechartRun(chart={chart.__name__}): expected its CompiledChart, "
                f"StatechartRun(compiled({chart.__name__}), model) (or compiled({chart.__name__})"
                f".run(model))")
    if isinstance(chart, StateChart):
        name = type(chart).__name__
        return (f"StatechartRun(chart=<{name} instance>): expected the CompiledChart of its class, "
                f"StatechartRun(compiled({name}), model)")
    return (f"StatechartRun(chart={chart!r:.60}): expected a CompiledChart, "
            f"StatechartRun(compiled(Chart), model)")


class StatechartRun:
    """A run of any chart, following python-statemachine's semantics (module docstring).

    ``model`` is the domain model (python-statemachine's ``model=``; a fresh ``object`` holder
    when None); ``listeners`` are extra objects whose attributes serve as callbacks.
    ``configuration`` is the active state ids in python-statemachine's order.
    """

    def __init__(self, chart: CompiledChart, model: object | None = None,
                 listeners: Iterable[object] = (), callbacks: bool = True, *,
                 skeleton_outcomes: Mapping[str, bool] | None = None,
                 state_field: str = "state", start_value: object = None,
                 **start_kwargs: object) -> None:
        if not hasattr(chart, "refuse_runs"):  # (a CompiledChart: compiled imports this module)
            raise TypeError(_not_compiled(chart))
        if callbacks:  # (a skeleton calls none: its chart's async callbacks do not matter)
            chart.refuse_runs()
        self.chart = chart
        declaration = chart.declaration
        self.declaration = declaration
        machine = declaration.__new__(declaration)
        if model is None:
            from statemachine.model import Model
            model = Model()  # type: ignore[no-untyped-call]
        # the chart class forbids assigning state ids; these are not
        object.__setattr__(machine, "model", model)
        # (``state_field``/``start_value``: python-statemachine's arguments of an instance;
        # the run writes no state, but a model's field of that name is no callback, and the
        # run starts in ``start_value``'s state as an instance whose model holds none does)
        object.__setattr__(machine, "state_field", state_field)
        if start_value is not None:
            chart.start_state(start_value)  # (a value no state has: a ValueError naming it)
        self._start_values = [start_value] if start_value is not None else list(
            getattr(declaration, "start_configuration_values", []) or [])
        # what a callback reaches through ``machine`` (or ``self``) is this run: its
        # ``configuration`` (and ``In(...)`` guards), ``send``, ``raise_`` and event calls
        object.__setattr__(machine, "_config", _ConfigurationView(self))
        object.__setattr__(machine, "_engine", _EngineView(self))
        self.machine = machine
        self.model = model
        self.allow_event_without_transition = bool(declaration.allow_event_without_transition)
        self.catch_errors_as_events = bool(declaration.catch_errors_as_events)
        self.enable_self_transition_entries = bool(declaration.enable_self_transition_entries)
        self.atomic_configuration_update = bool(declaration.atomic_configuration_update)
        self.history_values: dict[str, list[State]] = {}
        # and what it recorded, as an instance's (a listener's ``machine.history_values``)
        object.__setattr__(machine, "history_values", self.history_values)
        self.running = True
        self._config: OrderedSet[State] = OrderedSet()
        self._internal: deque[TriggerData] = deque()
        #: external events sent by callbacks while a step runs, taken after its macrostep
        self._external: deque[TriggerData] = deque()
        self._processing = False
        self._cache: dict[tuple[int, int, int, int], tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self._taken: list[tuple[Any, str]] = []
        #: the default transitions of the empty history states the microstep enters
        self._history_defaults: list[Any] = []
        self._registry = CallbacksRegistry()
        #: bound on the microsteps of one macrostep of a skeleton (guards all pass there, so
        #: two eventless transitions could chase each other forever)
        self._max_microsteps = None if callbacks else 1000
        self._microsteps = 0
        #: a skeleton's guard outcomes while ``force`` selects (name -> outcome, a name not
        #: given holds, as ``paths.GuardTable`` answers); None: every guard passes
        self._outcomes: Mapping[str, bool] | None = None
        self._prepare_key = declaration.prepare.key
        self._root_parallel_pending: State | None = None
        #: ids of the states a skeleton entered in its last ``force`` (or its start)
        self.entered: list[str] = []
        #: the transitions a skeleton took as it started, in order (eventless ones and
        #: ``done.state`` ones of the initial macrostep; python-statemachine takes them with
        #: no event sent); () for a run with callbacks (its listeners heard them)
        self.taken_at_start: tuple[Transition, ...] = ()
        #: ``keep_trail``'s bounded deque of (event, source, target, None, time), or None
        self.trail: deque[TrailEntry] | None = None
        self._now: Callable[[], float] = time.monotonic
        if not callbacks:  # a skeleton (``skeleton``): the chart's structure only
            # its initial macrostep answers guards as a ``GuardTable`` given
            # ``skeleton_outcomes`` before the chart starts does (none: every guard holds,
            # so an ``unless`` refuses, as on a real run)
            self._outcomes = MappingProxyType(dict(skeleton_outcomes or {}))
            try:
                self._start(**start_kwargs)
            finally:
                self._outcomes = None
            self.taken_at_start = self._take_records()
            return
        if chart.checker is not None:  # contracts enabled: checked as on an instance
            listeners = (*listeners, chart.checker.listener(lambda: self.configuration))
        # the class-level ``listeners = [...]``, made and set up as an instance makes them
        owned = _made_class_listeners(declaration, machine, start_kwargs)
        resolvers = Listeners.from_listeners((
            Listener.from_obj(machine, skip_attrs=_protected(declaration)),
            Listener.from_obj(model, skip_attrs={state_field}),
            *(Listener.from_obj(listener) for listener in (*owned, *listeners)),
        ))
        resolvers.resolve(declaration._specs, registry=self._registry)
        for visited in iterate_states_and_transitions(declaration.states):
            resolvers.resolve(visited._specs, registry=self._registry)
        for visited in iterate_states_and_transitions(declaration.states):
            try:
                self._registry.check(visited._specs)
            except Exception as err:
                raise InvalidDefinition(
                    f"{chart.name}: error on {visited!s} when resolving callbacks: {err}"
                    f"{_unresolved_hint(model, err)}") from err
        coroutines = sorted({str(callback) for executor in self._registry._registry.values()
                             for callback in executor if callback._iscoro})
        if coroutines:  # the chart's own are refused by ``compile_chart``; these came later
            raise UnsupportedChart(
                f"{chart.name}: the compiled form does not support yet: async callback(s) "
                f"{', '.join(map(repr, coroutines))} of the model or a listener "
                f"(python-statemachine runs such an instance on its async engine; a compiled "
                f"run would take their coroutines for answers)")
        # an invoke the chart declares is refused by ``compile_chart``; one the model or a
        # listener answers by naming convention (``on_invoke_<state>``: an instance runs it as
        # the state is entered) came later, and no run would call it
        invokes = [f"invoke {str(callback)!r} of the model or a listener on state {visited.id!r}"
                   for visited in iterate_states_and_transitions(declaration.states)
                   if isinstance(visited, State) and visited.invoke.key in self._registry
                   for callback in self._registry[visited.invoke.key]]
        if invokes:
            raise UnsupportedChart(f"{chart.name}: the compiled form does not support yet: "
                                   f"{'; '.join(invokes)} ({INVOKE_REMEDY})")
        self._start(**start_kwargs)

    # ---- skeletons: the structure of the chart, for paths (machines/paths.py)

    @classmethod
    def skeleton(cls, chart: CompiledChart,
                 outcomes: Mapping[str, bool] | None = None) -> StatechartRun:
        """A run that calls no callback: every action does nothing, and a guard answers as a
        ``paths.GuardTable`` does (its outcome given to ``force``, else True; so an
        ``unless`` refuses); its start (the initial macrostep: eventless and ``done.state``
        transitions taken before any event) answers ``outcomes`` (a model's set before the
        chart starts). ``machines/paths.py`` explores the configurations of a chart with it
        (``node``, ``fork``, ``force``)."""
        return cls(chart, callbacks=False, skeleton_outcomes=outcomes)

    def node(self) -> tuple[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...], bool]:
        """What decides this run's future: the configuration, the recorded history and
        whether it still runs."""
        history = tuple(sorted((k, tuple(s.id for s in v)) for k, v in self.history_values.items()))
        return self.configuration, history, self.running

    def fork(self) -> StatechartRun:
        """A copy of this skeleton in the same configuration and history (only skeletons: a
        run with callbacks owns a model that is not copied)."""
        if self._max_microsteps is None:
            raise ValueError(f"{self.chart.name}: only a skeleton run is forked")
        twin = object.__new__(StatechartRun)
        twin.__dict__.update(self.__dict__)
        twin._config = OrderedSet(self._config)
        twin.history_values = dict(self.history_values)
        twin._internal = deque()
        twin._cache = {}
        twin._taken = []
        twin.entered = []
        twin.taken_at_start = ()
        return twin

    def candidates(self) -> list[Transition]:
        """The transitions a sent event could take now (their source is active), in
        configuration and declaration order."""
        found: list[Transition] = []
        if not self.running:
            return found
        for state in self._config:
            for declared in state.transitions:
                if declared.initial or declared.is_eventless:
                    continue
                for event in declared.events:
                    record = self.chart.by_declared.get((id(declared), str(event)))
                    if record is not None and record not in found:
                        found.append(record)
        return found

    def force(self, record: Transition,
              outcomes: Mapping[str, bool] | None = None) -> list[Transition] | None:
        """Take ``record`` (one of ``candidates``) as its event would, then the macrostep it
        starts; return every transition record taken. With ``outcomes`` (guard name ->
        outcome; a guard not named answers True, as a ``paths.GuardTable`` model does) the
        event takes every transition python-statemachine would select under them (one per
        region of a parallel state), or nothing and None when ``record`` is not among them;
        without, ``record`` alone. Under ``outcomes`` the eventless transitions they enable in
        the configuration are taken first, as python-statemachine takes them before a sent
        event (their records are returned too; ``record`` is then selected where they lead).
        ``entered`` is then the ids of the states entered on the way
        (some may have been left again within the macrostep: a final child whose
        ``done.state`` event leaves its parent). The macrostep the event starts selects its
        eventless and ``done.state`` transitions under the same ``outcomes`` (a real run's
        ``GuardTable`` answers them so until the next step sets others)."""
        declared = self.chart.declared[record.id]
        bound = BoundEvent(id=record.event, _sm=self.machine)
        trigger = bound.build_trigger(machine=self.machine)
        self._cache.clear()
        selected: list[Any] = [declared]
        self._outcomes = outcomes
        try:
            self.entered = []
            if outcomes is not None:
                # python-statemachine's loop runs the macrostep before it takes a sent event:
                # the eventless transitions these outcomes enable go first
                self._run_macrostep()
                self._check_root_final()
                self._cache.clear()
                if not self.running:
                    return None
                selected = list(self._select(trigger, eventless=False))
                if declared not in selected:
                    return None
            self._microstep(selected, trigger)
            self._run_macrostep()
        finally:
            self._outcomes = None
        self._check_root_final()
        return list(self._take_records())

    def settle(self, outcomes: Mapping[str, bool]) -> list[Transition]:
        """Run the macrostep python-statemachine runs before it takes a sent event, under
        ``outcomes`` (a skeleton's, as ``force``): the eventless transitions they enable;
        return the records taken (``entered``: the states entered on the way)."""
        self._cache.clear()
        self._outcomes = outcomes
        try:
            self.entered = []
            self._run_macrostep()
        finally:
            self._outcomes = None
        self._check_root_final()
        return list(self._take_records())

    def _take_records(self) -> tuple[Transition, ...]:
        """The transitions taken since the last call (a skeleton's), as the chart's records."""
        records = tuple(found for step, event in self._taken
                        if (found := self.chart.record_of(step, event)) is not None)
        self._taken = []
        return records

    # ---- public API

    @property
    def configuration(self) -> tuple[str, ...]:
        """The active state ids, in python-statemachine's configuration order."""
        return tuple(state.id for state in self._config)

    @property
    def state(self) -> str:
        """The active configuration as one string, ``"a,b"`` (the flat run's ``state``)."""
        return ",".join(self.configuration)

    @property
    def final(self) -> bool:
        """Whether the run has terminated (a top-level final state, or a top-level parallel
        state whose regions all rest in final states)."""
        return not self.running

    def send(self, event: str, *args: object, **kwargs: object) -> object:
        """Take ``event`` with its data (``send("pay", 5, amount=5)``) and run the macrostep it
        starts; return what python-statemachine's ``send`` returns (the ``on`` callbacks'
        result). A refused event: ``StateMachine`` semantics raise ``IllegalTransition`` or
        ``GuardRejected``; ``StateChart`` semantics ignore it and return None."""
        for unsupported in ("delay", "send_id", "internal"):
            if kwargs.get(unsupported) is not None:
                remedy = ("raise it from a callback with self.raise_" if unsupported == "internal"
                          else "send it without delay= and send_id=, from a timer of yours")
                raise ValueError(f"{self.chart.name}: send({event!r}, {unsupported}=...) is not "
                                 f"supported by a compiled run (no delayed or internal sends): "
                                 f"{remedy}")
        if not isinstance(event, str):  # (getattr below: "attribute name must be string")
            raise IllegalTransition(self.chart.name, self.state, event, self.chart.events)
        if not self.running:
            if not self.allow_event_without_transition:
                raise IllegalTransition(self.chart.name, self.state, event, self.chart.events)
            return None
        known = getattr(self.declaration, event, None)
        name = known.name if isinstance(known, Event) else event
        bound = BoundEvent(id=event, name=name, _sm=self.machine)
        trigger = bound.build_trigger(*args, machine=self.machine, **_data(kwargs))
        try:
            return self._processing_loop(trigger)
        except AttributeError as err:  # (a validator's or a StateMachine guard's: raised)
            skipped = _init_skipped(self, err)
            if skipped is not None:
                raise skipped from err
            raise

    def can(self, event: str, *args: object, **kwargs: object) -> bool:
        """Whether ``event`` would enable a transition now (validators and guards evaluated,
        so they must be free of side effects for this to be a pure question)."""
        bound = BoundEvent(id=event, _sm=self.machine)
        trigger = bound.build_trigger(*args, machine=self.machine, **_data(kwargs))
        self._cache.clear()
        queued = len(self._internal)
        try:
            return bool(self._select(trigger, eventless=False))
        except UnsupportedInit:
            raise
        except Exception as err:  # noqa: BLE001 - a raising validator or guard: refused
            skipped = _init_skipped(self, err)
            if skipped is not None:
                raise skipped from err
            return False
        finally:
            self._cache.clear()
            while len(self._internal) > queued:  # error.execution a guard raised: not sent
                self._internal.pop()

    def __repr__(self) -> str:
        return f"StatechartRun({self.chart.name}, configuration={list(self.configuration)})"

    # ---- the processing loop (sync.py)

    def _start(self, **kwargs: object) -> None:
        trigger = BoundEvent(_INITIAL, _sm=self.machine).build_trigger(machine=self.machine,
                                                                       **_data(kwargs))
        values = self._start_values
        states_map = self.declaration.states_map
        initial = self.declaration.initial_state
        configuration = [states_map[v] for v in values] if values else [initial]
        transitions = []
        for state in configuration:
            transition = DeclaredTransition(State(), state, event=_INITIAL)
            transition._specs.clear()  # type: ignore[no-untyped-call]
            transitions.append(transition)
        self._processing = True  # an event a callback sends while entering waits its turn
        try:
            self._enter_states(transitions, trigger, OrderedSet(), OrderedSet())
        finally:
            self._processing = False
        self._processing_loop(None)

    def _processing_loop(self, external: TriggerData | None) -> object:
        """Queue ``external`` and take the external queue one event at a time, each after the
        macrostep before it; within a step (a callback sent it) only queue it, as
        python-statemachine's loop does. The result is the first taken event's."""
        if external is not None:
            self._external.append(external)
        if self._processing:
            return None
        self._processing = True
        try:
            return self._loop()
        finally:
            self._processing = False

    def _loop(self) -> object:
        first_result: object = _NOTHING
        took_events = True
        while took_events and self.running:
            self._cache.clear()
            try:
                took_events = self._run_macrostep()
            except Exception:
                self._clear_queues()
                self._notify()  # what was taken before the error counts, as on the flat run
                raise
            self._notify()
            self._check_root_final()
            if not self.running:
                break
            if not self._external:
                continue
            self._cache.clear()
            try:
                result = self._take_external_event(self._external.popleft())
            except Exception:
                # a transition an ``after`` callback (a broken postcondition or invariant)
                # raised after was taken: counted and trailed now, as the flat run does
                self._notify()
                raise
            self._notify()
            if first_result is _NOTHING:
                first_result = result
            took_events = True
        if not self.running:
            self._external.clear()
            while self._internal:  # stopped (a top-level final state): never taken
                report_untaken(self.machine, self._internal.popleft())
        return None if first_result is _NOTHING else first_result

    def _clear_queues(self) -> None:
        self._internal.clear()
        self._external.clear()

    def _check_root_final(self) -> None:
        state, self._root_parallel_pending = self._root_parallel_pending, None
        if state is not None and state in self._config and self._in_final(state):
            self.running = False

    def keep_trail(self, trail: deque[TrailEntry], now: Callable[[], float]) -> None:
        """Append every taken transition to ``trail`` (a bounded deque) as ``(event, source,
        target, None, now())``, and each event refused by its guards (``GuardRejected``) as
        ``(event, source, None, guards, now())``, as ``ChartRun.keep_trail`` does (the
        inspector's path of one run)."""
        self.trail = trail
        self._now = now

    def _notify(self) -> None:
        if self._max_microsteps is not None:  # a skeleton's steps are no run's: not counted
            return
        taken, self._taken = self._taken, []
        chart = self.chart
        for declared, event in taken:
            record = chart.record_of(declared, event)  # ('door' taking 'door.slam': its record)
            if record is None:
                continue
            chart.taken[record.id] += 1
            if self.trail is not None:
                self.trail.append((record.event, record.source, record.target, None,
                                   self._now()))
            for listener in chart.listeners:
                listener(record)

    def _run_macrostep(self) -> bool:
        took_events = False
        self._microsteps = 0
        while True:
            self._microsteps += 1
            if self._max_microsteps is not None and self._microsteps > self._max_microsteps:
                raise ValueError(f"{self.chart.name}: more than {self._max_microsteps} "
                                 f"microsteps in one macrostep of {self.configuration} "
                                 f"(eventless transitions chasing each other)")
            self._cache.clear()
            trigger = TriggerData(self.machine, event=None)
            enabled = self._select(trigger, eventless=True)
            if not enabled:
                if not self._internal:
                    return took_events
                trigger = self._internal.popleft()
                enabled = self._select(trigger, eventless=False)
                if not enabled:  # an error.execution dropped: heard by the explorer
                    report_untaken(self.machine, trigger)
            if enabled:
                took_events = True
                self._microstep(list(enabled), trigger)

    def _take_external_event(self, trigger: TriggerData) -> object:
        try:
            enabled = self._select(trigger, eventless=False)
        except Exception:
            self._internal.clear()
            raise
        if not enabled:
            if not self.allow_event_without_transition:
                self._internal.clear()
                refusal = self._refusal(str(trigger.event))
                if self.trail is not None and isinstance(refusal, GuardRejected):
                    self._trail_refusal(str(trigger.event), refusal.guards)
                raise refusal
            if self.trail is not None:  # StateChart semantics: ignored, yet the path shows
                refusal = self._refusal(str(trigger.event))  # its guards refused it
                if isinstance(refusal, GuardRejected):
                    self._trail_refusal(str(trigger.event), refusal.guards)
            return _NOTHING  # a later queued event's result is the send's, as in psm
        try:
            return self._microstep(list(enabled), trigger)
        except Exception:
            self._clear_queues()
            raise

    def _trail_refusal(self, event: str, guards: tuple[str, ...]) -> None:
        """Trail a refused event as the flat run does, ``(event, state, None, guards, now())``,
        ``state`` being the state that declares the first refusing transition (the one the
        inspector's path notes the refusal in)."""
        trail = self.trail
        if trail is None:  # (the caller checked: a trail is kept)
            return
        source = next((t.source.id for state in self._config for t in state.transitions
                       if not t.initial and t.match(event)), self.state)
        trail.append((event, source, None, guards, self._now()))

    def _refusal(self, event: str) -> ChartTransitionError:
        """The error for an external event no transition takes: ``IllegalTransition`` when
        no transition of the active states (or their ancestors) names it, else
        ``GuardRejected`` naming the guards of those that do."""
        candidates = [t for state in self._config for t in state.transitions
                      if not t.initial and t.match(event)]
        if not candidates:
            return IllegalTransition(self.chart.name, self.state, event, self.chart.events)
        guards = tuple(dict.fromkeys(
            g for t in candidates for g in self._guards_of(t, event)))
        return GuardRejected(self.chart.name, self.state, event, guards or ("(validators)",))

    def _guards_of(self, declared: Any, event: str) -> tuple[str, ...]:
        for name in (event, *(str(e) for e in declared.events)):
            record = self.chart.by_declared.get((id(declared), name))
            if record is not None:
                return record.guards
        return ()

    # ---- selection

    def _select(self, trigger: TriggerData, eventless: bool) -> OrderedSet[Any]:
        enabled: OrderedSet[Any] = OrderedSet()
        event = trigger.event
        for state in [s for s in self._config if s.is_atomic]:
            found = None
            for candidate_state in chain([state], state.ancestors()):
                for transition in candidate_state.transitions:
                    if transition.initial:
                        continue
                    matches = transition.is_eventless if eventless else transition.match(event)
                    if matches and self._conditions_match(transition, trigger):
                        found = transition
                        break
                if found is not None:
                    break
            if found is not None:
                enabled.add(found)
        return self._filter_conflicting(enabled)

    def _conditions_match(self, transition: Any, trigger: TriggerData) -> bool:
        if self._outcomes is not None:  # a skeleton selecting under given outcomes
            record = next((r for r in (self.chart.record_of(transition, e)
                                       for e in (trigger.event, *transition.events))
                           if r is not None), None)
            if record is None:
                return True
            return (all(holds(text, self._outcomes) for text in record.conds)
                    and not any(holds(text, self._outcomes) for text in record.unless))
        args, kwargs = self._args_kwargs(transition, trigger)
        self._registry.call(transition.validators.key, *args, on_error=None, **kwargs)
        return bool(self._registry.all(transition.cond.key, *args, on_error=self._on_error(),
                                       **kwargs))

    def _filter_conflicting(self, transitions: OrderedSet[Any]) -> OrderedSet[Any]:
        filtered: OrderedSet[Any] = OrderedSet()
        for t1 in transitions:
            preempted = False
            to_remove: OrderedSet[Any] = OrderedSet()
            for t2 in filtered:
                if self._exit_set([t1]) & self._exit_set([t2]):
                    if t1.source.is_descendant(t2.source):
                        to_remove.add(t2)
                    else:
                        preempted = True
                        break
            if not preempted:
                for t3 in to_remove:
                    filtered.discard(t3)
                filtered.add(t1)
        return filtered

    def _exit_set(self, transitions: list[Any]) -> OrderedSet[_Step]:
        states: OrderedSet[_Step] = OrderedSet()
        for transition in transitions:
            if not transition.targets:
                continue
            domain = self._domain(transition)
            for state in self._config:
                if domain is None or state.is_descendant(domain):
                    states.add(_Step(transition, state))
        return states

    def _domain(self, transition: Any) -> State | None:
        states = self._effective_targets(transition)
        if not states:
            return None
        if (transition.internal and transition.source.is_compound
                and all(state.is_descendant(transition.source) for state in states)):
            return transition.source  # type: ignore[no-any-return]
        if (transition.internal and transition.is_self and transition.target
                and transition.target.is_atomic):
            return transition.source  # type: ignore[no-any-return]
        head, *tail = [transition.source, *states]
        for ancestor in (a for a in head.ancestors() if a.is_compound):
            if all(state.is_descendant(ancestor) for state in tail):
                return ancestor  # type: ignore[no-any-return]
        return None

    def _effective_targets(self, transition: Any) -> OrderedSet[Any]:
        targets: OrderedSet[Any] = OrderedSet()
        for state in transition.targets:
            if state.is_history:
                if state.id in self.history_values:
                    targets.update(self.history_values[state.id])
                else:
                    targets.update(s for t in state.transitions
                                   for s in self._effective_targets(t))
            else:
                targets.add(state)
        return targets

    # ---- callbacks

    def _on_error(self) -> Callable[[Exception], None] | None:
        if not self.catch_errors_as_events:
            return None

        def handler(error: Exception) -> None:
            if isinstance(error, InvalidDefinition):
                raise error
            skipped = _init_skipped(self, error)
            if skipped is not None:
                raise skipped from error
            self._raise_internal(_ERROR_EXECUTION, error=error)

        return handler

    def _raise_internal(self, event: str, *args: object, **kwargs: object) -> None:
        bound = BoundEvent(event, _sm=self.machine, internal=True)
        self._internal.append(bound.build_trigger(*args, machine=self.machine, **_data(kwargs)))

    def _handle_error(self, error: Exception, trigger: TriggerData) -> None:
        skipped = _init_skipped(self, error)
        if skipped is not None:
            raise skipped from error
        if not self.catch_errors_as_events:
            raise error
        if trigger.event and str(trigger.event) == _ERROR_EXECUTION:
            # dropped, as psm does (an error.execution of its own could loop), but heard
            report_dropped(self.machine, error)
            return
        self._raise_internal(_ERROR_EXECUTION, error=error)

    def _args_kwargs(self, transition: Any, trigger: TriggerData, target: Any = None,
                     source: Any = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
        key = (id(transition), id(trigger), id(target), id(source))
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        event_data = EventData(trigger_data=trigger, transition=transition)
        if target:
            event_data.state = target
            event_data.target = target
        if source:
            event_data.state = source
            event_data.source = source
        args, kwargs = event_data.args, event_data.extended_kwargs
        for new_kwargs in self._registry.call(self._prepare_key, *args, **kwargs):
            kwargs.update(new_kwargs)
        self._cache[key] = (args, kwargs)
        return args, kwargs

    def _content(self, transitions: list[Any], trigger: TriggerData,
                 get_key: Callable[[Any], str], set_target_as_state: bool = False,
                 on_error: Callable[[Exception], None] | None = None,
                 **extra: object) -> list[Any]:
        result: list[Any] = []
        for transition in transitions:
            target = transition.target if set_target_as_state else None
            args, kwargs = self._args_kwargs(transition, trigger, target=target)
            kwargs.update(extra)
            result += self._registry.call(get_key(transition), *args, on_error=on_error,
                                          **kwargs)
        return result

    # ---- microstep

    def _microstep(self, transitions: list[Any], trigger: TriggerData) -> object:
        previous = OrderedSet(self._config)
        try:
            result = self._content(transitions, trigger, lambda t: t.before.key)
            exited = self._exit_states(transitions, trigger)
            result += self._enter_states(transitions, trigger, exited, previous)
        except InvalidDefinition:
            self._config = previous
            raise
        except Exception as error:  # noqa: BLE001 - any callback error, as psm's microstep
            self._config = previous
            self._handle_error(error, trigger)
            return None
        event = str(trigger.event) if trigger.event is not None else ""
        self._taken.extend((t, event) for t in transitions)
        # and the defaults of the empty histories they entered (declared transitions too)
        self._taken.extend((t, "") for t in self._history_defaults)
        try:
            self._content(transitions, trigger, lambda t: t.after.key, set_target_as_state=True)
        except InvalidDefinition:
            raise
        except Exception as error:  # noqa: BLE001 - any `after` callback error, as psm's
            self._handle_error(error, trigger)
        if not result:
            return None
        return result[0] if len(result) == 1 else result

    def _exit_states(self, transitions: list[Any], trigger: TriggerData) -> OrderedSet[Any]:
        ordered = sorted(self._exit_set(transitions),
                         key=lambda x: x.state and x.state.document_order or 0, reverse=True)
        exited = OrderedSet([info.state for info in ordered if info.state])
        for info in ordered:
            state = info.state
            for history in state.history:
                if history.type.is_deep:
                    value = [s for s in self._config if s.is_descendant(state)]
                else:
                    value = [s for s in self._config if s.parent == state]
                self.history_values[history.id] = value
        on_error = self._on_error()
        for info in ordered:
            args, kwargs = self._args_kwargs(info.transition, trigger, source=info.state)
            self._registry.call(info.state.exit.key, *args, on_error=on_error, **kwargs)
            if not self.atomic_configuration_update:
                self._config.discard(info.state)
        return exited

    def _enter_states(self, transitions: list[Any], trigger: TriggerData,
                      exited: OrderedSet[Any], previous: OrderedSet[Any]) -> list[Any]:
        on_error = self._on_error()
        to_enter: OrderedSet[_Step] = OrderedSet()
        default_entry: OrderedSet[_Step] = OrderedSet()
        default_history: dict[str | None, list[_Step]] = {}
        self._history_defaults = []
        self._entry_set(transitions, to_enter, default_entry, default_history)
        ordered = sorted(to_enter, key=lambda x: x.state and x.state.document_order or 0)
        new_configuration = OrderedSet(s for s in previous if s not in exited)
        new_configuration.update(info.state for info in ordered if info.state)

        on_error_transition = on_error
        if on_error is not None and trigger.event and str(trigger.event) == _ERROR_EXECUTION:
            on_error_transition = None
        result = self._content(transitions, trigger, lambda t: t.on.key,
                               on_error=on_error_transition, previous_configuration=previous,
                               new_configuration=new_configuration)
        if self.atomic_configuration_update:
            self._config = OrderedSet(new_configuration)
        default_ids = {info.state.id for info in default_entry if info.state}
        for info in ordered:
            target, transition = info.state, info.transition
            args, kwargs = self._args_kwargs(transition, trigger, target=target)
            if not self.atomic_configuration_update:
                self._config.add(target)
            if self._max_microsteps is not None:
                self.entered.append(target.id)
            entry_result = self._registry.call(target.enter.key, *args, on_error=on_error,
                                               **kwargs)
            if target.id in default_ids:
                initial = [t for t in target.transitions if t.initial]
                if len(initial) == 1:
                    result += self._registry.call(initial[0].on.key, *args, **kwargs)
            history_transitions = [i.transition for i in default_history.get(target.id, [])]
            if history_transitions:
                self._content(history_transitions, trigger, lambda t: t.on.key,
                              previous_configuration=previous,
                              new_configuration=new_configuration)
            if target.final:
                self._final_entered(target, entry_result)
        return result

    def _final_entered(self, target: Any, entry_result: list[Any]) -> None:
        if target.parent is None:
            self.running = False
            return
        parent, grandparent = target.parent, target.parent.parent
        done_args: tuple[Any, ...] = ()
        done_kwargs: dict[str, Any] = {}
        for item in entry_result:
            if not item:
                continue
            if isinstance(item, dict):
                done_kwargs.update(item)
            else:
                done_args = (item,)
        self._raise_internal(f"done.state.{parent.id}", *done_args, **done_kwargs)
        if grandparent and grandparent.parallel:
            if all(self._in_final(child) for child in grandparent.states):
                self._raise_internal(f"done.state.{grandparent.id}", *done_args, **done_kwargs)
                if grandparent.parent is None:
                    self._root_parallel_pending = grandparent

    def _in_final(self, state: Any) -> bool:
        if state.parallel:
            return all(self._in_final(s) for s in state.states)
        return any(s.final and s in self._config for s in state.states)

    # ---- entry set (base.py compute_entry_set and friends)

    def _enters_target(self, transition: Any) -> bool:
        return (self.enable_self_transition_entries or not transition.internal
                or not (transition.is_self or (transition.target and
                                               transition.target.is_descendant(transition.source))))

    def _entry_set(self, transitions: list[Any], to_enter: OrderedSet[_Step],
                   default_entry: OrderedSet[_Step],
                   default_history: dict[str | None, list[_Step]]) -> None:
        for transition in transitions:
            for target in transition.targets:
                self._add_descendants(_Step(transition, target), to_enter, default_entry,
                                      default_history)
            ancestor = self._domain(transition)
            for effective in self._effective_targets(transition):
                self._add_ancestors(_Step(transition, effective), ancestor, to_enter,
                                    default_entry, default_history)

    def _add_descendants(self, info: _Step, to_enter: OrderedSet[_Step],
                         default_entry: OrderedSet[_Step],
                         default_history: dict[str | None, list[_Step]]) -> None:
        state = info.state
        if state and state.is_history:
            self._add_history(info, state, to_enter, default_entry, default_history)
            return
        if self._enters_target(info.transition):
            to_enter.add(info)
        if state.parallel:
            for child in state.states:
                if not any(s.state.is_descendant(child) for s in to_enter):
                    self._add_descendants(_Step(info.transition, child), to_enter,
                                          default_entry, default_history)
        elif state.is_compound:
            default_entry.add(info)
            initial = next(t for t in state.transitions if t.initial)
            for target in initial.targets:
                self._add_descendants(_Step(initial, target), to_enter, default_entry,
                                      default_history)
            for target in initial.targets:
                self._add_ancestors(_Step(initial, target), state, to_enter, default_entry,
                                    default_history)

    def _add_history(self, info: _Step, history: Any, to_enter: OrderedSet[_Step],
                     default_entry: OrderedSet[_Step],
                     default_history: dict[str | None, list[_Step]]) -> None:
        parent_id = history.parent and history.parent.id
        default_history[parent_id] = [info]
        if history.id in self.history_values:
            for state in self.history_values[history.id]:
                step = _Step(info.transition, state)
                if history.type.is_deep:
                    to_enter.add(step)
                else:
                    self._add_descendants(step, to_enter, default_entry, default_history)
            for state in self.history_values[history.id]:
                self._add_ancestors(_Step(info.transition, state), history.parent, to_enter,
                                    default_entry, default_history)
        else:
            self._history_defaults.extend(history.transitions)
            for transition in history.transitions:
                step = _Step(transition, transition.target)
                default_history[parent_id].append(step)
                self._add_descendants(step, to_enter, default_entry, default_history)
            for transition in history.transitions:
                self._add_ancestors(_Step(transition, transition.target), history.parent,
                                    to_enter, default_entry, default_history)

    def _add_ancestors(self, info: _Step, ancestor: Any, to_enter: OrderedSet[_Step],
                       default_entry: OrderedSet[_Step],
                       default_history: dict[str | None, list[_Step]]) -> None:
        for anc in info.state.ancestors(parent=ancestor):
            to_enter.add(_Step(info.transition, anc))
            if anc.parallel:
                for child in anc.states:
                    if not any(s.state.is_descendant(child) for s in to_enter):
                        self._add_descendants(_Step(info.transition, child), to_enter,
                                              default_entry, default_history)


def _unresolved_hint(model: object, err: Exception) -> str:
    """What to do about a name the chart gives a callback (a guard, an action) that neither the
    model, the chart nor a listener answers (python-statemachine's ``Did not found name 'x'``):
    the model's name it resembles (a typo) and the two fixes; empty for another error."""
    found = re.search(r"Did not found name '([^']*)'", str(err))
    if found is None:
        return ""
    name = found.group(1)
    close = difflib.get_close_matches(
        name, [n for n in dir(model) if not n.startswith("__")], n=1)
    meant = f"; did you mean {close[0]!r}?" if close else ""
    return (f"{meant} (the model is {type(model).__name__}: give it a method {name}, or "
            f"correct the name in the chart)")
