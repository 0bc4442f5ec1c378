"""Model-based test paths from any chart, given as its class or its ``CompiledChart`` (as
XState's graph utilities): ``transition_paths`` (one shortest path per transition),
``state_paths`` (one shortest path per state), ``transition_tour`` (a few runs from the initial
state that together take every transition); ``GuardTable`` and ``drive`` run one on a compiled
run. ``calexec charts paths MODULE:CLASS --json`` prints the same as data (``as_data``).

For every declared transition: the shortest event path from the initial state that ends by
taking it (breadth-first over states, guards considered satisfiable). Because the first
transition whose guards pass wins, each step also carries the guard outcomes that make that
step's transition the winner (its ``cond`` true, its ``unless`` false, and one guard of every
earlier candidate for the same state and event failing). A driver sets those outcomes on its
model (for the executor: the fault plan) before sending the step's event.

Hierarchical charts (compound, parallel or history states, eventless transitions) are explored
by *configuration*, not by state: breadth-first over the distinct (configuration, recorded
history) a skeleton of the chart reaches (``statechart_run.StatechartRun.skeleton``: no
action runs), sending one candidate transition's event at a time and then running the
macrostep it starts (``done.state`` events, eventless transitions) under the same guard
outcomes, as a ``GuardTable`` model answers them until the next step; an event is sent once
more under outcomes that also select each guarded eventless or ``done.state`` transition
(``_macrostep_outcomes``) where the macrostep then goes elsewhere. A guarded eventless
transition of a configuration that the step reaching it could not take (its guards must
change after that step) is taken as python-statemachine takes it, before the next event sent
under outcomes that enable it (``_enabling``; ``StatechartRun.force`` runs that macrostep
first), so that event's step is taken where it led. A candidate is
sent only where some guard outcomes select it (``_selected``: the earlier alternatives of its
state and the transitions of its active descendants on the same event refused, since a
state's transitions come before its ancestors'); under those outcomes (a guard not named
answers True, as ``GuardTable``) the event takes every transition it selects, one per region
of a parallel state, as a real run does; a step's guard outcomes are those. A state's walk ends in the
first configuration that contains it (``Walk.end`` is that configuration, ``"a,b"``), or for a state
only ever entered and left within one macrostep (a final child whose ``done.state`` event
leaves its parent), the first walk that enters it; a
transition taken inside a macrostep (an eventless one, or one on ``done.state.<id>``) has the
event that leads to it as its path's last step (a ``done.state.<id>`` event is never sent
as a step: only the chart raises it). Guard outcomes of a step are set on the names a model
answers: a guard expression's by the names inside it (``guard_expr``: ``cond="a and not b"``
taken under ``{"a": True, "b": False}``); a callable guard, which python-statemachine calls
itself and no model answers, or an expression not over names is refused (``_unsettable``).
At most ``MAX_CONFIGURATIONS`` configurations are explored (``ValueError`` beyond; each
function's ``max_configurations`` sets another bound).

A configuration is the *set* of active states, with the set of states each history recorded
(``_node``), whatever order a run entered them in: the regions of a parallel state moved by
``a b`` and by ``b a`` are one configuration (a parallel chart of three regions of three
states has 28 configurations; keyed by the order, its graph had 202 nodes). Only where that
order decides what an event does do two configurations of one set differ, by the order of
their atomic states (``_order_decides``: python-statemachine selects one transition per atomic
state in configuration order and, of two from orthogonal regions whose exit sets meet, keeps
the first). Walks and paths follow the run that reached each configuration first (still the
shortest: the breadth-first order is the same); a tour's walk may reach a configuration by
another order of events than that run, and replays its steps for its ``end`` (``_walk_end``).
"""

from __future__ import annotations

import difflib
import functools
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NotRequired, TypedDict

import attrs
from statemachine import StateChart
from statemachine.callbacks import CallbackGroup

from calexec.machines import mutants
from calexec.machines.chart_support import model_callbacks, reference
from calexec.machines.compiled import (
    ChartLike,
    ChartRun,
    ChartTransitionError,
    CompiledChart,
    Transition,
    compiled,
)
from calexec.machines.guard_expr import (
    Alternative,
    UnsettableGuard,
    alternatives,
    callable_name,
    names,
)
from calexec.machines.statechart_run import StatechartRun

#: bound on the configurations explored for a hierarchical chart (the default of every
#: ``max_configurations``; ``calexec charts paths --max-configurations``)
MAX_CONFIGURATIONS = 5000


def configurations_bound(max_configurations: object = None) -> int:
    """The bound on the configurations explored: ``max_configurations`` (an int >= 1), or
    :data:`MAX_CONFIGURATIONS` for None; anything else is a ``ValueError`` (``TypeError`` for
    what is no int) naming it."""
    if max_configurations is None:
        return MAX_CONFIGURATIONS
    if isinstance(max_configurations, bool) or not isinstance(max_configurations, int):
        raise TypeError(f"max_configurations={max_configurations!r}: expected an int >= 1 "
                        "or None (the default, MAX_CONFIGURATIONS)")
    if max_configurations < 1:
        raise ValueError(f"max_configurations={max_configurations!r}: expected an int >= 1 "
                         "or None (the default, MAX_CONFIGURATIONS)")
    return max_configurations


@attrs.frozen
class Path:
    """The shortest way to take ``transition``: ``steps[-1] is transition``.

    ``events[i]`` is ``steps[i].event``; ``guards[i]`` maps guard name -> required outcome for
    step ``i`` (guards not named are irrelevant to that step).
    """

    transition: Transition
    steps: tuple[Transition, ...]
    guards: tuple[Mapping[str, bool], ...]
    #: outcomes to set before the chart starts (``Walk.start``)
    start: Mapping[str, bool] = attrs.field(factory=lambda: MappingProxyType({}))
    #: the configuration that start ends in (``""`` when ``start`` is empty)
    started: str = ""
    #: the configuration the path ends in, ``"a,b"`` as ``Walk.end`` (the transition's target
    #: on a flat chart; on a hierarchical one its ancestors, regions and the states entered
    #: by the macrostep the step starts too)
    end: str = ""

    @property
    def events(self) -> tuple[str, ...]:
        return tuple(step.event for step in self.steps)

    @property
    def target(self) -> str:
        return self.transition.target


@attrs.frozen
class Walk:
    """A run from the chart's initial state: ``steps`` taken in order (empty: stay in the
    initial state), ``guards[i]`` the outcomes that make ``steps[i]`` the one taken, ``end``
    the state it ends in. ``start``: the outcomes to set before the chart starts, for a walk
    that needs its start (the initial macrostep: eventless and ``done.state`` transitions
    taken before any event) to choose otherwise than with every guard holding, and
    ``started`` the configuration that start ends in; empty for any other walk."""

    steps: tuple[Transition, ...]
    guards: tuple[Mapping[str, bool], ...]
    end: str
    start: Mapping[str, bool] = attrs.field(factory=lambda: MappingProxyType({}))
    started: str = ""

    @property
    def events(self) -> tuple[str, ...]:
        return tuple(step.event for step in self.steps)


def _describe(transition: Transition) -> str:
    """``source --event--> target`` (``(eventless)`` for an eventless transition)."""
    return f"{transition.source} --{transition.event or '(eventless)'}--> {transition.target}"


#: one requirement of a search: its alternatives, any one of which meets it (each a set of
#: guard-name outcomes, ``guard_expr.Alternative``)
_Choice = tuple[Alternative, ...]


def _takes(transition: Transition) -> tuple[_Choice, ...]:
    """What taking ``transition`` requires: each ``cond`` true, each ``unless`` false (a
    guard expression by the names inside it, ``guard_expr``)."""
    return (tuple(alternatives(text, True) for text in transition.conds)
            + tuple(alternatives(text, False) for text in transition.unless))


def _refusals(transition: Transition) -> _Choice:
    """The ways to refuse ``transition``: one of its ``cond`` false or ``unless`` true."""
    return (tuple(way for text in transition.conds for way in alternatives(text, False))
            + tuple(way for text in transition.unless for way in alternatives(text, True)))


def _solve(outcome: Mapping[str, bool],
           choices: tuple[_Choice, ...]) -> dict[str, bool] | None:
    """``outcome`` with names fixed so that each of ``choices`` is met by one of its
    alternatives, or None when no setting meets them all. Each is met by its first
    alternative not contradicting what is fixed; where that leaves a later one no way, the
    search goes back and takes an earlier one's next alternative (alternatives whose guards
    share names: ``cond="a", unless="b"`` refused by ``b`` when a later ``unless="a"`` needs
    ``a``)."""
    found = dict(outcome)

    def fits(fixed: Mapping[str, bool], way: Alternative) -> bool:
        return all(fixed.get(name, value) == value for name, value in way)

    def possible(fixed: Mapping[str, bool], rest: tuple[_Choice, ...]) -> bool:
        # every choice left still has a way not contradicting ``fixed`` (prunes the search)
        return all(any(fits(fixed, way) for way in choice) for choice in rest)

    if not possible(found, choices):
        return None
    for index, choice in enumerate(choices):
        if any(all(found.get(name) == value for name, value in way) for way in choice):
            continue  # met already
        rest = choices[index + 1:]
        for way in choice:
            fixed = {**found, **dict(way)}
            if fits(found, way) and possible(fixed, rest):
                deeper = _solve(fixed, rest)
                if deeper is not None:
                    return deeper
        return None
    return found


def _refuse(outcome: Mapping[str, bool],
            rivals: tuple[Transition, ...]) -> dict[str, bool] | None:
    """``outcome`` with one guard of each of ``rivals`` fixed so that it refuses, or None when
    no choice refuses them all (``_solve``)."""
    return _solve(outcome, tuple(_refusals(rival) for rival in rivals))


def winning_guards(chart: ChartLike, transition: Transition) -> Mapping[str, bool] | None:
    """Guard outcomes under which ``transition`` is the one taken, or ``None`` if it is
    shadowed (an earlier candidate for the same state and event can never be refused).

    Each earlier candidate is refused by its first guard that can be (``_refuse``).
    """
    chart = compiled(chart)
    found = _solve({}, _takes(transition)
                   + tuple(_refusals(rival) for rival in _earlier(chart, transition)))
    return None if found is None else MappingProxyType(found)


def _earlier(chart: CompiledChart, transition: Transition) -> tuple[Transition, ...]:
    """The candidates declared before ``transition`` for its state and event."""
    slot = chart.table[(transition.source, transition.event)]
    if transition not in slot:
        raise ValueError(f"{chart.name}: transition {_describe(transition)} is not in its own "
                         f"table slot")
    return tuple(slot[:slot.index(transition)])


def _outgoing(chart: CompiledChart) -> dict[str, list[Transition]]:
    """State -> its transitions in declaration order, indexed once (``chart.outgoing`` scans
    every transition per call: a breadth-first search with it was O(states x transitions),
    the tour of a 400-state chart took half a minute)."""
    index: dict[str, list[Transition]] = {state: [] for state in chart.states}
    for transition in chart.transitions:
        index.setdefault(transition.source, []).append(transition)
    return index


