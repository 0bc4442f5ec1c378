"""A live inspector for any app's charts: per-state counts, per-edge rates and the path of one
run, as an ASGI app (Starlette) the app mounts where it likes.

    from calexec.machines.inspector import Inspector, inspector_app

    inspector = Inspector()
    inspector.register(OrderWorkflow, runs=lambda: shop.open_orders())   # or counts=...
    paths = inspector.paths                                            # a PathLog
    paths.follow("order-7", workflow)                  # a ChartRun or a python-statemachine instance
    app.mount("/charts", inspector_app(inspector))                     # FastAPI or Starlette

``register(Chart, runs=..., counts=..., active=..., name=...)``: ``runs`` returns the live runs
of the chart (``ChartRun`` objects, or python-statemachine instances, or anything with a
``state`` attribute), counted per state at each poll; or ``counts`` returns ``{state: n}``
itself. Rates are the transitions taken per minute over the last ``window_s`` by every run of
the chart in the process: compiled runs through ``CompiledChart.taken`` (free on the hot path)
and python-statemachine instances through a class listener the registration adds (instances
created after it). ``status`` (a callable returning ``{key: value}``) adds lines above the charts.

Routes, relative to the mount point: ``/`` the page (the charts drawn by graphviz, counts and
rates painted and refreshed by its own script, no reload), ``/live.json`` the data,
``/{chart}.svg`` one chart (its ``active`` state highlighted; ``?active=STATE``: that state,
a 400 naming it and the chart's states when the chart has none of that id; a configuration,
``?active=a,b`` or ``active=`` repeated, highlights each innermost state of it, two states no
run is in at once a 400 naming both), ``/runs/{run_id}`` the path of
one followed run (``?format=json``: its steps; else its chart with the path drawn). A
parameter given empty (``?active=``) is not given, on every route. Drawing
needs graphviz's ``dot``: without it those routes answer 503 naming it; ``/live.json`` and the
JSON path do not draw.

Starlette is imported only by ``inspector_app`` (the ``[server]`` extra): the rest of this
module, and the core, import without it. The NPU server mounts one at ``/debug/statecharts``
(drivers/serving/debug.py), as any user would.
"""

from __future__ import annotations

import html
import json
import math
import operator
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
from statemachine import StateChart
from statemachine.transition import Transition as DeclaredTransition

from calexec.contracts.fields import shown
from calexec.machines.chart_support import ToolListener, bound_name, reference, remove_listener
from calexec.machines.compiled import ChartLike, ChartRun, CompiledChart, compiled
from calexec.machines.diagrams import (
    EDGE_ID,
    NODE_ID,
    ActiveStatesError,
    GraphvizError,
    active_configuration,
    render_chart_svg,
    render_path_svg,
)
from calexec.machines.statechart_run import StatechartRun

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

WINDOW_S = 60.0
REFRESH_MS = 1000
#: samples kept for the rate window: at most one per second is added
_MIN_SAMPLE_GAP_S = 1.0
#: JSON-able value of a status line or a path record
Json = str | int | float | bool | None | list["Json"] | dict[str, "Json"]


class _InstanceCounter(ToolListener):
    """python-statemachine listener counting the declared transitions real instances of a
    chart take (a compiled run counts into ``CompiledChart.taken`` itself)."""

    def __init__(self, chart: CompiledChart) -> None:
        super().__init__()
        self.chart = chart
        self.taken = [0] * len(chart.transitions)

    def after_transition(self, event: object, transition: DeclaredTransition,
                         machine: StateChart[object]) -> None:
        found = self.chart.record_of(transition, event)
        if found is not None:  # not the initial pseudo-transition
            self.taken[found.id] += 1
            # and the default of each empty history it entered (no listener hears those)
            for default in self.chart.history_defaults(transition, machine.history_values):
                self.taken[default.id] += 1


def _registered_already(name: str, held: CompiledChart, given: CompiledChart) -> str:
    """``register``'s refusal of ``name``, held by ``held``: the same chart registered twice,
    or another chart of that name (``shop.orders:Order``, ``billing.orders:Order``), which the
    page and its URLs could not tell apart: what to give instead."""
    def where(chart: CompiledChart) -> str:
        # (by the name its module binds it to: two charts a factory made in one module share
        # the class name it gave them)
        return reference(chart.declaration)

    if held.declaration is given.declaration:
        return (f"register: a chart named {name!r} is already registered: {where(given)}, "
                f"registered already; register a chart once (or each time under another "
                f"name=)")
    return (f"register: a chart named {name!r} is already registered: {where(held)}; "
            f"{where(given)} is another chart of that name, which the page and its URLs "
            f"could not tell apart: register it with another name=, e.g. "
            f"register({bound_name(given.declaration)}, ..., "
            f"name={given.declaration.__module__ + '.' + bound_name(given.declaration)!r})")