def _shortest(outgoing: Mapping[str, list[Transition]], start: str,
              guards: Mapping[int, Mapping[str, bool] | None]) -> dict[str, tuple[Transition, ...]]:
    """State -> the shortest steps from ``start`` to it (breadth-first, declaration order breaks
    ties; shadowed transitions are never steps)."""
    reach: dict[str, tuple[Transition, ...]] = {start: ()}
    frontier = deque([start])
    while frontier:
        state = frontier.popleft()
        for transition in outgoing.get(state, ()):
            if guards[transition.id] is not None and transition.target not in reach:
                reach[transition.target] = reach[state] + (transition,)
                frontier.append(transition.target)
    return reach


def _shadowed(chart: CompiledChart, transition: Transition) -> str:
    if _solve({}, _takes(transition)) is None:  # (no earlier one to blame: "shadowed by ,")
        guards = ", ".join([*map(repr, transition.conds),
                            *(f"unless {text!r}" for text in transition.unless)])
        return (f"{chart.name}: transition {_describe(transition)} can never be taken: its own "
                f"guards ({guards}) cannot all hold at once")
    slot = chart.table[(transition.source, transition.event)]
    earlier = ", ".join(_describe(t) for t in slot[:slot.index(transition)])
    return (f"{chart.name}: transition {_describe(transition)} can never be taken (shadowed by "
            f"{earlier}, declared before it for the same state and event, whose guards cannot "
            f"all be refused)")


def _unsettable(chart: CompiledChart) -> None:
    """``ValueError`` naming the first guard of ``chart`` no path can set, and why: a callable
    (python-statemachine calls it, not the model a path drives), or an expression that is not
    and/or/not over names (``guard_expr``)."""
    for record in chart.transitions:
        declared = chart.declared[record.id] if record.id < len(chart.declared) else None
        if getattr(getattr(declared, "source", None), "is_history", False):
            continue  # a history's default: python-statemachine never asks its ``cond``
        for spec in getattr(declared, "_specs", ()):
            if spec.group != CallbackGroup.COND or isinstance(
                    getattr(spec.func, "calexec_constant", None), bool):
                continue  # a constant guard of chart mutation testing: folded at compile
            where = f"on transition {_describe(record)}"
            if not isinstance(spec.func, str):
                name = callable_name(spec.func)
                named = name if name.isidentifier() else "a_name"
                raise ValueError(
                    f"{chart.name}: guard {name!r} (a callable) {where}: a path cannot set it "
                    f"(python-statemachine calls the callable itself, not the model a path "
                    f"drives); name it instead, cond=\"{named}\" with {named} a method of the "
                    f"model, or drive the chart with a model of your own")
            try:
                alternatives(spec.func, True)
            except UnsettableGuard as err:
                raise ValueError(f"{chart.name}: guard {spec.func!r} {where}: a path cannot set "
                                 f"it: {err}") from None


def _guards(chart: CompiledChart) -> dict[int, Mapping[str, bool] | None]:
    """Transition id -> its winning guard outcomes; ``ValueError`` for a shadowed one (a
    declaration bug, named before the states or transitions only it would reach) or a guard
    no path can set (``_unsettable``)."""
    _unsettable(chart)
    guards = {t.id: winning_guards(chart, t) for t in chart.transitions}
    for transition in chart.transitions:
        if guards[transition.id] is None:
            raise ValueError(_shadowed(chart, transition))
    return guards


def transition_paths(chart: ChartLike, max_configurations: int | None = None) -> list[Path]:
    """One shortest path per declared transition, in ``chart.transitions`` order.

    Raises ``ValueError`` naming any transition that is shadowed or whose source state is
    unreachable: both are declaration bugs. ``max_configurations``: the bound on the
    configurations of a hierarchical chart explored (:func:`configurations_bound`).
    """
    chart = compiled(chart)
    guards = _guards(chart)
    if _by_configuration(chart):
        return _configuration_paths(chart, configurations_bound(max_configurations))
    reach = _shortest(_outgoing(chart), chart.initial, guards)
    paths = []
    for transition in chart.transitions:
        if transition.source not in reach:
            raise ValueError(f"{chart.name}: source of {_describe(transition)} is unreachable")
        steps = reach[transition.source] + (transition,)
        # every step's guards are known: a shadowed transition is never on a path (the BFS skips it)
        paths.append(Path(transition, steps, tuple(_named(guards[s.id] or {}) for s in steps),
                          end=transition.target))
    return paths


def explore(chart: ChartLike, max_configurations: int | None = None,
            progress: Callable[[int, int], object] | None = None,
            every_s: float = 5.0) -> int:
    """Explore the configurations of a hierarchical chart (what every function of this module
    reads, once per compiled chart: the first one called explores them) and return how many
    there are (0 for a flat chart, whose paths need none). ``progress(explored, to_go)`` is
    called at most every ``every_s`` seconds while it runs (``calexec charts paths`` says so
    on stderr: a chart of many guarded eventless transitions explores for minutes).
    ``ValueError`` past ``max_configurations``, as :func:`transition_paths`."""
    chart = compiled(chart)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress={progress!r}: expected a callable(explored, to_go) or None")
    if (isinstance(every_s, bool) or not isinstance(every_s, (int, float))
            or not 0 <= every_s < float("inf")):
        raise ValueError(f"every_s={every_s!r}: expected a finite number of seconds >= 0")
    limit = configurations_bound(max_configurations)
    if not _by_configuration(chart):
        return 0
    return len(_graph(chart, limit, progress, float(every_s)).edges)


def state_paths(chart: ChartLike, max_configurations: int | None = None) -> dict[str, Walk]:
    """State -> the shortest walk from the initial state to it, in ``chart.states`` order (the
    initial state's walk has no step). Raises ``ValueError`` naming an unreachable state.
    ``max_configurations``: as :func:`transition_paths`'."""
    chart = compiled(chart)
    guards = _guards(chart)
    if _by_configuration(chart):
        return _configuration_walks(chart, configurations_bound(max_configurations))
    reach = _shortest(_outgoing(chart), chart.initial, guards)
    missing = [state for state in chart.states if state not in reach]
    if missing:
        raise ValueError(f"{chart.name}: state(s) {', '.join(missing)} unreachable from "
                         f"{chart.initial}")
    return {state: Walk(reach[state], tuple(_named(guards[t.id] or {}) for t in reach[state]), state)
            for state in chart.states}


def transition_tour(chart: ChartLike, max_configurations: int | None = None) -> list[Walk]:
    """Walks from the initial state that together take every declared transition: each walk
    goes on to the nearest transition not taken yet until none is reachable from where it is
    (a final state), then the next walk starts over. Raises as ``transition_paths`` does
    (``max_configurations`` too)."""
    chart = compiled(chart)
    # every transition is takable and its source reachable, or raise
    transition_paths(chart, max_configurations)
    if _by_configuration(chart):
        return _configuration_tour(chart, configurations_bound(max_configurations))
    guards = _guards(chart)
    outgoing = _outgoing(chart)
    untaken = {t.id for t in chart.transitions}
    walks = []
    while untaken:
        state, steps = chart.initial, []
        while True:
            reach = _shortest(outgoing, state, guards)
            nearest = min(((len(reach[t.source]), t.id) for t in chart.transitions
                           if t.id in untaken and t.source in reach), default=None)
            if nearest is None:
                break
            taken = chart.transitions[nearest[1]]
            for step in reach[taken.source] + (taken,):
                steps.append(step)
                untaken.discard(step.id)
            state = taken.target
        walks.append(Walk(tuple(steps), tuple(_named(guards[t.id] or {}) for t in steps), state))
    return walks


def _by_configuration(chart: CompiledChart) -> bool:
    """Whether ``chart`` is explored by configuration (module docstring)."""
    return any(t.event == "" for t in chart.transitions) or any(
        state.states or state.history for state in chart.declaration.states_map.values())


def _named(outcomes: Mapping[str, bool]) -> Mapping[str, bool]:
    """A step's outcomes: names a model answers (a guard expression is set by the names
    inside it; ``_unsettable`` refused a chart with a guard no name sets)."""
    return MappingProxyType(dict(outcomes))


def _by_id(chart: CompiledChart) -> dict[str, Any]:
    """The chart's states by id (python-statemachine's ``states_map`` is keyed by value, which
    ``State(value=...)`` makes differ from the id a configuration names)."""
    return chart.declared_states()


def _selected(chart: CompiledChart, record: Transition, configuration: tuple[str, ...],
              base: Mapping[str, bool] | None = None) -> Mapping[str, bool] | None:
    """Guard outcomes under which sending ``record.event`` in ``configuration`` takes
    ``record``, or None when no outcome does: an earlier alternative of its state cannot be
    refused, or an active descendant of its state has a transition on the same event that
    cannot be refused (a state's transitions are selected before its ancestors'), or an
    eventless transition of ``configuration`` cannot be refused (python-statemachine takes
    those first, under the outcomes the step sets). ``base``: outcomes fixed beforehand."""
    states = _by_id(chart)
    inner: list[str] = []  # active states strictly below record.source
    for state_id in configuration:
        chain: list[str] = []
        node: Any = states[state_id]  # a State, then its ancestors, then None
        if node.states:  # only atomic states select
            continue
        while node is not None and node.id != record.source:
            chain.append(node.id)
            node = node.parent
        if node is not None:
            inner.extend(s for s in chain if s not in inner)
    rivals = tuple(t for state_id in inner for t in chart.table.get((state_id, record.event), ()))
    # a real run takes the eventless transitions the step's outcomes enable before its event:
    # those of ``configuration`` (refused there under the outcomes that reached it) stay so
    # (``_graph`` explores taking them first as edges of their own: ``_enabling``)
    found = _solve(dict(base or {}), _takes(record) + tuple(
        _refusals(rival) for rival in _earlier(chart, record) + rivals + _waiting(chart,
                                                                                   configuration)))
    return None if found is None else MappingProxyType(found)


def _waiting(chart: CompiledChart, configuration: tuple[str, ...]) -> tuple[Transition, ...]:
    """The eventless transitions of the active states of ``configuration``."""
    return tuple(t for state_id in configuration for t in chart.table.get((state_id, ""), ()))


def _enabling(chart: CompiledChart, configuration: tuple[str, ...]
              ) -> list[tuple[Transition, Mapping[str, bool]]]:
    """Each guarded eventless transition of ``configuration`` with outcomes that select it
    (its earlier alternatives refused; then also every other eventless transition there
    refused): a run in ``configuration`` whose model answers so takes it before the next
    event it is sent, as python-statemachine runs the macrostep before a sent event. The
    step that reached ``configuration`` may not have been able to take it (its guards must
    change after that step: ``cooled`` once the boiler is ``hot``)."""
    waiting = _waiting(chart, configuration)
    found: list[tuple[Transition, Mapping[str, bool]]] = []
    for eventless in waiting:
        if not (eventless.conds or eventless.unless):
            continue
        others = tuple(_refusals(t) for t in waiting if t is not eventless)
        for rivals in (tuple(_refusals(t) for t in _earlier(chart, eventless)), others):
            outcomes = _solve({}, _takes(eventless) + rivals)
            if outcomes is not None and (eventless, outcomes) not in found:
                found.append((eventless, MappingProxyType(outcomes)))
    return found


#: a configuration node (``_node``): the active states in declaration order, the active atomic
#: states in configuration order where that order decides (else ``()``), each recorded history
#: (history id, its states in declaration order) and whether the run still runs
_Node = tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...], bool]


def _event_tokens(event: str) -> tuple[str, ...]:
    """``event`` as python-statemachine matches it: its dot-separated tokens, a trailing
    ``.*`` or ``.`` dropped (``error.*`` selects on ``error`` and ``error.execution``)."""
    if event.endswith(".*"):
        event = event[:-2]
    elif event.endswith("."):
        event = event[:-1]
    return tuple(event.split(".")) if event else ()


def _same_sent_event(one: str, other: str) -> bool:
    """Whether one sent event could select transitions declared on ``one`` and on ``other``
    (``""``: eventless, selected together after every microstep)."""
    if not one or not other:
        return one == other
    if "*" in (one, other):
        return True
    a, b = _event_tokens(one), _event_tokens(other)
    return a[:len(b)] == b[:len(a)]


def _region_leaving(declared: Any, region: Any) -> bool:
    """Whether the exit set of ``declared`` (a python-statemachine transition) may reach
    beyond ``region``: its domain (the first compound proper ancestor of its source that is a
    proper ancestor of every target, a history target standing for its parent; none: the
    root) is not inside ``region``. Never smaller than python-statemachine's domain (larger
    for an internal transition or a recorded history); a transition to its own region has
    the root as domain, as in python-statemachine (a parallel state is not compound)."""
    targets = [t.parent if t.is_history else t for t in declared.targets]
    if not targets:
        return False  # a targetless transition exits nothing
    for ancestor in declared.source.ancestors():
        if ancestor.is_compound and all(t.is_descendant(ancestor) for t in targets):
            return not (ancestor is region or ancestor.is_descendant(region))
    return True  # the root: every active state


def _regions(one: Any, other: Any) -> tuple[Any, Any] | None:
    """The two regions of one parallel state that hold ``one`` and ``other`` (each a region
    or inside one), or None when the two states cannot be active apart (one contains the
    other, or they are alternatives of a compound state)."""
    if one is other or one.is_descendant(other) or other.is_descendant(one):
        return None
    for ancestor in one.ancestors():
        if other.is_descendant(ancestor):
            if not ancestor.parallel:
                return None
            return (next(s for s in (one, *one.ancestors()) if s.parent is ancestor),
                    next(s for s in (other, *other.ancestors()) if s.parent is ancestor))
    return None


def _order_decides(chart: CompiledChart) -> bool:
    """Whether the order of the active atomic states can decide what an event does:
    python-statemachine selects one transition per atomic state in configuration order (the
    order the states were entered in), then of two selected transitions whose exit sets meet
    keeps the first, unless the later one's source is a descendant of the other's. Only
    transitions of orthogonal regions on one event, one of them leaving its region, can be
    such a pair (exit sets inside two regions are apart; of nested sources the descendant
    wins in either order)."""
    if not any(state.parallel for state in chart.declaration.states_map.values()):
        return False
    declared = [(record.event, chart.declared[record.id]) for record in chart.transitions
                if any(state.parallel for state in chart.declared[record.id].source.ancestors())]
    for i, (event, one) in enumerate(declared):
        for other_event, other in declared[i + 1:]:
            if not _same_sent_event(event, other_event):
                continue
            regions = _regions(one.source, other.source)
            if regions is not None and (_region_leaving(one, regions[0])
                                        or _region_leaving(other, regions[1])):
                return True
    return False


def _node(run: StatechartRun, rank: Mapping[str, int], ordered: bool) -> _Node:
    """The node of ``run``'s configuration: ``StatechartRun.node`` with the active states and
    each recorded history as sets (in declaration order, whatever order the run entered them
    in), and with ``ordered`` (``_order_decides``) the order of the active atomic states."""
    configuration, history, running = run.node()

    def canonical(ids: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(ids, key=lambda state: (rank.get(state, len(rank)), state)))

    atomic: tuple[str, ...] = ()
    if ordered:  # (the states by id are made anew per call: only where the order decides)
        states = _by_id(run.chart)
        atomic = tuple(s for s in configuration if states[s].is_atomic)
    return (canonical(configuration), atomic,
            tuple((name, canonical(ids)) for name, ids in history), running)


#: an edge of the configuration graph: (sent transition, ids of every transition it took,
#: next node, the guard outcomes under which it goes there). One transition may have several
#: edges from one node: the outcomes also decide the guarded eventless and ``done.state``
#: transitions of the macrostep it starts (``_macrostep_outcomes``)
_Edge = tuple[Transition, frozenset[int], _Node, Mapping[str, bool]]


@attrs.frozen
class _Graph:
    """The configurations a skeleton reaches: ``edges[node]`` lists its ``_Edge`` s;
    ``entered[state]`` the shortest edges that enter ``state`` and the configuration they
    end in."""

    #: the ways the chart starts, the one with every guard holding first
    starts: tuple[_Start, ...]
    edges: Mapping[_Node, list[_Edge]]
    #: state -> (index of the start, the edges from it, the configuration they end in)
    entered: Mapping[str, tuple[int, tuple[_Edge, ...], str]]
    #: ``_node``'s arguments: state -> declaration index, and ``_order_decides``
    rank: Mapping[str, int]
    ordered: bool
    #: state -> (the configuration a run settled from, the outcomes) of a state entered only
    #: as a run settles eventless transitions before an event that then takes no transition
    #: where they led (a final state): no path, made of transitions taken, reaches it
    settled_only: Mapping[str, tuple[str, Mapping[str, bool]]] = attrs.field(
        factory=lambda: MappingProxyType({}))

    @property
    def start(self) -> _Node:
        """The node of the start where every guard holds."""
        return self.starts[0].node

    @property
    def at_start(self) -> frozenset[int]:
        """Ids of the transitions the start where every guard holds takes."""
        return self.starts[0].taken


@attrs.frozen
class _Start:
    """One way the chart starts: the outcomes set before it starts (empty: every guard
    holds), the ids of the transitions its initial macrostep takes (eventless and
    ``done.state`` ones: their path has no step) and the node and configuration it ends in."""

    outcomes: Mapping[str, bool]
    taken: frozenset[int]
    node: _Node
    state: str


#: id(compiled chart) -> (a weak reference to it, its graph). Weak: the entry goes with the
#: chart (a mutation run or a toolkit process compiles many charts; a ``_Graph`` holds no
#: reference to its chart, so the cache does not keep one alive).
_GRAPHS: dict[int, tuple[weakref.ref[CompiledChart], _Graph]] = {}


def _forget(key: int, ref: weakref.ref[CompiledChart]) -> None:
    """The chart cached under ``key`` was collected: drop its graph (unless the entry is
    already another chart's)."""
    known = _GRAPHS.get(key)
    if known is not None and known[0] is ref:
        del _GRAPHS[key]


def cached_graphs() -> int:
    """How many charts' configuration graphs are cached now (a chart's goes with it)."""
    return len(_GRAPHS)


def _macrostep_outcomes(chart: CompiledChart) -> list[Mapping[str, bool]]:
    """For each guarded transition a macrostep takes without an event sent (eventless,
    ``done.state``): its winning outcomes, then each outcome of one of its guards that
    refuses it. A sent event's outcomes merged with one of them select that transition in
    the macrostep the event starts (its alternatives refused), or stop there without it."""
    inner = [t for t in chart.transitions
             if (not t.event or t.event.startswith("done.state.")) and (t.conds or t.unless)]
    found: list[Mapping[str, bool]] = []
    for transition in inner:
        winning = winning_guards(chart, transition)
        if winning is not None:
            found.append(winning)
        found.extend(MappingProxyType(dict(way)) for way in _refusals(transition))
    return found


def _variants(outcomes: Mapping[str, bool],
              inner: list[Mapping[str, bool]]) -> list[Mapping[str, bool]]:
    """``outcomes``, then ``outcomes`` merged with each of ``inner`` it does not contradict
    (each once)."""
    found = [outcomes]
    seen = {_key(outcomes)}
    for extra in inner:
        if all(outcomes.get(name, value) == value for name, value in extra.items()):
            merged = MappingProxyType({**outcomes, **extra})
            key = _key(merged)
            if key not in seen:
                seen.add(key)
                found.append(merged)
    return found


def _key(outcomes: Mapping[str, bool]) -> frozenset[tuple[str, bool]]:
    """``outcomes`` as a set key: two are equal when their keys are (a list of tried
    outcomes searched one by one made a chain's exploration grow as a power of its length)."""
    return frozenset(outcomes.items())


def _inner_guarded(transition: Transition) -> bool:
    """Whether ``transition`` is one a macrostep takes without an event sent (eventless, on
    ``done.state``) under guards."""
    return ((not transition.event or transition.event.startswith("done.state."))
            and bool(transition.conds or transition.unless))


#: outcomes to try, and the position in the guarded macrostep transitions they take from which
#: to refine them further (``_stopping``)
_Refinable = tuple[Mapping[str, bool], int]


def _stopping(outcomes: Mapping[str, bool], taken: Iterable[Transition],
              keep: Iterable[Transition] = (), after: int = 0,
              before: int | None = None) -> list[_Refinable]:
    """``outcomes`` with one guard more fixed to refuse each guarded eventless or
    ``done.state`` transition of ``taken`` (but those of ``keep``) from position ``after`` of
    them on, where they leave a way to: the macrostep then stops before it. A state with two
    guarded eventless transitions out (``fermenting.to(bottled, cond="fermented")``,
    ``fermenting.to(spoiled, cond="is_contaminated")``) is stayed in only under outcomes
    refusing both, which no merge of one transition's outcomes (``_variants``) gives. Each
    comes with its position: a macrostep under it takes the same guarded transitions before
    it, which its parent refined already, so it is refined from there on (refining them all
    again made as many outcomes as subsets of a chain's guards: minutes for 12 states), and
    up to position ``before`` (None: to the end)."""
    kept = {t.id for t in keep}
    found: list[_Refinable] = []
    seen: set[frozenset[tuple[str, bool]]] = set()
    guarded = [t for t in taken if t.id not in kept and _inner_guarded(t)]
    for position, transition in enumerate(guarded):
        if position < after or (before is not None and position >= before):
            continue
        refused = _solve(dict(outcomes), (_refusals(transition),))
        if refused is not None and refused != dict(outcomes):
            merged = MappingProxyType(refused)
            key = _key(merged)
            if key not in seen:
                seen.add(key)
                found.append((merged, position))
    return found


class _Heard(Mapping[str, bool]):
    """Guard outcomes that note the names a skeleton run reads, in the order it reads them,
    each with the default it read it with and the answer (``guard_expr.holds`` reads by
    ``get(name, True)``). A skeleton run is decided by its node and these answers: a run from
    the same node under outcomes that answer the same to the same names goes the same way
    (``_Memo``). A read of the whole mapping (its keys, its length) marks it ``whole``: such a
    run is not remembered."""

    def __init__(self, outcomes: Mapping[str, bool]) -> None:
        self.outcomes = outcomes
        self.heard: dict[str, tuple[object, object]] = {}
        self.whole = False

    def get(self, name: str, default: Any = None) -> Any:
        value = self.outcomes.get(name, default)
        known = self.heard.setdefault(name, (default, value))
        if known[0] != default:  # read again with another default: not a decision tree's
            self.whole = True
        return value

    def __getitem__(self, name: str) -> bool:
        self.whole = True
        return self.outcomes[name]

    def __contains__(self, name: object) -> bool:
        self.whole = True
        return name in self.outcomes

    def __iter__(self) -> Iterator[str]:
        self.whole = True
        return iter(self.outcomes)

    def __len__(self) -> int:
        self.whole = True
        return len(self.outcomes)