@attrs.define
class Registered:
    """One chart the inspector shows: its name, compiled form, and where its counts come
    from."""

    name: str
    chart: CompiledChart
    counts: Callable[[], Mapping[str, int]]
    active: Callable[[], str | None]
    instances: _InstanceCounter
    #: ``active`` is the app's own function (not the default, the busiest state of ``counts``):
    #: what it answers is checked, and its error named in ``live.json``
    given_active: bool = False

    def taken(self) -> tuple[int, ...]:
        return tuple(a + b for a, b in zip(self.chart.taken, self.instances.taken, strict=True))

    def counted(self) -> tuple[dict[str, int], str | None]:
        """(count per state, None), or ({}, why) when the app's ``runs``/``counts`` function
        raised, or answered a count that is no integer or below 0, or a state the chart does
        not have: one chart's failing function leaves the other charts, the page and the
        drawings answering."""
        try:
            answered = dict(self.counts().items())
        except Exception as err:  # noqa: BLE001 - the app's function may raise anything
            return {}, (f"{self.name}: the runs= or counts= function given to register raised "
                        f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        found: dict[str, int] = {}
        said = f"{self.name}: the counts= function given to register answered"
        for state, n in answered.items():
            try:
                # an integer (numpy's too), never read through int(): 1.5 was drawn as 1,
                # "3" as 3 and True as 1, where a count that is no integer names the error
                if isinstance(n, bool):
                    raise TypeError("a bool is no count")
                found[state] = operator.index(n)
            except (TypeError, ValueError, OverflowError):  # (runs= counts integers itself)
                return {}, f"{said} a count that is no integer: {shown(state, 60)}={shown(n, 60)}"
            # (a state's name or value for its id, a typo: drawn nowhere, silently)
            if state not in self.chart.states:
                known = ", ".join(self.chart.states)
                return {}, (f"{said} a state the chart does not have: {shown(state, 60)} (its "
                            f"states, by id: {known:.200}){_by_value(self.chart, state)}")
            if found[state] < 0:
                return {}, f"{said} a count below 0: {shown(state, 60)}={shown(n, 60)}"
        return found, None

    def highlighted(self) -> str | None:
        """The state to highlight (``active``), None when the app's function raised or
        answered a state the chart does not have (``live.json`` names why)."""
        return self.active_state()[0]

    def active_state(self) -> tuple[str | None, str | None]:
        """(the state ``active`` answers, None), or (None, why) when the app's function raised
        or answered a state the chart does not have: that state failed every drawing of the
        chart, and the page of every chart, with a 500 naming nothing."""
        try:
            state = self.active()
        except Exception as err:  # noqa: BLE001 - the app's function may raise anything
            return None, (f"{self.name}: the active= function given to register raised "
                          f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        if state is None:
            return None, None
        try:  # a state, or a configuration (``a,b``: what ``state_of`` answers for a run)
            if not isinstance(state, str):
                raise ActiveStatesError(self.name, self.chart.states, unknown=(str(state),))
            configuration = active_configuration(self.chart, state)
        except ActiveStatesError as err:
            said = f"{self.name}: the active= function given to register answered"
            if err.unknown:
                return None, (f"{said} a state the chart does not have: {shown(state, 60)} "
                              f"(its states, by id: {', '.join(self.chart.states):.200})"
                              f"{_by_value(self.chart, state)}")
            return None, (f"{said} states no run is in at once: {shown(state, 60)} "
                          f"({unhighlightable(err, self.name, state)})")
        return ",".join(configuration) or None, None


def _by_value(chart: CompiledChart, answered: object, verb: str = "answer") -> str:
    """``; Door.LOCKED is the value of state LOCKED: answer its id`` when what an app's
    function answered is a state's value (an Enum member, what ``configuration_values`` of
    an instance holds, or a ``value=``), else empty."""
    try:
        state = chart.state_of(answered)
    except Exception:  # noqa: BLE001 - an unhashable answer: no value of a state
        return ""
    if state is None and isinstance(answered, str):
        # a query's text for a value of another type (``?active=30`` of ``State(value=30)``:
        # a query holds text only; until stop 70 no hint, where ``?active=P`` got one)
        state = next((str(declared.id) for declared in chart.declaration.states_map.values()
                      if not isinstance(declared.value, str)
                      and str(declared.value) == answered), None)
    if state is None or state == answered:
        return _by_name(chart, answered, verb)
    return f"; {shown(answered, 60)} is the value of state {state}: {verb} its id, {state}"


def _by_name(chart: CompiledChart, answered: object, verb: str = "answer") -> str:
    """``; "class" is the name of state class_: answer its id, class_`` when ``answered`` is
    the name a state was given (``class_ = State(name="class")``, which its diagram shows
    first, ``class (class_)``) rather than its id, else empty."""
    named = [str(state.id) for state in chart.declaration.states_map.values()
             if isinstance(answered, str) and state.name == answered and state.id != answered]
    if not named:
        return ""
    return f"; {shown(answered, 60)} is the name of state {named[0]}: {verb} its id, {named[0]}"


def busiest_configuration(chart: CompiledChart, counts: Mapping[str, int]) -> str | None:
    """The state holding most runs (the first of the chart's order on a tie), None when none
    holds any; on a hierarchical chart a configuration, ``a,b``: from the busiest top state
    down, the busiest child of each compound and every region of a parallel state holding
    runs (every run is in the top state and its ancestors, so the busiest single state was
    always the outermost: the whole chart's box filled, where the states runs are in were
    not)."""
    def busiest(states: Iterable[Any]) -> Any:
        best = max(states, key=lambda state: counts.get(state.id, 0), default=None)
        return best if best is not None and counts.get(best.id, 0) > 0 else None

    def down(state: Any) -> list[str]:
        found = [str(state.id)]
        if state.parallel:
            for region in state.states:
                if counts.get(region.id, 0) > 0:
                    found += down(region)
        elif state.states:
            child = busiest(state.states)
            if child is not None:
                found += down(child)
        return found

    top = busiest(chart.declaration.states)
    return None if top is None else ",".join(down(top))


def unhighlightable(err: ActiveStatesError, chart: str, value: str) -> str:
    """Why ``err``'s states (``value`` as given) cannot be highlighted, for a user reading
    JSON (names written as JSON): the ids the chart does not have, with its states, or the
    two never active at once."""
    if err.unknown:
        said = ("not a state of" if list(err.unknown) == [value] else
                f"{shown(err.unknown[0], 60)} is not a state of" if len(err.unknown) == 1 else
                f"{', '.join(shown(u, 60) for u in err.unknown[:8])} are not states of")
        return f"{said} {shown(chart, 60)} (its states, by id: {', '.join(err.states):.200})"
    first, second = err.apart or ("", "")
    return (f"{shown(first, 60)} and {shown(second, 60)} are never active at once: a run is in "
            f"one child of the chart and of each compound state, in every region of a "
            f"parallel state")


def state_of(run: object) -> str | None:
    """The state of a run, by id: a ``ChartRun``'s, a ``StatechartRun``'s or a
    python-statemachine instance's (its configuration joined, ``"a,b"``, as a
    ``StatechartRun`` names it), or any object's ``state`` attribute (a string)."""
    if isinstance(run, (ChartRun, StatechartRun)):
        return run.state
    if isinstance(run, StateChart):
        return ",".join(states_of(run))
    state = getattr(run, "state", None)
    return state if isinstance(state, str) else None


def states_of(run: object) -> tuple[str, ...]:
    """Every active state id of a run: its configuration (a hierarchical chart's run is in a
    state and its ancestors, in each region of a parallel state), else its one state. An
    instance's states by id, not by value (``State(value=1)``: the chart's counts are keyed
    by id)."""
    if isinstance(run, StatechartRun):
        return tuple(run.configuration)
    if isinstance(run, StateChart):
        return tuple(state.id for state in run.configuration)
    state = state_of(run)
    return () if state is None else (state,)


def _counting(chart: CompiledChart, runs: Callable[[], Iterable[object]]
              ) -> Callable[[], Mapping[str, int]]:
    def counts() -> Mapping[str, int]:
        found = dict.fromkeys(chart.states, 0)
        for run in list(runs()):
            for state in states_of(run):
                if state in found:
                    found[state] += 1
        return found
    return counts


class TransitionRates:
    """Transitions taken per minute over the last ``window_s``, per chart and transition id,
    from differences of the charts' taken counters sampled when asked (at most once a
    second): the count over the window divided by its minutes, as Prometheus's
    ``rate(x[1m])`` reads it. Before the first sample is ``window_s`` old (just after the
    inspector started or a chart was registered) nothing was taken before it, so the count
    is still divided by the whole window, never extrapolated from the seconds since: one
    transition is 1 per minute for a minute, then 0 (it read 60 just after the first
    sample, then 30, 20 ... as the seconds went by with nothing taken)."""

    def __init__(self, taken: Callable[[], dict[str, tuple[int, ...]]],
                 window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._taken = taken
        self._clock = clock
        self._mu = threading.Lock()
        self._samples: deque[tuple[float, dict[str, tuple[int, ...]]]] = deque()
        self._sample(self._clock())

    def _sample(self, now: float) -> dict[str, tuple[int, ...]]:
        snap = self._taken()
        if not self._samples or now - self._samples[-1][0] >= _MIN_SAMPLE_GAP_S:
            self._samples.append((now, snap))
        # keep one sample at or before the window's start, so the window is always covered
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        return snap

    def baseline(self) -> None:
        """A chart registered after the first sample counts from now: its current counters
        become its value in every earlier sample (what its runs took before it was shown,
        since the process started, is not a rate)."""
        with self._mu:
            snap = self._taken()
            for i, (at, old) in enumerate(self._samples):
                missing = {name: counts for name, counts in snap.items() if name not in old}
                if missing:
                    self._samples[i] = (at, {**old, **missing})

    def per_minute(self) -> dict[str, list[float]]:
        """chart -> rate per minute of each transition (index = transition id)."""
        with self._mu:
            now = self._clock()
            snap = self._sample(now)
            start, old = self._samples[0]
        span = now - start
        if span <= 0:
            return {name: [0.0] * len(counts) for name, counts in snap.items()}
        # over the whole window even when the first sample is younger (nothing counted before
        # it: a rate extrapolated from the seconds since read one transition as 60/min, then
        # 30, 20 ... falling while nothing happened); a first sample older than the window (no
        # poll for a while) spreads its count over the time since
        scale = 60.0 / max(span, self.window_s)
        return {name: [round((new - before) * scale, 1)
                       for new, before in zip(counts, old.get(name, (0,) * len(counts)),
                                              strict=True)]
                for name, counts in snap.items()}


class PathLog:
    """The paths of the last ``keep`` runs the app follows (``follow(run_id, run)``), each step
    ``{"event", "from", "to", "refused_by", "t"}`` (``to`` None and ``refused_by`` the guards
    for a refused event: compiled runs record refusals; a python-statemachine instance records
    taken transitions)."""

    def __init__(self, keep: int = 100, steps: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for field, value in (("keep", keep), ("steps", steps)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"PathLog({field}={value!r:.60}): expected an int >= 1")
            if value < 1:  # (keep=0 followed nothing, silently; keep=-1 raised StopIteration)
                raise ValueError(f"PathLog({field}={value}): must be >= 1")
        self.keep, self.steps, self._clock = keep, steps, clock
        self._mu = threading.Lock()
        self._runs: dict[str, tuple[CompiledChart, object, _Trail, _TrailListener | None]] = {}

    def follow(self, run_id: str, run: object, chart: ChartLike | None = None) -> None:
        """Record the path of ``run`` (a ``ChartRun``, or a python-statemachine instance of
        ``chart``'s class, ``chart`` defaulting to its class) under ``run_id`` from now on."""
        listener: _TrailListener | None = None
        if isinstance(run, (ChartRun, StatechartRun)):
            shared = run.chart
            trail = _Trail(self.steps, shared, run)
            run.keep_trail(trail, self._clock)
        elif isinstance(run, StateChart):
            # (a chart with async callbacks of its own: its instance, run on the async
            # engine, calls the listener as any does)
            shared = compiled(chart if chart is not None else type(run))
            trail = _Trail(self.steps, shared, run)
            listener = _TrailListener(shared, trail, self._clock)
            run.add_listener(listener)  # type: ignore[no-untyped-call]
        else:
            raise TypeError(f"run={run!r:.60}: expected a compiled run (ChartRun, "
                            f"StatechartRun) or a python-statemachine instance")
        with self._mu:
            # followed again under its id: the newest; the oldest beyond ``keep`` forgotten
            gone = [found for found in [self._runs.pop(str(run_id), None)] if found is not None]
            self._runs[str(run_id)] = (shared, run, trail, listener)
            while len(self._runs) > self.keep:
                gone.append(self._runs.pop(next(iter(self._runs))))
        # an instance no longer followed loses the listener that recorded its path (a
        # long-lived one followed again and again kept one per follow, each called per event)
        for _, old, _, recorder in gone:
            if recorder is not None and isinstance(old, StateChart):
                remove_listener(old, recorder)

    def record(self, run_id: str) -> dict[str, Json] | None:
        """``{"run_id", "chart", "state", "trail"}`` of a followed run, or None."""
        with self._mu:
            found = self._runs.get(run_id)
            if found is None:
                return None
            shared, run, trail, _ = found
            steps = list(zip(trail, trail.entered, strict=True))
        # a transition to a history state: ``to`` the state(s) it re-entered, ``via`` the
        # history (until stop 61 ``to`` was the history pseudo-state's id, where no run is)
        return {"run_id": run_id, "chart": shared.name, "state": state_of(run),
                "trail": [{"event": e, "from": s, "to": t if entered is None else entered,
                           "via": None if entered is None else t,
                           "refused_by": None if r is None else list(r), "t": at}
                          for (e, s, t, r, at), entered in steps]}

    def chart_of(self, run_id: str) -> CompiledChart | None:
        with self._mu:
            found = self._runs.get(run_id)
        return None if found is None else found[0]


_TrailEntry = tuple[str, str, str | None, tuple[str, ...] | None, float]


class _Trail(deque[_TrailEntry]):
    """A followed run's trail, and beside each step (``entered``) the state(s) a transition
    to a history state re-entered, joined by ``,`` (None for any other step): what the
    history had recorded as the step was trailed, or, empty, its default's target."""

    def __init__(self, maxlen: int, chart: CompiledChart, run: object) -> None:
        super().__init__(maxlen=maxlen)
        self.entered: deque[str | None] = deque(maxlen=maxlen)
        self._run = run
        self._defaults: dict[str, list[str]] = {}
        histories = {str(h.id) for state in chart.declaration.states_map.values()
                     for h in getattr(state, "history", ()) or ()}
        for transition in chart.transitions:
            if transition.source in histories:
                self._defaults.setdefault(transition.source, []).append(transition.target)
        self._histories = frozenset(histories)

    def append(self, entry: _TrailEntry) -> None:
        target = entry[2]
        entered = None
        if target is not None and target in self._histories:
            recorded = getattr(self._run, "history_values", None) or {}
            states = [str(s.id) for s in recorded.get(target, ())] or self._defaults.get(
                target, [])
            entered = ",".join(states) or None
        self.entered.append(entered)
        super().append(entry)


class _TrailListener:
    def __init__(self, chart: CompiledChart, trail: deque[_TrailEntry],
            clock: Callable[[], float]) -> None:
        self.chart, self.trail, self.clock = chart, trail, clock

    def after_transition(self, event: object, transition: DeclaredTransition,
                         machine: StateChart[object]) -> None:
        found = self.chart.record_of(transition, event)
        if found is not None:
            # and the default of each empty history it entered, as a compiled run's trail has
            for taken in (found, *self.chart.history_defaults(transition, machine.history_values)):
                self.trail.append((taken.event, taken.source, taken.target, None, self.clock()))


class Inspector:
    """The charts an app shows live, and the runs whose path it keeps (``paths``)."""

    def __init__(self, window_s: float = WINDOW_S,
                 status: Callable[[], Mapping[str, Json]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # (a NaN answered every live.json poll 500; a str failed once two samples were taken)
        if not isinstance(window_s, (int, float)) or isinstance(window_s, bool):
            raise TypeError(f"Inspector(window_s={window_s!r:.60}): expected a number of seconds")
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"Inspector(window_s={window_s!r}): must be a finite number of "
                             f"seconds > 0")
        self.charts: dict[str, Registered] = {}
        self.status = status
        self.paths = PathLog(clock=clock)
        self.rates = TransitionRates(self._taken, window_s, clock)
        self._mu = threading.Lock()

    def register(self, chart: ChartLike, *, runs: Callable[[], Iterable[object]] | None = None,
                 counts: Callable[[], Mapping[str, int]] | None = None,
                 active: Callable[[], str | None] | None = None,
                 name: str | None = None, count_instances: bool = True) -> Registered:
        """Show ``chart``: its live runs (``runs``) or its counts per state (``counts``), the
        state (or configuration, ``a,b``) to highlight in its SVG (``active``; default: the
        state holding most runs, if any). ``count_instances=False``: rates from compiled runs
        only (no class listener; an app that never runs the class itself). ``ValueError`` for a name already registered
        or both/neither of runs, counts, or an empty or blank ``name``; ``TypeError`` for one of
        runs, counts, active that is not a function (a list of runs, not a function returning
        it), or a ``name`` that is not a str."""
        shared = compiled(chart)  # (async callbacks of its own: its instances are shown)
        if name is not None and not isinstance(name, str):  # (the page failed 500 on it)
            raise TypeError(f"register({shared.name}): name={name!r:.60}: expected a str, the "
                            f"chart's name in the page and its URL")
        if name is not None and not name.strip():  # (was: the chart's own name, silently)
            raise ValueError(f"register({shared.name}): name={name!r}: empty; give the name "
                             "the page shows (or none: the chart's own)")
        name = shared.name if name is None else name
        expected = {"runs": "the live runs", "counts": "{state: count}",
                    "active": "the state to highlight or None"}
        for field, given in (("runs", runs), ("counts", counts), ("active", active)):
            if given is not None and not callable(given):
                raise TypeError(f"register({shared.name}): {field}={given!r:.60}: expected a "
                                f"function returning {expected[field]}, called at each poll")
        if runs is not None and counts is None:
            counts = _counting(shared, runs)
        elif runs is not None or counts is None:
            raise ValueError(f"register({shared.name}): give exactly one of runs= (the live "
                             f"runs) or counts= (state -> count)")
        given_active = active is not None
        if active is None:
            counted = counts

            def busiest() -> str | None:
                return busiest_configuration(shared, counted())
            active = busiest
        instances = _InstanceCounter(shared)
        with self._mu:
            if name in self.charts:
                raise ValueError(_registered_already(name, self.charts[name].chart, shared))
            if count_instances:  # python-statemachine 3's class listeners (coverage.track)
                shared.declaration._class_listeners.append(instances)
            entry = self.charts[name] = Registered(name, shared, counts, active, instances,
                                                   given_active)
        self.rates.baseline()
        return entry

    def close(self) -> None:
        """Remove the class listeners the registrations added."""
        with self._mu:
            for entry in self.charts.values():
                # from the class, its subclasses declared meanwhile and the instances made
                entry.instances.leave_class(entry.chart.declaration)

    def _taken(self) -> dict[str, tuple[int, ...]]:
        return {name: entry.taken() for name, entry in list(self.charts.items())}

    def live(self) -> dict[str, Json]:
        """What the page shows: ``status`` (the app's lines), ``window_s`` and per chart its
        ``counts`` per state and ``per_minute`` per transition id (and ``error``, naming it,
        when the chart's ``runs``/``counts`` function raised: its counts are then empty; or
        when its ``active`` function raised or answered a state the chart does not have:
        nothing is highlighted)."""
        per_minute = self.rates.per_minute()
        charts: dict[str, Json] = {}
        for name, entry in list(self.charts.items()):
            found, error = entry.counted()
            if error is None and entry.given_active:
                error = entry.active_state()[1]
            counts: dict[str, Json] = dict(found)
            rates: list[Json] = list(per_minute.get(name, [0.0] * len(entry.chart.transitions)))
            info: dict[str, Json] = {"counts": counts, "per_minute": rates}
            if error is not None:
                info["error"] = error
            charts[name] = info
        status: dict[str, Json] = {}
        if self.status is not None:
            try:
                status = dict(self.status())
            except Exception as err:  # noqa: BLE001 - the app's function: named, as counts
                status = {"error": f"the status function given to Inspector raised "
                                   f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        return {"status": status, "window_s": self.rates.window_s, "charts": charts}


# ---- HTML ----------------------------------------------------------------------------------
CSS = """
body{font-family:sans-serif;margin:1em} section{margin-bottom:2em}
section svg{max-width:100%;height:auto}
.live-count{font:bold 13px sans-serif;fill:#b00000}
.live-rate{font:bold 12px sans-serif;fill:#0050b0}
#status span{margin-right:1.5em} .legend td{padding:0 .6em}
.swatch{display:inline-block;width:1.2em;height:.9em;border:1px solid #333;vertical-align:middle}
"""

_SCRIPT = """
const NODE_ID = %(node_id)s, EDGE_ID = %(edge_id)s, LIVE = %(live)s, FILL = "#40e0d0";
function badge(group, cls, x, y, text, anchor) {
  let t = Array.from(group.children).find((c) => c.getAttribute("class") === cls);
  if (!t) {
    t = document.createElementNS("http://www.w3.org/2000/svg", "text");
    t.setAttribute("class", cls);
    t.setAttribute("text-anchor", anchor);
    t.setAttribute("x", x); t.setAttribute("y", y);
    group.appendChild(t);
  }
  t.textContent = text;
}
// a chart's section and a state's group are found by comparing names, never by a selector
// built from one: a name holding '"' or '\\' made an invalid selector, and the SyntaxError
// stopped every chart's painting
function paint(chart, info) {
  const section = Array.from(document.querySelectorAll("section[data-chart]"))
    .find((s) => s.dataset.chart === chart);
  const svg = section && section.querySelector("svg");
  if (!svg) return;
  const groups = new Map();
  svg.querySelectorAll("g[id]").forEach((g) => groups.set(g.id, g));
  for (const [state, n] of Object.entries(info.counts)) {
    const g = groups.get(NODE_ID + state);
    if (!g) continue;
    const shapes = g.querySelectorAll("path, polygon, ellipse");
    shapes.forEach((s, i) => {
      if (!s.dataset.fill) {  // the server may have highlighted one state: its base is white
        const f = s.getAttribute("fill") || "none";
        s.dataset.fill = (f === "turquoise") ? "white" : f;
      }
      if (s.dataset.fill !== "none") s.setAttribute("fill", n > 0 ? FILL : s.dataset.fill);
    });
    const box = shapes.length ? shapes[0].getBBox() : g.getBBox();
    badge(g, "live-count", box.x + box.width + 3, box.y + 11, String(n), "start");
    g.dataset.count = String(n);
  }
  svg.querySelectorAll("g.edge").forEach((g) => {
    if (!g.id.startsWith(EDGE_ID)) return;
    const ids = g.id.slice(EDGE_ID.length).split("_").map(Number);
    const rate = ids.reduce((sum, i) => sum + (info.per_minute[i] || 0), 0);
    const label = g.querySelector("text");
    if (!label) return;
    const x = Number(label.getAttribute("x")), y = Number(label.getAttribute("y"));
    badge(g, "live-rate", x, y - 14, rate.toFixed(1) + "/min", label.getAttribute("text-anchor"));
    g.querySelector("text.live-rate").style.fill = rate > 0 ? "" : "#999";
    g.dataset.rate = String(rate);
  });
}
async function tick() {
  try {
    const r = await fetch(LIVE, {cache: "no-store"});
    // an error answer (a server draining, a proxy's 502) named by its status and body, not
    // read as data: "TypeError: Cannot convert undefined or null to object" said nothing
    if (!r.ok) throw new Error(`${LIVE} answered HTTP ${r.status}: ${(await r.text()).slice(0, 200)}`);
    const d = await r.json();
    for (const [chart, info] of Object.entries(d.charts)) paint(chart, info);
    // a status line's field is found by its key, never as an element id: a key "status" or
    // "updated" (the page's own ids) emptied the whole status line and stopped the updates
    const fields = new Map();
    document.querySelectorAll("b[data-status]").forEach((b) => fields.set(b.dataset.status, b));
    for (const [key, value] of Object.entries(d.status)) {
      const el = fields.get(key);
      if (el) el.textContent = Array.isArray(value) ? (value.length ? value.join(", ") : "none")
                                                    : String(value);
    }
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (e) {
    document.getElementById("updated").textContent = "update failed: " + e;
  }
}
tick();
setInterval(tick, %(refresh)d);
"""


def _seconds(window: Json) -> str:
    """The rate window as the legend writes it: ``60 s``, ``0.5 s``, ``90.6 s`` (``:.0f`` wrote
    a window of 0.5 s as ``0 s`` and one of 90.6 s as ``91 s``)."""
    if not isinstance(window, (int, float)) or isinstance(window, bool):
        return f"{window} s"
    return f"{window:.10g} s"


def _text(value: Json) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value)) if value else "none"
    return str(value)


def page(svgs: Mapping[str, str], live: Mapping[str, Json], live_url: str,
         title: str = "statecharts", labels: Mapping[str, str] | None = None,
         counted: str = "live runs in the state") -> str:
    """The HTML of the live page around the charts' SVG text (XML declarations stripped);
    ``live`` (``Inspector.live()``) fills the status line before the script first runs, which
    then polls ``live_url``. ``labels``: status key -> its label (default: the key)."""
    status = live.get("status")
    fields = status if isinstance(status, dict) else {}
    names = labels or {key: key for key in fields}
    spans = "".join(f"<span>{html.escape(label)}: <b data-status='{html.escape(key)}'>"
                    f"{html.escape(_text(fields.get(key, '?')))}</b></span>"
                    for key, label in names.items())
    sections = "".join(
        f"<section data-chart='{html.escape(name)}'><h2>{html.escape(name)}</h2>{svg}</section>"
        for name, svg in svgs.items())
    script = _SCRIPT % {"node_id": json.dumps(NODE_ID), "edge_id": json.dumps(EDGE_ID),
                        "live": json.dumps(live_url), "refresh": REFRESH_MS}
    window = live.get("window_s", WINDOW_S)
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)} (live)</h1>"
        f"<p id='status'>{spans}"
        "<span>updated <b id='updated'>never</b></span></p>"
        "<table class='legend'><tr><td><span class='swatch' style='background:#40e0d0'></span>"
        "</td><td>state holding at least one live run</td></tr>"
        "<tr><td class='live-count' style='color:#b00000;font-weight:bold'>n</td><td>"
        f"{html.escape(counted)}</td></tr><tr><td style='color:#0050b0;font-weight:bold'>r/min"
        f"</td><td>transitions drawn by the edge, per minute over the last {_seconds(window)} (every "
        "run in the process)</td></tr><tr><td></td><td>each chart's own legend (below it) "
        "explains borders, guards and boxes</td></tr></table>"
        f"{sections}<script>{script}</script></body></html>")


def strip_xml_decl(svg: str) -> str:
    return svg.split("?>", 1)[1] if svg.startswith("<?xml") else svg


def path_page(chart: ChartLike, record: Mapping[str, object], heading: str,
              about: str = "") -> str:
    """HTML of one run's path (a ``PathLog.record`` or ``DeviceExecutor.job_trail``): the
    chart with the path drawn, and the steps in order. Raises ``GraphvizError`` without dot."""
    trail = record.get("trail")
    steps = [s for s in trail if isinstance(s, dict)] if isinstance(trail, list) else []
    svg = strip_xml_decl(render_path_svg(chart, steps))
    first = steps[0].get("t") if steps else 0.0
    t0 = float(first) if isinstance(first, (int, float)) else 0.0

    def ms(step: Mapping[str, Json]) -> str:
        at = step.get("t")
        return f"{(float(at) - t0) * 1e3:.3f}" if isinstance(at, (int, float)) else ""

    def refused(step: Mapping[str, Json]) -> str:
        guards = step.get("refused_by")
        return ", ".join(map(str, guards)) if isinstance(guards, list) else ""

    def to(step: Mapping[str, Json]) -> str:
        via = step.get("via")
        return str(step.get("to") or "refused") + (f" (via history {via})" if via else "")

    def event(step: Mapping[str, Json]) -> str:
        # (an eventless transition's step has no event: said as the diagram and paths say it)
        name = step.get("event")
        return "(eventless)" if name in ("", None) else str(name)

    rows = "".join(
        f"<tr><td>{ms(s)}</td><td>{html.escape(event(s))}</td>"
        f"<td>{html.escape(str(s.get('from')))}</td>"
        f"<td>{html.escape(to(s))}</td>"
        f"<td class='refused'>{html.escape(refused(s))}</td></tr>"
        for s in steps)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(heading)}</title><style>{CSS}"
        "table.steps td,table.steps th{padding:0 .7em;text-align:left}"
        ".refused{color:#b00000;font-weight:bold}</style></head><body>"
        f"<h1>{html.escape(heading)}</h1><p>{about}Red edges: the transitions it took; red text "
        "inside a state: an event refused there and the guard(s) that refused it, or the "
        "guards of the alternatives an [else] fallback passed over.</p>"
        "<table class='steps'><tr><th>ms</th><th>event</th><th>from</th><th>to</th>"
        f"<th>refused by</th></tr>{rows}</table>"
        f"<section data-chart='{html.escape(compiled(chart).name)}'>{svg}</section></body></html>")