@attrs.define
class _Ask:
    """A node of a ``_Memo``: the runs here read ``name`` next (with ``default``); each answer
    leads on."""

    name: str
    default: object
    answers: dict[object, _Ask | _Done]


@attrs.frozen
class _Done:
    """A leaf of a ``_Memo``: what a run that read these answers did."""

    result: Any


_UNKNOWN = object()


class _Memo:
    """What skeleton runs from one node (and, for ``force``, of one transition) did, as a
    decision tree over the guard names they read (``_Heard``): outcomes that answer every name
    a run read as that run's did get its result without running again. Exploring a chain of
    states each left by guarded eventless transitions sends each event under outcomes for
    every guarded transition of the chart (``_variants``); almost all of them answer alike
    what the run reads, and each was a run through the chain (stop 74: a 40-state chain took
    1 min 40 s)."""

    def __init__(self) -> None:
        self.root: _Ask | _Done | None = None

    def find(self, outcomes: Mapping[str, bool]) -> Any:
        """The result of a run under ``outcomes``, or ``_UNKNOWN``."""
        node = self.root
        while isinstance(node, _Ask):
            node = node.answers.get(outcomes.get(node.name, node.default))
        return _UNKNOWN if node is None else node.result

    def add(self, heard: _Heard, result: Any) -> None:
        """Remember ``result`` of a run that read ``heard`` (nothing when it read the whole
        outcomes, or its reads contradict a run remembered: each run is then run)."""
        if heard.whole:
            return
        reads = list(heard.heard.items())
        leaf: _Ask | _Done = _Done(result)
        if self.root is None:
            self.root = _chain(reads, leaf)
            return
        node: _Ask | _Done = self.root
        for index, (name, (default, value)) in enumerate(reads):
            if not isinstance(node, _Ask) or (node.name, node.default) != (name, default):
                return
            following = node.answers.get(value)
            if following is None:
                node.answers[value] = _chain(reads[index + 1:], leaf)
                return
            node = following


def _chain(reads: list[tuple[str, tuple[object, object]]], leaf: _Ask | _Done) -> _Ask | _Done:
    """``reads`` as a branch of a ``_Memo`` ending in ``leaf``."""
    node = leaf
    for name, (default, value) in reversed(reads):
        node = _Ask(name, default, {value: node})
    return node


def _graph(chart: CompiledChart, limit: int,
           progress: Callable[[int, int], object] | None = None,
           every_s: float = 5.0) -> _Graph:
    """The configuration graph of ``chart``, explored once per compiled chart while that chart
    lives (breadth-first from the initial configuration; ``limit`` configurations at most: a
    graph explored before under a higher bound is refused past this one as well).
    ``progress(explored, to_go)``: called at most every ``every_s`` seconds (``explore``)."""
    known = _GRAPHS.get(id(chart))
    if known is not None and known[0]() is chart:
        if len(known[1].edges) > limit:
            raise ValueError(_too_many(chart, limit))
        return known[1]
    rank = {state: i for i, state in enumerate(chart.states)}
    ordered = _order_decides(chart)
    # python-statemachine raises ``done.state.<id>`` itself, only for a state ``<id>`` of the
    # chart: a step never sends one, also one whose ``<id>`` names no state (a typo,
    # ``done_state_compilng``), which no run takes (``_never_raised`` names it)
    raised = {t.event for t in chart.transitions if t.event.startswith("done.state.")}
    inner = _macrostep_outcomes(chart)
    no_steps: tuple[_Edge, ...] = ()
    runs: dict[_Node, tuple[StatechartRun, int, tuple[_Edge, ...]]] = {}
    edges: dict[_Node, list[_Edge]] = {}
    entered: dict[str, tuple[int, tuple[_Edge, ...], str]] = {}
    #: state -> the first walk whose configuration holds it (preferred to one that enters it
    #: and leaves it within the macrostep: a walk's test asserts the state is active)
    held: dict[str, tuple[int, tuple[_Edge, ...], str]] = {}
    starts: list[_Start] = []
    frontier: deque[_Node] = deque()
    settled_into: dict[str, tuple[str, Mapping[str, bool]]] = {}
    # the start under every guard holding, then under outcomes that select (or refuse) each
    # guarded eventless or ``done.state`` transition: the start takes those too
    start_variants: deque[_Refinable] = deque(
        (variant, 0) for variant in _variants(MappingProxyType({}), inner))
    tried_starts: list[Mapping[str, bool]] = []
    while start_variants:
        start_outcomes, start_after = start_variants.popleft()
        if start_outcomes in tried_starts:
            continue
        tried_starts.append(start_outcomes)
        start = StatechartRun.skeleton(chart, start_outcomes)
        begun = _Start(start_outcomes, frozenset(t.id for t in start.taken_at_start),
                       _node(start, rank, ordered), start.state)
        if any((s.taken, s.node) == (begun.taken, begun.node) for s in starts):
            continue  # this start went as one before, whatever these outcomes
        # and a start stopping before each guarded transition this one took (refined only
        # where the start went a new way: refining every outcome that went one way again
        # made as many outcomes as subsets of a chain's guards)
        start_variants.extend(_stopping(start_outcomes, start.taken_at_start, (), start_after))
        if not start.configuration or _orphans(chart, start.configuration):
            raise ValueError(_emptied(chart, start.taken_at_start, None, (),
                                      start.configuration))
        starts.append(begun)
        for state in [*start.entered, *start.configuration]:
            entered.setdefault(state, (len(starts) - 1, (), start.state))
        for state in start.configuration:
            held.setdefault(state, (len(starts) - 1, (), start.state))
        if begun.node not in runs:
            runs[begun.node] = (start, len(starts) - 1, no_steps)
            frontier.append(begun.node)
    said = time.monotonic()
    while frontier:
        if progress is not None and time.monotonic() - said >= every_s:
            progress(len(runs) - len(frontier), len(frontier))
            said = time.monotonic()
        node = frontier.popleft()
        run, origin, steps = runs[node]
        out = edges.setdefault(node, [])
        # (the event sent, the outcomes that select its transition, an eventless transition
        # the run must take first or None)
        sends: list[tuple[Transition, Mapping[str, bool], Transition | None]] = []
        for record in run.candidates():
            if record.event in raised:  # only the chart raises it, within a macrostep
                continue
            selecting = _selected(chart, record, run.configuration)
            if selecting is None:  # the event takes another transition here, whatever the guards
                continue
            sends.append((record, selecting, None))
        # an eventless transition waiting here under other outcomes: the next event sent
        # under them takes it first, then that event's transition where it leads
        waiting: deque[tuple[Transition, Mapping[str, bool], int]] = deque(
            (eventless, enabling, 0) for eventless, enabling in _enabling(chart, run.configuration))
        tried_enabling: set[tuple[int, frozenset[tuple[str, bool]]]] = set()
        # what the runs from this node did (each run once per way the guards it reads answer)
        settles = _Memo()
        forces: dict[tuple[int, int], _Memo] = {}
        #: (id of a settling's transitions, id of the event's) -> both, and their ids
        steps_of: dict[tuple[int, int], tuple[list[Transition], frozenset[int]]] = {}
        settled_ways: set[tuple[int, frozenset[int], _Node]] = set()
        while waiting:
            eventless, enabling, settle_after = waiting.popleft()
            way = (eventless.id, _key(enabling))
            if way in tried_enabling:
                continue
            tried_enabling.add(way)
            settled, took, _ = _settled(run, settles, enabling)
            if eventless.id not in {t.id for t in took}:
                continue  # another eventless transition goes first under these
            settled_way = (eventless.id, frozenset(t.id for t in took),
                           _node(settled, rank, ordered))
            if settled_way in settled_ways:
                continue  # settled so before, whatever these outcomes
            settled_ways.add(settled_way)
            # and the settling stopping before each further guarded transition it took (a
            # state it leads to that two guarded eventless transitions leave: _stopping)
            waiting.extend((eventless, refined, position) for refined, position in _stopping(
                enabling, took, (eventless,), settle_after))
            where = run.state  # (once: each ``state`` makes the string anew)
            for state in settled.configuration:
                settled_into.setdefault(state, (where, enabling))
            for record in settled.candidates():
                if record.event in raised:
                    continue
                selecting = _selected(chart, record, settled.configuration, enabling)
                if selecting is not None:
                    sends.append((record, selecting, eventless))
        #: each way an event went from here -> the position its refinements began at
        went: dict[tuple[int, frozenset[int], _Node], int] = {}
        for record, selecting, first in sends:
            variants: deque[_Refinable] = deque(
                (variant, 0) for variant in _variants(selecting, inner))
            tried: set[frozenset[tuple[str, bool]]] = set()
            #: what the event did under ``selecting`` and the answers its runs read
            sent: tuple[tuple[Any, ...], dict[str, object] | None] | None = None
            while variants:
                outcomes, refine_after = variants.popleft()
                key = _key(outcomes)
                if key in tried:
                    continue
                tried.add(key)
                # python-statemachine runs the macrostep these outcomes enable before it takes
                # the event (``StatechartRun.force``): run once per way it reads the guards,
                # then the event from where it settled, once per settled run and its reads;
                # outcomes that answer what the run under ``selecting`` read as it did (almost
                # every variant: ``_variants`` merges outcomes for every guarded transition of
                # the chart) go its way without a lookup
                if sent is not None and _alike(outcomes, selecting, sent[1]):
                    settled, before, twin, rest, after = sent[0]
                else:
                    settled, before, reads = _settled(run, settles, outcomes)
                    twin, rest, after, rest_reads = None, None, None, {}
                    if settled.running:
                        memo = forces.setdefault((id(settled), record.id), _Memo())
                        result = memo.find(outcomes)
                        if result is _UNKNOWN:
                            twin = settled.fork()
                            heard = _Heard(outcomes)
                            rest = twin.force(record, heard)
                            result = (twin, rest, None if rest is None
                                      else _node(twin, rank, ordered), _reads(heard))
                            memo.add(heard, result)
                        twin, rest, after, rest_reads = result
                    if sent is None:  # (the first outcomes tried are ``selecting``)
                        sent = ((settled, before, twin, rest, after),
                                _merged_reads(reads, rest_reads))
                if not settled.running or twin is None or rest is None or after is None:
                    continue  # another region's transition preempts it under these
                joined = steps_of.get((id(before), id(rest)))
                if joined is None:
                    forced = [*before, *rest]
                    joined = steps_of[(id(before), id(rest))] = (
                        forced, frozenset(t.id for t in forced))
                forced, taken = joined
                if first is not None and first.id not in taken:
                    continue  # under these the run does not take ``first`` before the event
                keep = (record,) if first is None else (record, first)
                refined_from = went.get((record.id, taken, after))
                if refined_from is not None:  # the same whatever these guards
                    if refine_after < refined_from:  # refined from further on only: the rest
                        variants.extend(_stopping(outcomes, forced, keep, refine_after,
                                                  refined_from))
                        went[(record.id, taken, after)] = refine_after
                    continue
                went[(record.id, taken, after)] = refine_after
                # and the macrostep stopping before each guarded transition it took (refined
                # only where it went a new way, as the start)
                variants.extend(_stopping(outcomes, forced, keep, refine_after))
                edge: _Edge = (record, taken, after, outcomes)
                path = (*steps, edge)
                if not twin.configuration or _orphans(chart, twin.configuration):
                    raise ValueError(_emptied(chart, forced, record, path, twin.configuration))
                reached = (origin, path, twin.state)
                for state in (*settled.entered, *twin.entered):
                    entered.setdefault(state, reached)
                for state in twin.configuration:
                    held.setdefault(state, reached)
                out.append(edge)
                if after not in runs:
                    if len(runs) >= limit:
                        raise ValueError(_too_many(chart, limit))
                    runs[after] = (twin, origin, path)
                    frontier.append(after)
    entered.update(held)
    graph = _Graph(tuple(starts), MappingProxyType(edges), MappingProxyType(entered),
                   MappingProxyType(rank), ordered, MappingProxyType(
                       {state: how for state, how in settled_into.items()
                        if state not in entered}))
    _GRAPHS[id(chart)] = (weakref.ref(chart, functools.partial(_forget, id(chart))), graph)
    return graph


def _settled(run: StatechartRun, memo: _Memo, outcomes: Mapping[str, bool]
             ) -> tuple[StatechartRun, list[Transition], dict[str, object] | None]:
    """A fork of ``run`` that ran the macrostep ``outcomes`` enable before a sent event
    (``StatechartRun.settle``), the transitions it took and the answers it read (``_reads``):
    from ``memo`` when a run from ``run`` read the same answers (``_Memo``; the fork is then
    shared: only read, or forked)."""
    known = memo.find(outcomes)
    if known is _UNKNOWN:
        settled = run.fork()
        heard = _Heard(outcomes)
        known = (settled, settled.settle(heard), _reads(heard))
        memo.add(heard, known)
    found: tuple[StatechartRun, list[Transition], dict[str, object] | None] = known
    return found


def _reads(heard: _Heard) -> dict[str, object] | None:
    """Name -> the answer a run read (None: it read the whole outcomes)."""
    return None if heard.whole else {name: value for name, (_, value) in heard.heard.items()}


def _merged_reads(one: dict[str, object] | None,
                  other: dict[str, object] | None) -> dict[str, object] | None:
    """The answers two runs under one outcomes read (None: either read the whole outcomes,
    or one name answered differently, read with other defaults)."""
    if one is None or other is None:
        return None
    merged = dict(one)
    for name, value in other.items():
        if merged.setdefault(name, value) != value:
            return None
    return merged


def _alike(outcomes: Mapping[str, bool], base: Mapping[str, bool],
           reads: dict[str, object] | None) -> bool:
    """Whether runs under ``outcomes`` read the answers runs under ``base`` read (``reads``),
    so go their way: ``outcomes`` holds ``base`` and answers each name they read as they
    did. Each run is decided by its node and the answers it reads, read in an order those
    answers decide."""
    if reads is None or any(name not in outcomes for name in base):
        return False
    for name, value in outcomes.items():
        if base.get(name) == value:
            continue
        read = reads.get(name, _UNKNOWN)
        if read is not _UNKNOWN and read != value:
            return False
    return True


def _orphans(chart: CompiledChart, configuration: Iterable[str]) -> list[str]:
    """The states of ``configuration`` whose parent state is not in it (``fault`` active
    without ``operating``): no configuration a chart is meant to be in."""
    active = set(configuration)
    states = _by_id(chart)
    return [state for state in configuration if state in states
            and getattr(states[state].parent, "id", None) not in (None, *active)]


def _emptied(chart: CompiledChart, forced: Sequence[Transition], sent: Transition | None,
             path: tuple[_Edge, ...], configuration: Iterable[str] = ()) -> str:
    """Why a step that leaves no state active, or states without their parent, is a
    declaration bug: python-statemachine enters nothing for a history state that has recorded
    nothing yet and declares no default (``h.to(state)``); its configuration is then empty,
    so the chart takes no event again, or, the history entered from inside its own compound
    (``fault.to(h)``, ``h`` of ``operating``), holds the states entered without the compound
    it exited (``fault,jammed`` without ``operating``). Names the history states the step's
    transitions target and the walk to it."""
    configuration = list(configuration)
    orphans = _orphans(chart, configuration)
    if orphans:
        states = _by_id(chart)
        parents = dict.fromkeys(str(getattr(states[state].parent, "id", "")) for state in orphans)
        left = (f"leaves {','.join(configuration)} active without {', '.join(parents)} (the "
                f"parent state of {', '.join(orphans)})")
        outcome = (f"its configuration then holds {', '.join(orphans)} without "
                   f"{', '.join(parents)}")
    else:
        left, outcome = "leaves no state active", ("its configuration is empty and it takes "
                                                   "no event again")
    empty = [f"{target.id!r} of {getattr(target.parent, 'id', None)!r}"  # (a history has one)
             for taken in forced if taken.id < len(chart.declared)
             for target in chart.declared[taken.id].targets
             if target.is_history and not target.transitions]
    where = (f"{_describe(sent)} (walk: {' '.join(step[0].event for step in path)})"
             if sent is not None else "the chart's start")
    why = (f"it enters history state {', '.join(dict.fromkeys(empty))} before anything was "
           f"recorded there, and no default is declared: python-statemachine then enters "
           f"nothing, {outcome}; declare the default (`h.to(<state>)`) or reach the history "
           f"only after its state was left"
           if empty else f"python-statemachine's configuration is then "
                         f"{'that' if orphans else 'empty'}")
    return f"{chart.name}: {where} {left}: {why}"


def _too_many(chart: CompiledChart, limit: int) -> str:
    """Why ``_graph`` stops: more than ``limit`` nodes, naming what multiplies
    them (the history states: a node is the active states *and* what each history recorded)
    and what still takes the chart."""
    histories = [str(h.id) for state in chart.declaration.states_map.values()
                 for h in getattr(state, "history", ()) or ()]
    parallel = [str(state.id) for state in chart.declaration.states_map.values()
                if state.parallel]
    causes = []
    if parallel:
        causes.append(f"the states of the regions of its {len(parallel)} parallel state(s) "
                      f"{_shown(parallel)} combine")
    if len(histories) == 1:  # (until stop 72 "each of the chart's 1 history states ...;
        # their combinations multiply", of one history)
        causes.append(f"a configuration is the active states and what the chart's history "
                      f"state {histories[0]} recorded")
    elif histories:
        causes.append(f"a configuration is the active states and what each of the chart's "
                      f"{len(histories)} history states recorded: {_shown(histories)}; their "
                      f"combinations multiply")
    why = f" ({'; '.join(causes)})" if causes else ""
    return (f"{chart.name}: more than {limit} configurations reachable{why}; "
            f"paths are not enumerated (raise the bound: `calexec charts paths "
            f"--max-configurations N`, max_configurations=N; charts draw, cover and mutate "
            f"still take the chart; or drive its tests with a model of your own)")


def _shown(names: list[str]) -> str:
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")


def _from(graph: _Graph, node: _Node, at_start: frozenset[int] = frozenset()
          ) -> tuple[dict[_Node, tuple[_Edge, ...]], dict[int, tuple[tuple[_Edge, ...], _Node]]]:
    """Breadth-first over ``graph`` from ``node``: the shortest edges to every node, and for
    every transition the shortest edges that take it with the node they end in.
    ``at_start``: ``node`` is where a start that took these transitions ended (they are
    taken with no step)."""
    reach: dict[_Node, tuple[_Edge, ...]] = {node: ()}
    first: dict[int, tuple[tuple[_Edge, ...], _Node]] = {}
    first.update((transition_id, ((), node)) for transition_id in at_start)
    frontier = deque([node])
    while frontier:
        here = frontier.popleft()
        for edge in graph.edges.get(here, ()):
            _, taken, after, _ = edge
            path = (*reach[here], edge)
            for transition_id in taken:
                first.setdefault(transition_id, (path, after))
            if after not in reach:
                reach[after] = path
                frontier.append(after)
    return reach, first


def _from_starts(graph: _Graph) -> dict[int, tuple[int, tuple[_Edge, ...]]]:
    """Transition id -> (index of the start, the shortest edges from it that take the
    transition): the fewest steps of any start, the start where every guard holds first."""
    found: dict[int, tuple[int, tuple[_Edge, ...]]] = {}
    for index, start in enumerate(graph.starts):
        _, first = _from(graph, start.node, start.taken)
        for transition_id, (edges, _end) in first.items():
            known = found.get(transition_id)
            if known is None or len(edges) < len(known[1]):
                found[transition_id] = (index, edges)
    return found


def _steps(edges: tuple[_Edge, ...]) -> tuple[tuple[Transition, ...], tuple[Mapping[str, bool], ...]]:
    """The sent transitions of ``edges`` and the named guard outcomes of each."""
    return tuple(e[0] for e in edges), tuple(_named(e[3]) for e in edges)


def _walk(edges: tuple[_Edge, ...], end: str, start: _Start | None = None) -> Walk:
    if start is None or not start.outcomes:
        return Walk(*_steps(edges), end)
    return Walk(*_steps(edges), end, start.outcomes, start.state)


def _never_raised(chart: CompiledChart, graph: _Graph) -> str:
    """``" (done.state.x is raised only when ...)"`` for the ``done.state`` events of
    transitions no reachable configuration takes (their state never completes, or is no
    state of the chart: a typo, named with the state it resembles), or ``""``."""
    first = _from_starts(graph)
    events = list(dict.fromkeys(t.event for t in chart.transitions
                                if t.id not in first and t.event.startswith("done.state.")))
    if not events:
        return ""
    known = [e for e in events if e.removeprefix("done.state.") in chart.states]
    reasons = []
    if known:
        states = ", ".join(e.removeprefix("done.state.") for e in known)
        reasons.append(f"{', '.join(known)}: raised only when {states} reaches a final child "
                       f"state, in every region of a parallel state; no path does")
    for event in (e for e in events if e not in known):
        name = event.removeprefix("done.state.")
        close = difflib.get_close_matches(name, chart.states, n=1)
        reasons.append(
            f"{event}: {chart.name} has no state {name!r}"
            f"{f' (did you mean {close[0]!r}?)' if close else ''}, and python-statemachine "
            f"raises done.state.<id> only for a compound or parallel state <id> of the chart "
            f"as it completes: no run takes it (name the state: "
            f"done_state_{(close[0] if close else '<id>').replace('.', '_')})")
    return f" ({'; '.join(reasons)})"


def _configuration_walks(chart: CompiledChart, limit: int) -> dict[str, Walk]:
    graph = _graph(chart, limit)
    entered = graph.entered
    missing = [state for state in chart.states if state not in entered]
    if missing:
        into = [t for t in chart.transitions if t.target in missing]
        raise ValueError(f"{chart.name}: state(s) {', '.join(missing)} never entered from "
                         f"{chart.initial}{_never_raised(chart, graph)}"
                         f"{_left_at_once(chart, into)}{_settled_only(graph, missing)}")
    _refuse_out_of_finals(chart, graph)
    return {state: _walk(entered[state][1], entered[state][2], graph.starts[entered[state][0]])
            for state in chart.states}