# ---- the ASGI app --------------------------------------------------------------------------
@attrs.frozen
class AppOptions:
    """How ``inspector_app`` draws and answers: ``svg(chart, active)`` renders a chart (default
    ``render_chart_svg``, a cache is the caller's), ``graphviz_error(err, route)`` the response
    when drawing fails (default: 503 JSON naming it), ``error(request, status, message,
    headers)`` every other error response, in the mounting app's shape: an unknown chart or
    run (404, ``message`` names it) and a path or method no route takes (404 / 405 with
    ``Allow`` in ``headers``; ``message`` None) (default: ``{"error": message}`` JSON, and
    Starlette's plain-text answers), ``title``/``labels``/``counted`` the page's words,
    ``order`` the charts' order on the page (default: registration)."""

    svg: Callable[[CompiledChart, str | None], str] = render_chart_svg
    graphviz_error: Callable[[GraphvizError, str], Response] | None = None
    error: Callable[[Request, int, str | None, Mapping[str, str]], Response] | None = None
    title: str = "statecharts"
    labels: Mapping[str, str] | None = None
    counted: str = "live runs in the state"
    order: Callable[[list[str]], list[str]] | None = None


def inspector_app(inspector: Inspector, options: AppOptions | None = None) -> Starlette:
    """The inspector as a Starlette app, to mount in any ASGI app (``app.mount("/charts",
    inspector_app(inspector))``). Needs Starlette (the ``[server]`` extra): without it, a
    ``ModuleNotFoundError`` naming the extra and its install command."""
    try:
        from starlette.applications import Starlette
        from starlette.concurrency import run_in_threadpool
        from starlette.exceptions import HTTPException
        from starlette.responses import HTMLResponse, JSONResponse, Response
        from starlette.routing import Route
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"inspector_app needs Starlette, of calexec's optional [server] extra: "
            f"pip install 'calexec[server]' ({err})", name=err.name) from err

    opts = options or AppOptions()

    def drawing_failed(err: GraphvizError, route: str) -> Response:
        if opts.graphviz_error is not None:
            return opts.graphviz_error(err, route)
        return JSONResponse({"error": f"{route} draws with graphviz, which is not available "
                                      f"here: {err}; live.json needs no graphviz"},
                            status_code=503)

    def refused(request: Request, status: int, message: str) -> Response:
        if opts.error is not None:
            return opts.error(request, status, message, {})
        return JSONResponse({"error": message}, status_code=status)

    def base(request: Request) -> str:
        return str(request.scope.get("root_path", "")).rstrip("/")

    def query(request: Request, taken: tuple[str, ...]) -> tuple[list[str], dict[str, list[str]]]:
        """The query's keys a route does not take (sorted), and the values given to those it
        takes, each list in the query's order. A value that is empty or blank (``?active=``,
        ``?active``: an empty form field, a JS ``null`` left out) is not given, on every route,
        so ``?active=&active=on`` gives ``on`` once (until stop 58 it was a 400, ``active='':
        not a state``), and a bare ``?=`` is no parameter; a key not taken is refused whatever
        its value."""
        unknown: set[str] = set()
        given: dict[str, list[str]] = {key: [] for key in taken}
        for key, value in request.query_params.multi_items():
            if key not in given:
                if key or value:
                    unknown.add(key)
            elif value.strip():
                given[key].append(value)
        return sorted(unknown), given

    def query_taken(request: Request, route: str) -> Response | None:
        """The 400 of a query parameter a route without any was given (None: none given),
        naming each, as ``runs/{run_id}`` refuses one it does not take: ``live.json?run=3``
        answered as if it had been honoured."""
        unknown, _ = query(request, ())
        if not unknown:
            return None
        said = "unknown parameter" if len(unknown) == 1 else "unknown parameters"
        return refused(request, 400, f"{', '.join(key[:60] for key in unknown[:8])}: {said} "
                                     f"({route} takes no query parameter)")

    async def live(request: Request) -> Response:
        unknown = query_taken(request, "live.json")
        if unknown is not None:
            return unknown
        return JSONResponse(inspector.live())

    async def chart_svg(request: Request) -> Response:
        name = request.path_params["chart"]
        entry = inspector.charts.get(name)
        if entry is None:
            return refused(request, 404, f"chart={shown(name, 60)} is not one of "
                                         f"{shown(sorted(inspector.charts), 400)}")
        unknown, taken = query(request, ("active",))
        given = taken["active"]
        if unknown:  # (every query was ignored: ?active=on drew the busiest state)
            said = "unknown parameter" if len(unknown) == 1 else "unknown parameters"
            return refused(request, 400, f"{', '.join(key[:60] for key in unknown[:8])}: "
                                         f"{said} ({{chart}}.svg?active=STATE)")
        try:  # a state, or a configuration: ``a,b`` (as live.json and a run's page name
            # it) or ``active=`` repeated (a parallel chart's run is in several states)
            configuration = active_configuration(entry.chart, given)
        except ActiveStatesError as err:
            value = ",".join(given)
            meant = "".join(_by_value(entry.chart, unknown, "give")
                            for unknown in err.unknown[:8])
            return refused(request, 400, f"active={shown(value[:120])}: "
                                         f"{unhighlightable(err, name, value)}{meant}")
        active = ",".join(configuration) if configuration else entry.highlighted()
        try:
            svg = await run_in_threadpool(opts.svg, entry.chart, active)
        except GraphvizError as err:
            return drawing_failed(err, f"{base(request)}/{name}.svg")
        return Response(svg, media_type="image/svg+xml")

    async def index(request: Request) -> Response:
        unknown = query_taken(request, "the page")
        if unknown is not None:
            return unknown
        names = list(inspector.charts)
        if opts.order is not None:
            names = opts.order(names)
        try:
            svgs = {}
            for name in names:
                entry = inspector.charts[name]
                svgs[name] = strip_xml_decl(
                    await run_in_threadpool(opts.svg, entry.chart, entry.highlighted()))
        except GraphvizError as err:
            return drawing_failed(err, base(request) or "/")
        return HTMLResponse(page(svgs, inspector.live(), f"{base(request)}/live.json",
                                 opts.title, opts.labels, opts.counted))

    async def run_path(request: Request) -> Response:
        run_id = request.path_params["run_id"]
        record = inspector.paths.record(run_id)
        chart = inspector.paths.chart_of(run_id)
        if record is None or chart is None:
            return refused(request, 404, f"run_id={shown(run_id, 60)}: not followed (or older "
                                         f"than the last {inspector.paths.keep} runs)")
        unknown, taken = query(request, ("format",))
        given = taken["format"]
        if unknown:  # (a mistyped key answered the page, as if honoured)
            return refused(request, 400, f"{unknown[0][:60]}: unknown parameter (runs/"
                                         "{run_id}?format=json|html)")
        if len(given) > 1 or (given and given[0] not in ("json", "html")):
            return refused(request, 400, f"format={shown(given[0][:60])}: must be json or html, "
                                         "given once")  # (format=JSON answered the page)
        if given == ["json"]:
            return JSONResponse(record)
        try:
            text = await run_in_threadpool(path_page, chart, record,
                                           f"{chart.name} run {run_id}: {record['state']}")
        except GraphvizError as err:
            return drawing_failed(err, f"{base(request)}/runs/{{run_id}}")
        return HTMLResponse(text)

    handlers: dict[type[Exception], Callable[[Request, Exception], Awaitable[Response]]] = {}
    if opts.error is not None:
        error = opts.error

        async def no_route(request: Request, exc: Exception) -> Response:
            """A path (404) or method (405) no route takes, in the mounting app's shape."""
            return error(request, getattr(exc, "status_code", 404), None,
                         dict(getattr(exc, "headers", None) or {}))
        handlers[HTTPException] = no_route

    return Starlette(routes=[
        Route("/", index), Route("/live.json", live), Route("/runs/{run_id:path}", run_path),
        Route("/{chart:path}.svg", chart_svg),  # a name may hold a slash, as a run id may
    ], exception_handlers=handlers)