def _settled_only(graph: _Graph, missing: list[str]) -> str:
    """Why states of ``missing`` that a run enters by eventless transitions alone (before an
    event that then takes no transition) have no path."""
    found = [state for state in dict.fromkeys(missing) if state in graph.settled_only]
    if not found:
        return ""
    state = found[0]
    source, outcomes = graph.settled_only[state]
    shown = ", ".join(name if value else f"!{name}" for name, value in outcomes.items())
    them = "them" if len(found) > 1 else "it"
    return (f" by a step that takes a transition ({', '.join(found)}: entered only as a run in "
            f"{source} takes eventless transitions before the next event sent, under [{shown}] "
            f"for {state}, and that event then takes no transition there: a path is made of "
            f"transitions taken, so none ends there; test {them} with a model of your own "
            f"that answers so in {source}, sending any event)")


def _configuration_paths(chart: CompiledChart, limit: int) -> list[Path]:
    graph = _graph(chart, limit)
    first = _from_starts(graph)
    never = [t for t in chart.transitions if t.id not in first]
    if never:
        raise ValueError(f"{chart.name}: transition(s) {', '.join(map(_describe, never))} "
                         f"taken from no reachable configuration{_never_raised(chart, graph)}"
                         f"{_only_at_start(chart, graph, never)}{_left_at_once(chart, never)}"
                         f"{_left_first(chart, graph, never)}"
                         f"{_settled_only(graph, [t.target for t in never])}")
    _refuse_out_of_finals(chart, graph)
    paths = []
    for transition in chart.transitions:
        index, edges = first[transition.id]
        start = graph.starts[index]
        end = _walk_end(chart, graph, edges, start)
        paths.append(Path(transition, *_steps(edges), start.outcomes, start.state, end=end)
                     if start.outcomes else Path(transition, *_steps(edges), end=end))
    return paths


def _refuse_out_of_finals(chart: CompiledChart, graph: _Graph) -> None:
    """Raise ``ValueError`` naming the transitions out of a final child state that a run can
    take (those it never takes are named by ``_left_at_once``): entering the child raises
    ``done.state`` of its compound, which says the compound is done, and the transition then
    takes the compound on, so "final" is untrue (SCXML's ``<final>`` declares no transition;
    python-statemachine refuses one out of the chart's own final states only)."""
    states = _by_id(chart)
    taken = _from_starts(graph)
    found: dict[tuple[str, str], list[Transition]] = {}
    for transition in chart.transitions:
        final = states.get(transition.source) if transition.id in taken else None
        if final is not None and final.final and final.parent is not None:
            found.setdefault((str(final.id), str(final.parent.id)), []).append(transition)
    if not found:
        return
    reasons = []
    for (final_id, parent), transitions in found.items():
        reasons.append(
            f"{', '.join(map(_describe, transitions))} out of {final_id}, a final state of "
            f"{parent}: entering {final_id} raises done.state.{parent} (the compound is done), "
            f"yet {'this transition takes' if len(transitions) == 1 else 'these transitions take'}"
            f" {parent} on from there, so {final_id} is no final state (make {final_id} no "
            f"final state, or drop the transition)")
    raise ValueError(f"{chart.name}: transition(s) {'; '.join(reasons)} (SCXML's <final> "
                     f"declares no transition; python-statemachine refuses one only out of the "
                     f"chart's own final states)")


def _left_at_once(chart: CompiledChart, never: list[Transition]) -> str:
    """Why a transition out of a final child state is in ``never`` when its compound is left
    by an unguarded ``done.state`` transition: entering the child raises the event, which that
    transition takes in the same macrostep (python-statemachine refuses a transition out of a
    final state of the chart itself, not of a compound)."""
    states = _by_id(chart)
    reasons = []
    for transition in never:
        final = states.get(transition.source)
        parent = getattr(final, "parent", None)
        if final is None or not final.final or parent is None:
            continue
        ancestors, up = [], parent
        while up is not None:
            ancestors.append(up.id)
            up = up.parent
        event = f"done.state.{parent.id}"
        leaving = next((t for t in chart.transitions if t.event == event
                        and t.source in ancestors and not t.conds and not t.unless), None)
        if leaving is not None:
            reasons.append(f"; {_describe(transition)}: out of {final.id}, a final state of "
                           f"{parent.id}: entering it raises {event}, and {_describe(leaving)} "
                           f"leaves {leaving.source} at once, so no transition out of "
                           f"{final.id} is taken (make {final.id} no final state, or drop the "
                           f"transition)")
    return "".join(dict.fromkeys(reasons))


def _left_first(chart: CompiledChart, graph: _Graph, never: list[Transition]) -> str:
    """Why a transition out of a state the chart does reach is in ``never``: an eventless
    transition of that state (or of an ancestor) needs no outcome the transition does not need
    too (``fire = loaded.to(empty, unless="has_ammo")`` beside ``loaded.to(empty,
    unless="has_ammo")``), so under the outcomes that select the transition python-statemachine
    takes the eventless one first, before the event, and the state is left."""
    states = _by_id(chart)
    reasons = []
    for transition in never:
        if not transition.event or transition.source not in graph.entered:
            continue
        ancestors, up = [], states.get(transition.source)
        while up is not None:
            ancestors.append(up.id)
            up = up.parent
        first = next((t for t in chart.transitions if not t.event and t.source in ancestors
                      and set(t.conds) <= set(transition.conds)
                      and set(t.unless) <= set(transition.unless)), None)
        if first is not None:
            needs = f" ({', '.join(transition.guards)})" if transition.guards else ""
            guards = f" [{', '.join(first.guards)}]" if first.guards else ""
            eventless = f"{first.source} --(eventless){guards}--> {first.target}"
            reasons.append(
                f"; {_describe(transition)}: {transition.source} is reached, but under the "
                f"outcomes {transition.event} needs{needs} the eventless {eventless} "
                f"leaves {first.source} first (python-statemachine takes eventless transitions "
                f"before the event), so no run takes it (drop it, or guard it apart)")
    return "".join(dict.fromkeys(reasons))


def _only_at_start(chart: CompiledChart, graph: _Graph, never: list[Transition]) -> str:
    """Why a transition out of a state the chart's start enters and at once leaves by a
    guarded eventless transition may be in ``never``: the start selects that one before any
    step, and no start explored (every guard holding, or outcomes selecting or refusing one
    guarded eventless transition at a time, then stopping short of each one it took:
    ``_stopping``) selects it."""
    leaving = [chart.transitions[i] for i in sorted(graph.at_start)]
    reasons = []
    for transition in never:
        if graph.entered.get(transition.source, (0, (None,), ""))[1] != ():
            continue
        left = next((t for t in leaving if t.source == transition.source and not t.event
                     and (t.conds or t.unless)), None)
        if left is not None:
            reasons.append(f"; {_describe(transition)}: out of {transition.source}, which the "
                           f"chart's start enters and leaves at once by {_describe(left)} "
                           f"(no start paths explore takes it: they set outcomes before the "
                           f"start selecting or refusing one guarded eventless transition at "
                           f"a time, then stopping short of each one it took): drive it with a "
                           f"model of your own")
    return "".join(reasons)


def _configuration_tour(chart: CompiledChart, limit: int) -> list[Walk]:
    """Walks from the initial configuration that together take every transition: each goes
    on by the shortest steps to the nearest transition not taken yet, until none is
    reachable; then the next walk starts over."""
    graph = _graph(chart, limit)
    # first the walks to every other transition; then, if none of them began where every
    # guard holds (each begins with a start step refusing a guarded transition the chart takes
    # as it starts: it takes none of those), a walk of no step from there, which takes them
    untaken = {t.id for t in chart.transitions} - graph.at_start
    started: set[int] = set()  # the transitions the starts of the walks took
    walks: list[Walk] = []
    while untaken or graph.at_start - started:
        if not untaken:
            untaken = set(graph.at_start - started)
        # the start nearest a transition not taken yet (where every guard holds on a tie)
        nearest_start: tuple[int, int] | None = None
        for index, begun in enumerate(graph.starts):
            _, first = _from(graph, begun.node, begun.taken)
            near = min((len(first[i][0]) for i in untaken if i in first), default=None)
            if near is not None and (nearest_start is None or near < nearest_start[0]):
                nearest_start = (near, index)
        if nearest_start is None:
            names = ", ".join(_describe(chart.transitions[i]) for i in sorted(untaken))
            raise ValueError(f"{chart.name}: transition(s) {names} cannot be toured")
        start = graph.starts[nearest_start[1]]
        took = untaken & start.taken
        untaken -= start.taken
        started |= start.taken
        node, steps = start.node, list[_Edge]()
        while True:
            _, first = _from(graph, node)
            nearest = min(((len(first[i][0]), i) for i in untaken if i in first), default=None)
            if nearest is None:
                break
            path, _end = first[nearest[1]]
            for edge in path:  # follow the path edge by edge: what each step takes
                untaken.difference_update(edge[1])
                node = edge[2]
            steps.extend(path)
        if not steps and not took:
            names = ", ".join(_describe(chart.transitions[i]) for i in sorted(untaken))
            raise ValueError(f"{chart.name}: transition(s) {names} cannot be toured")
        walks.append(_walk(tuple(steps), _walk_end(chart, graph, tuple(steps), start), start))
    return walks


def _walk_end(chart: CompiledChart, graph: _Graph, steps: tuple[_Edge, ...],
              start: _Start) -> str:
    """The configuration a run that follows ``steps`` (edges) from ``start`` ends in,
    ``"a,b"`` in the order that run lists it: a node holds its states as a set, and the walk
    may reach it by another order of events than the run that explored it first."""
    run = StatechartRun.skeleton(chart, start.outcomes)
    for step, _, _, outcomes in steps:
        run.force(step, outcomes)
    node = steps[-1][2] if steps else start.node
    if _node(run, graph.rank, graph.ordered) != node:  # the graph merged runs that differ
        raise RuntimeError(f"{chart.name}: the walk {' '.join(s[0].event for s in steps)} ends in "
                           f"{run.state}, not in the configuration its graph says")
    return run.state


#: One step of ``as_data``'s walks: ``event`` sent from ``from`` to ``to`` after setting the
#: guard outcomes ``guards``; a start step has ``event`` and ``from`` None. (Spelled as a call:
#: ``from`` is a Python keyword.)
#: A step into a history state (``paused --resume--> h``) has ``to`` the state(s) it re-enters
#: there (what the history recorded, ``a,b`` for a deep one's; its default's target when it
#: recorded nothing) and ``via`` the history, as the live inspector shows a followed run's.
PathStep = TypedDict("PathStep", {"event": str | None, "from": str | None, "to": str,
                                  "guards": dict[str, bool], "via": NotRequired[str]})
#: One transition of ``as_data``: the transition and the steps of its shortest path.
TransitionData = TypedDict("TransitionData", {"event": str, "from": str, "to": str,
                                              "guards": list[str], "path": list[PathStep]})


class PathEnds(TypedDict):
    """``as_data``'s ``ends``: the configuration each walk ends in (``"a,b"``)."""

    states: dict[str, str]
    transitions: list[str]
    tour: list[str]


class PathsLeftOut(TypedDict):
    """``as_data``'s ``left_out`` (only with ``max_steps``, when some path did not fit): the
    bound, the states whose walk was left out, how many transitions' paths and tour walks
    were, and how many steps they had in all."""

    max_steps: int
    states: list[str]
    transitions: int
    tour: int
    steps: int


#: ``as_data(chart)``: the chart's paths as JSON-ready data (see there).
PathsData = TypedDict("PathsData", {
    "chart": str, "class": str, "initial": str, "finals": list[str],
    "states": dict[str, list[PathStep]], "transitions": list[TransitionData],
    "tour": list[list[PathStep]], "ends": PathEnds, "left_out": NotRequired[PathsLeftOut]})

#: ``calexec charts paths``' default ``--max-steps``: the most steps it writes (about 2 MB of
#: JSON, 120 kB of text). Every path starts from the initial state, so a chain of N states
#: has N paths of up to N steps: a 1000-state chain's were 1.1 million steps, 120 MB of JSON
#: (about 110 bytes a step)
MAX_STEPS = 20_000


def _walk_steps(walk: Path | Walk) -> int:
    """The steps ``as_data`` writes for ``walk`` (a start step counted)."""
    return len(walk.steps) + (1 if walk.start else 0)


def _kept(walks: Sequence[Path | Walk], first: int, max_steps: int | None) -> list[bool]:
    """Which of ``walks`` fit in ``max_steps`` steps in all (None: every one): the last
    ``first`` of them (the tour, which takes every transition in the fewest walks) first,
    in their order, then the shortest first (ties in their order): the most paths that fit,
    a long one left out whole."""
    if max_steps is None:
        return [True] * len(walks)
    kept = [False] * len(walks)
    left = max_steps
    tour = range(len(walks) - first, len(walks))
    for i in [*tour, *sorted(range(len(walks) - first), key=lambda i: _walk_steps(walks[i]))]:
        cost = _walk_steps(walks[i])
        if cost <= left:
            kept[i], left = True, left - cost
        elif i not in tour:
            break  # (the others are no shorter)
    return kept


def _steps_data(walk: Path | Walk, chart: CompiledChart) -> list[PathStep]:
    """The steps of ``walk``, after a start step (``"event": None``, the outcomes to set
    before the chart starts and the configuration it starts in) when it needs one."""
    start: list[PathStep] = [] if not walk.start else [
        {"event": None, "from": None, "to": walk.started, "guards": dict(walk.start)}]
    steps: list[PathStep] = [{"event": step.event, "from": step.source, "to": step.target,
                              "guards": dict(outcomes)}
                             for step, outcomes in zip(walk.steps, walk.guards)]
    defaults = _history_defaults(chart)
    if any(step.target in defaults for step in walk.steps):
        # (until stop 61 ``to`` was the history pseudo-state, which no configuration holds)
        run = StatechartRun.skeleton(chart, walk.start)
        for step, outcomes, data in zip(walk.steps, walk.guards, steps):
            if step.target in defaults:
                recorded = [str(s.id) for s in run.history_values.get(step.target, ())]
                data["to"] = ",".join(recorded or defaults[step.target])
                data["via"] = step.target
            if run.force(step, outcomes) is None:  # (the walk's own steps: never)
                break
    return start + steps


def _history_defaults(chart: CompiledChart) -> dict[str, list[str]]:
    """History state id -> the targets of its default transitions (none declared: [])."""
    found: dict[str, list[str]] = {
        str(h.id): [] for state in chart.declaration.states_map.values()
        for h in getattr(state, "history", ()) or ()}
    for transition in chart.transitions:
        if transition.source in found:
            found[transition.source].append(transition.target)
    return found


def as_data(chart: ChartLike, max_configurations: int | None = None,
            max_steps: int | None = None) -> PathsData:
    """The paths of ``chart`` as JSON-ready data: ``states`` (state -> steps of its shortest
    walk), ``transitions`` (one entry per transition with the steps of its shortest path) and
    ``tour`` (a list of walks, each a list of steps); a step is ``{"event", "from", "to",
    "guards"}`` with ``guards`` the outcomes to set before sending ``event``. A walk with a
    ``start`` begins with a start step, ``{"event": None, "from": None, "to": <the
    configuration the start ends in>, "guards": <outcomes to set before the chart starts>}``.
    ``ends``: the configuration each of those ends in, ``"a,b"`` (``Walk.end``, ``Path.end``):
    ``{"states": {state: end}, "transitions": [end, ...], "tour": [end, ...]}`` in the order
    of ``states``, ``transitions`` and ``tour``. ``max_configurations``: as
    :func:`transition_paths`'. ``max_steps`` (an int >= 1; None, the default: no bound): the
    most steps written in all, the tour's walks kept first (they take every transition in the
    fewest steps), then the shortest walks to a state or of a transition, a walk that does not
    fit left out whole, with its ``ends`` entry; ``left_out`` then says what was
    (:class:`PathsLeftOut`). Every walk starts from the initial state, so a chain of N states
    has about N**2 steps (``calexec charts paths`` bounds them, ``--max-steps``)."""
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int)
                                  or max_steps < 1):
        raise ValueError(f"max_steps={max_steps!r}: expected an int >= 1 or None (no bound)")
    chart = compiled(chart)
    walks = state_paths(chart, max_configurations)
    paths = transition_paths(chart, max_configurations)
    tour = transition_tour(chart, max_configurations)
    named = list(walks.items())
    everything: list[Path | Walk] = [*(walk for _, walk in named), *paths, *tour]
    kept = _kept(everything, len(tour), max_steps)
    keep_states = kept[:len(named)]
    keep_paths = kept[len(named):len(named) + len(paths)]
    keep_tour = kept[len(named) + len(paths):]
    data: PathsData = {
        "chart": chart.name,
        "class": reference(chart.declaration),
        "initial": chart.initial,
        "finals": sorted(chart.finals),
        "states": {state: _steps_data(walk, chart)
                   for (state, walk), keep in zip(named, keep_states) if keep},
        "transitions": [{"event": p.transition.event, "from": p.transition.source,
                         "to": p.transition.target, "guards": list(p.transition.guards),
                         "path": _steps_data(p, chart)}
                        for p, keep in zip(paths, keep_paths) if keep],
        "tour": [_steps_data(walk, chart) for walk, keep in zip(tour, keep_tour) if keep],
        "ends": {"states": {state: walk.end
                            for (state, walk), keep in zip(named, keep_states) if keep},
                 "transitions": [p.end for p, keep in zip(paths, keep_paths) if keep],
                 "tour": [walk.end for walk, keep in zip(tour, keep_tour) if keep]},
    }
    if max_steps is not None and not all(kept):
        data["left_out"] = {
            "max_steps": max_steps,
            "states": [state for (state, _), keep in zip(named, keep_states) if not keep],
            "transitions": keep_paths.count(False), "tour": keep_tour.count(False),
            "steps": sum(_walk_steps(walk) for walk, keep in zip(everything, kept)
                         if not keep)}
    return data


class GuardTable:
    """A model for driving bare charts: guard ``name`` returns ``outcomes.get(name, default)``.

    Build one with ``GuardTable.for_chart(chart)``: python-statemachine resolves guard names
    on the model when an instance is created, so the guards must exist as methods; so must
    the validators and actions the chart names on its model (``model_callbacks``), which the
    table answers with a no-op (a path sets guards only: a validator passes, an action does
    nothing).
    ``strict=True`` (of ``for_chart``): outcomes naming no guard of the chart (a typo) are a
    ``ValueError`` naming them, except in a process whose chart a mutant changed.
    """

    #: set by ``for_chart`` on the class it makes: the chart's name and the names its guards
    #: read (None: a table made without a chart, which cannot be strict)
    _calexec_chart: str | None = None
    _calexec_guards: frozenset[str] | None = None
    _calexec_declaration: type | None = None

    def __init__(self, outcomes: Mapping[str, bool] | None = None, default: bool = True,
                 strict: bool = False) -> None:
        if not isinstance(strict, bool):
            raise TypeError(f"GuardTable: strict={strict!r}: expected True or False")
        if not isinstance(default, bool):  # (None would answer every guard not set: False)
            raise TypeError(f"GuardTable: default={default!r}: expected True or False (what a "
                            f"guard the outcomes do not name answers)")
        if strict and self._calexec_guards is None:
            raise ValueError("GuardTable: strict=True needs the chart whose guards it checks: "
                             "GuardTable.for_chart(chart, strict=True)")
        self._strict = strict
        self.outcomes = {} if outcomes is None else outcomes
        self._default = default

    @property
    def outcomes(self) -> dict[str, bool]:
        """Guard name -> what it answers (a step's ``guards``); set to a mapping (anything
        else is a ``TypeError`` naming it). A name that is no guard of the chart is taken:
        under a chart mutant the guard a test sets may be gone from the chart (forced,
        dropped), and refusing it would kill the mutant for the wrong reason. A strict table
        (``for_chart(chart, strict=True)``) refuses it, a ``ValueError`` naming it, unless a
        mutant changed the chart in this process (``mutants.mutated``): the unmutated run
        that ``charts mutate`` makes first has refused a typo already."""
        return self._outcomes

    @outcomes.setter
    def outcomes(self, value: Mapping[str, bool]) -> None:
        if not isinstance(value, Mapping):
            raise TypeError(f"GuardTable: outcomes={value!r:.80}: expected a mapping of guard "
                            f"name -> bool (a step's 'guards')")
        if self._strict:
            self._refuse_unknown(value)
        self._outcomes: dict[str, bool] = dict(value)

    def _refuse_unknown(self, value: Mapping[str, bool]) -> None:
        known = self._calexec_guards or frozenset()
        unknown = [name for name in value if name not in known]
        if not unknown or mutants.mutated(self._calexec_declaration):
            return
        name = unknown[0]
        close = difflib.get_close_matches(str(name), sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"GuardTable for {self._calexec_chart}: outcomes name {name!r}, no guard of the "
            f"chart{hint}; its guards read {', '.join(sorted(known)) or 'no name'}")

    @property
    def default(self) -> bool:
        """What a guard not named in ``outcomes`` answers. (A property, not an attribute of
        the instance: a chart's guard named ``default`` is a method of ``for_chart``'s class,
        which an instance attribute would hide, and python-statemachine would read it.)"""
        return self._default

    @default.setter
    def default(self, value: bool) -> None:
        self._default = value

    @classmethod
    def for_chart(cls, chart: ChartLike, **kwargs: object) -> GuardTable:
        """An instance whose class has one method per guard name of ``chart``. A guard named
        ``outcomes`` (the table a test sets) is a ``ValueError`` naming it and its transition:
        no model can answer both. ``kwargs``: ``outcomes``, ``default``, ``strict``."""
        chart = compiled(chart)
        every = {name for t in chart.transitions for text in t.conds + t.unless
                 for name in _guard_names(text)}
        names_read = chart.guard_names | every
        if "outcomes" in names_read:
            where = next(t for t in chart.transitions
                         if any("outcomes" in _guard_names(text) or text == "outcomes"
                                for text in t.conds + t.unless))
            raise ValueError(
                f"GuardTable.for_chart({chart.name}): guard 'outcomes' on transition "
                f"{_describe(where)} has the name of the table a test sets "
                f"(model.outcomes = step['guards']); rename the guard, or drive the chart "
                f"with a model of your own")
        methods: dict[str, object] = {name: _no_op(name)
                                      for name in model_callbacks(chart.declaration)}
        methods.update({name: _guard_method(name) for name in sorted(names_read)})
        methods.update(_calexec_chart=chart.name, _calexec_guards=frozenset(names_read),
                       _calexec_declaration=chart.declaration)
        table: GuardTable = type(f"{cls.__name__}_{chart.name}", (cls,), methods)(**kwargs)
        return table


def _guard_names(text: str) -> tuple[str, ...]:
    """The names a guard's text reads (none for an expression no path can set)."""
    try:
        return names(text)
    except UnsettableGuard:
        return ()


def _no_op(name: str) -> Callable[..., None]:
    """A validator or action the chart names on its model: a path sets guards only, so on a
    ``GuardTable`` a validator passes and an action does nothing."""
    def callback(self: GuardTable, *args: object, **kwargs: object) -> None:
        return None

    callback.__name__ = name
    return callback


def _guard_method(name: str) -> Callable[[GuardTable], bool]:
    def guard(self: GuardTable) -> bool:
        return self._outcomes.get(name, self._default)

    guard.__name__ = name
    return guard


class PathNotFollowed(ChartTransitionError):
    """A run that did not take a step of the path ``drive`` sent it: ``chart``, ``step`` (its
    number, from 1), ``transition`` (``source --event--> target``) and ``state`` (where the
    run is). A :class:`ChartTransitionError`: since stop 71 ``drive`` raises it, not the run's
    own error (its ``__cause__``), for a step the run refused, and code catching the base
    around ``drive`` still catches it."""

    def __init__(self, chart: str, step: int, steps: int, transition: Transition,
                 state: str, why: str | None = None) -> None:
        self.chart, self.step, self.state = chart, step, state
        self.transition = _describe(transition)
        why = why or ("a StateChart ignores a refused event and turns an action's error into "
                      "error.execution")
        super().__init__(
            f"{chart}: step {step} of {steps}, {self.transition}, was not taken: the run is in "
            f"{state!r} ({why})")


def _unheard(declaration: type, outcomes: Mapping[str, bool]) -> str | None:
    """Why a run cannot hear ``outcomes`` set on its model: the names among them that are
    methods (or properties) of the chart class itself, or of a base of the user's, which
    python-statemachine asks before the model; None when there are none."""
    found = {}
    for name in outcomes:
        for klass in declaration.__mro__:
            if klass is object or klass.__module__.split(".")[0] == "statemachine":
                continue
            value = vars(klass).get(name)
            if callable(value) or isinstance(value, property):
                found[name] = klass.__name__
                break
    if not found:
        return None
    listed = ", ".join(f"{name!r} (of {owner})" for name, owner in found.items())
    return (f"guard(s) {listed} are methods of the chart class, which python-statemachine asks "
            f"before the model: the outcomes the step set on the model were not heard; move "
            f"them to the model, or drive the chart with a model of your own")


def drive(run: ChartRun | StatechartRun, path: Path | Walk) -> str:
    """Send ``path``'s events to ``run`` (whose model is a ``GuardTable``), setting each step's
    guard outcomes first; return the final state. Raises ``PathNotFollowed`` when the run did
    not take a step's transition (``StateChart`` semantics refuse quietly) or refused it
    (``IllegalTransition``, ``GuardRejected``: its ``__cause__``, its text in the message;
    raised bare until stop 71), and as ``send`` does for an error a validator, guard or
    action raises (a note naming the step added). A path with a ``start`` needs a run started under it:
    ``chart.run(GuardTable.for_chart(chart, outcomes=path.start))`` (the start reads the model
    as the chart starts).

    A step counts as taken when the chart's ``taken`` counter of its transition moved during
    the ``send``: another run of the same chart taking it at that moment (another thread)
    would count too."""
    if not isinstance(path, (Path, Walk)):  # (an event name, a step's dict of as_data)
        raise TypeError(f"drive(run, path={path!r:.60}): expected a Path or Walk (from "
                        f"transition_paths, state_paths or transition_tour); as_data's steps "
                        f"are sent one by one, as docs/framework.md shows")
    if not isinstance(run, (ChartRun, StatechartRun)):
        raise TypeError(_not_a_run(run))
    chart = run.chart
    model: Any = run.model  # a GuardTable, or a model of the user's with ``outcomes``
    #: why a later step may be missed: the last step whose send took transitions on events no
    #: step sent (the chart's own callbacks sent or raised them; paths run no callback)
    strayed: str | None = None
    #: where the run was when drive began: a run restored from its model's saved state, made
    #: with ``state=``, or driven through a path before is not where every path starts
    began = run.state
    for number, (step, outcomes) in enumerate(zip(path.steps, path.guards, strict=True), 1):
        model.outcomes = dict(outcomes)
        # (a ChartRun counts into its ``tally``: the chart's ``taken`` unless its owner's own)
        counted = run.tally if isinstance(run, ChartRun) else chart.taken
        before = counted[step.id]
        counts = list(counted)
        try:
            run.send(step.event)
        except ChartTransitionError as err:  # (until stop 71 re-raised bare: no step named)
            why = (_unheard(chart.declaration, outcomes) or strayed
                   or _began_elsewhere(run, path, began))
            raise PathNotFollowed(
                chart.name, number, len(path.steps), step, run.state,
                f"{type(err).__name__}: {err}" + (f"; {why}" if why else "")) from err
        except Exception as err:  # a validator, guard or action of the chart raised
            if (isinstance(err, AttributeError) and isinstance(model, GuardTable)
                    and getattr(err, "obj", None) is model and err.name):
                # (a callback reading the model's data: until stop 72 the note blamed event
                # data, which drive does not send, for `self.model.retries += 1`)
                why = (f"a callback read the model's {err.name!r}, which a GuardTable does not "
                       f"have: it answers the chart's guards (and the validators and actions "
                       f"the chart names on the model, as no-ops) only; drive it with a model "
                       f"of your own, a subclass of the table that has {err.name!r} too")
            else:
                why = ("drive sends each event with no data, so a validator or callback that "
                       "needs some cannot be driven with a GuardTable; drive it with a model "
                       "of your own")
            err.add_note(f"(raised by step {number} of {len(path.steps)} of a {chart.name} "
                         f"path, {_describe(step)}: {why})")
            raise
        if counted[step.id] == before:
            raise PathNotFollowed(chart.name, number, len(path.steps), step, run.state,
                                  _unheard(chart.declaration, outcomes)
                                  or strayed or _began_elsewhere(run, path, began))
        sent = _sent_by_the_chart(chart, step, counts, counted)
        errors = _taken_on_errors(chart, step, counts, counted)
        if errors:  # (until stop 75 only the generic "turns an action's error into ...")
            strayed = (f"the send of step {number}, {_describe(step)}, also took "
                       f"{'; '.join(_describe(t) for t in errors)}: a callback of the chart "
                       f"raised during that send and python-statemachine "
                       f"(catch_errors_as_events) sent the error as an event; paths run no "
                       f"callback, so they do not follow it: drive this chart with a model "
                       f"and callbacks that do not raise there, or with tests of your own")
        elif sent:
            strayed = (f"the send of step {number}, {_describe(step)}, also took "
                       f"{'; '.join(_describe(t) for t in sent)}: an event no step sent, which "
                       f"the chart's own callbacks sent or raised (self.send, self.raise_); "
                       f"paths run no callback, so they do not follow it: drive this chart "
                       f"with tests of your own, or send the event from outside the chart")
    return run.state


def _sent_by_the_chart(chart: CompiledChart, step: Transition, before: Sequence[int],
                       after: Sequence[int]) -> list[Transition]:
    """The transitions the send of ``step`` took (their counts moved from ``before`` to
    ``after``) on an event neither that send nor python-statemachine's macrostep raised
    (``step``'s own event, eventless, ``done.state.*``, ``error.*``): events the chart's
    callbacks sent or raised, which the paths did not foresee."""
    moved = [t for t in chart.transitions if t.id < len(before) and after[t.id] != before[t.id]]
    return [t for t in moved if t.event and not t.event.startswith(("done.state.", "error."))
            and not _matches(t.event, step.event)]


def _taken_on_errors(chart: CompiledChart, step: Transition, before: Sequence[int],
                     after: Sequence[int]) -> list[Transition]:
    """The transitions on ``error.*`` events the send of ``step`` took (their counts moved
    from ``before`` to ``after``) but its own: an error a callback raised during it, which
    python-statemachine sent as ``error.execution``."""
    return [t for t in chart.transitions if t.id < len(before) and after[t.id] != before[t.id]
            and t.event.startswith("error.") and not _matches(t.event, step.event)]


def _matches(descriptor: str, event: str) -> bool:
    """Whether a transition on ``descriptor`` takes ``event`` (SCXML descriptors: ``door``
    takes ``door.slam``, ``error.*`` and ``*`` what they name)."""
    stem = descriptor.removesuffix(".*").removesuffix("*")
    return (descriptor == event or not stem or event == stem
            or event.startswith(stem if stem.endswith(".") else stem + "."))


def _not_a_run(run: object) -> str:
    """What ``drive`` says of a ``run`` that is no compiled run: an instance of the chart (the
    usual slip: python-statemachine's own object) is driven by ``as_data``'s steps."""
    if isinstance(run, StateChart):
        name = type(run).__name__
        return (f"drive(run=<{name} instance>, path): expected a compiled run, "
                f"compiled({name}).run(GuardTable.for_chart({name}, outcomes=path.start)); an "
                f"instance of {name} is driven by sending as_data({name})'s steps, as "
                f"docs/framework.md shows")
    return (f"drive(run={run!r:.60}, path): expected a compiled run, "
            f"compiled(Chart).run(GuardTable.for_chart(Chart, outcomes=path.start))")


def _began_elsewhere(run: ChartRun | StatechartRun, path: Path | Walk,
                     began: str) -> str | None:
    """Why a run missed a path's step because drive began on it elsewhere than where the path
    starts (the chart's declared initial state, or the configuration its ``start`` ends in): a
    run of a chart declaring ``start_configuration_values`` says so (``_started_elsewhere``);
    any other one (restored from its model's saved state, made with ``state=`` or
    ``start_value=``, or a path driven on it before) names where it began and the fresh run
    to drive. None when it began where the path starts."""
    chart = run.chart
    if isinstance(run, ChartRun):
        starts = path.started or chart.initial
        there = began == starts
    else:
        starts = path.started or StatechartRun.skeleton(chart, path.start).state
        there = set(began.split(",")) == set(starts.split(","))
    if there:
        return None
    cause = (f"the path starts under outcomes {dict(path.start)} set before the chart "
             f"starts (its start step), which the run was not made with" if path.start else
             "a run restored from its model's saved state (state=, start_value=), or one a "
             "path was driven on before, is not where paths start")
    return _started_elsewhere(chart) or (
        f"drive began on a run in {began!r}, not in {starts!r} where the path starts: {cause}; "
        f"drive each path on a fresh run, compiled({chart.name}).run(GuardTable.for_chart("
        f"{chart.name}, outcomes=path.start))")


def _started_elsewhere(chart: CompiledChart) -> str | None:
    """Why a run may have missed a path's step because it did not start where paths start: the
    chart's ``start_configuration_values`` (where a run starts, not the declared initial state
    paths are computed from); None when it declares none."""
    values = list(getattr(chart.declaration, "start_configuration_values", None) or ())
    if not values:
        return None
    return (f"the run started in the chart's start_configuration_values {values!r}; paths "
            f"start from the declared initial state {chart.initial!r}")
