"""What the statechart toolkit supports in a python-statemachine chart class, and a refusal
that names everything else (issue 26: nothing is silently dropped).

Supported by every tool (compile, diagrams, coverage, paths, mutation): any chart of
python-statemachine 3.2.2 but the constructs ``unsupported`` names. A compiled run takes one
of two engines: the flat fast path (``compiled.ChartRun``: atomic and final states, named
``cond``/``unless`` guards, no action, no validator, ``StateMachine`` semantics), or the
general run (``statechart_run.StatechartRun``) for everything ``hierarchical`` and ``actions``
list and for ``StateChart`` semantics (``semantics``: a ``StateChart``, or a ``StateMachine``
setting one of the flags that choose the semantics otherwise): compound, parallel and history states,
eventless and targetless transitions, validators, guards that are expressions or callables,
actions (enter/exit, before/on/after, declared or by naming convention).

Refused by ``unsupported`` (so by ``compiled.compile_chart`` and ``mutants.derive``, hence by
every tool), each named with its state or transition: ``invoke`` callbacks, delayed events and
multi-target transitions, which no compiled run follows. The chart's own async callbacks
(``async_only``) are refused by everything that runs the chart (``CompiledChart.run`` and
``refuse_runs``: coverage, contracts, the live view; mutation by ``unsupported``), not by
diagrams and path enumeration, which call no callback.

Imports nothing of calexec (``mutants`` uses it before the charts are imported).
"""

from __future__ import annotations

import ast
import difflib
import gc
import inspect
import logging
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from statemachine import StateChart, StateMachine
from statemachine.callbacks import CallbackGroup
from statemachine.spec_parser import UnsupportedExpression, operator_mapping, parse_boolean_expr
from statemachine.transition import Transition as DeclaredTransition

from calexec.machines.guard_expr import callable_name

log = logging.getLogger(__name__)


class UnsupportedChart(ValueError):
    """The chart declares a construct the toolkit does not support yet; the message is one
    line naming each such construct and where it is declared."""


class ChartTransitionError(Exception):
    """Base of the errors a ``ChartRun`` raises when an event cannot be taken."""


class IllegalTransition(ChartTransitionError):
    """The event has no declared transition from the current state (or is unknown)."""

    def __init__(self, chart: str, state: str, event: str,
                 events: tuple[str, ...] | None = None) -> None:
        self.chart, self.state, self.event = chart, state, event
        super().__init__(
            f"{chart}: event {event!r} is not allowed in state {state!r} "
            f"(no declared transition {state} --{event}-->){_unknown(chart, event, events)}"
        )


def _unknown(chart: str, event: object, events: tuple[str, ...] | None) -> str:
    """``": Chart has no event 'x' ..."`` when ``events`` (the chart's) are given and ``event``
    is none of them (a typo, a non-string), else ``""``. Built only when an event is refused."""
    if events is None or (isinstance(event, str) and event in events):
        return ""
    if not isinstance(event, str):
        return (f": an event is a string, the name of one of {chart}'s events, not "
                f"{type(event).__name__} {event!r} ({', '.join(events)})")
    close = difflib.get_close_matches(event, events, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"its events: {', '.join(events)}"
    return f": {chart} has no event {event!r} ({hint})"


class GuardRejected(ChartTransitionError):
    """Every transition declared for ``(state, event)`` had a guard that failed."""

    def __init__(self, chart: str, state: str, event: str, guards: tuple[str, ...]) -> None:
        self.chart, self.state, self.event, self.guards = chart, state, event, guards
        super().__init__(
            f"{chart}: event {event!r} in state {state!r} rejected by guard(s) "
            f"{', '.join(guards)}"
        )


def describe_transition(transition: DeclaredTransition) -> str:
    """``source --event--> target`` of a python-statemachine transition."""
    events = "|".join(str(e) for e in transition.events) or "(eventless)"
    targets = ",".join(getattr(t, "id", None) or repr(t) for t in transition.targets) or "(none)"
    return f"{transition.source.id} --{events}--> {targets}"


def bound_name(declaration: type) -> str:
    """The name ``declaration``'s module binds it to, what ``MODULE:NAME`` names it by: its
    ``__qualname__`` when the module binds it so (a class statement at module level), else the
    first name (sorted) the module binds it to (a chart made by a factory, ``Hotfix =
    make_pipeline("Pipeline", [...])``: two of them share the class name the factory gave),
    else its ``__qualname__`` (a class bound by no module name: no reference imports it)."""
    qualname = declaration.__qualname__
    module = sys.modules.get(declaration.__module__)
    names = dict(vars(module)) if module is not None else {}
    if names.get(qualname) is declaration:
        return qualname
    bound = sorted(key for key, value in names.items() if value is declaration)
    return bound[0] if bound else qualname


def reference(declaration: type) -> str:
    """``module:NAME``, the reference the commands take for ``declaration`` (``bound_name``)."""
    return f"{declaration.__module__}:{bound_name(declaration)}"


def declaring_subclasses(declaration: type) -> list[type]:
    """The subclasses of ``declaration`` (at any depth, defined so far) that declare states,
    in the order they were made: what to name instead of ``declaration`` when it is an
    abstract base of charts (a class of shared guards and actions declaring no state)."""
    found: list[type] = []
    pending: list[type] = list(declaration.__subclasses__())
    while pending:
        subclass = pending.pop(0)
        if getattr(subclass, "states", None) and subclass not in found:
            found.append(subclass)
        pending.extend(subclass.__subclasses__())
    return found


def no_states(declaration: type, refer: Callable[[type], str]) -> str:
    """``Base declares no states (a base class of charts? name a subclass that declares them:
    Flow)``, each subclass that declares states as ``refer`` names it."""
    subclasses = ", ".join(refer(subclass) for subclass in declaring_subclasses(declaration)[:5])
    return (f"{declaration.__name__} declares no states (a base class of charts? name a "
            f"subclass that declares them{': ' + subclasses if subclasses else ''})")


def by_its_name(declaration: type, given: str, kind: str) -> str:
    """``; 'class' is the name of state class_: give its id, class_`` when ``given``, which names
    no state (``kind`` "state") or event (else) of ``declaration`` by id, is the name one was
    given (``State(name="class")``, ``Event(..., name="start job")``, what diagrams draw) or
    the class attribute declaring an event of another id (``classify = Event(...,
    id="job.classify")``); else empty."""
    if kind == "state":
        states = getattr(declaration, "states_map", {}).values()
        named = [str(state.id) for state in states if state.name == given and state.id != given]
        return f"; {given!r} is the name of state {named[0]}: give its id, {named[0]}" \
            if named else ""
    events = list(getattr(declaration, "events", ()) or ())
    named = [str(event.id) for event in events if event.name == given and event.id != given]
    if named:
        return f"; {given!r} is the name of event {named[0]!r}: give its id, {named[0]}"
    declared = vars(declaration).get(given)
    declared_id = getattr(declared, "id", None)
    if declared is not None and any(event is declared for event in events) \
            and declared_id != given:
        return (f"; {given!r} is the attribute declaring event {declared_id!r}: give its id, "
                f"{declared_id}")
    return ""


def not_a_chart(value: object, argument: str = "chart", compiled_form: bool = True) -> TypeError:
    """The ``TypeError`` for ``argument=value`` where a chart class was expected (or, with
    ``compiled_form``, its ``CompiledChart``), naming the argument and saying what to pass
    for a newcomer's usual slips: an instance of the chart class (``Kiosk(model)``), the
    ``MODULE:CLASS`` text the commands take, a module."""
    expected = ("a python-statemachine chart class (a StateMachine or StateChart subclass)"
                + (" nor a CompiledChart" if compiled_form else ""))
    if isinstance(value, StateChart):
        name = type(value).__name__
        return TypeError(f"{argument}=<{name} instance>: an instance of the chart class {name} "
                         f"is not {expected}: pass the class itself, {name} "
                         f"(type(machine) of an instance)")
    hint = ""
    if isinstance(value, str):
        module, sep, klass = value.partition(":")
        hint = (f": pass the class itself (from {module} import {klass}), or load it with "
                f"calexec.machines.chartref.load_chart({value!r})" if sep and module and klass
                else ": pass the class itself (from MODULE import CLASS)")
    elif inspect.ismodule(value):
        hint = ": pass a chart class the module declares, not the module"
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return TypeError(f"{argument}={shown} is not {expected}{hint}")


def is_chart_class(value: object) -> bool:
    """Whether ``value`` is a python-statemachine chart class (``StateMachine`` is a
    ``StateChart`` subclass)."""
    return isinstance(value, type) and issubclass(value, StateChart)


def _all_states(declaration: type[StateChart[Any]]) -> list[Any]:
    return list(declaration.states_map.values())


def unsupported(declaration: type[StateChart[Any]], runs: bool = True) -> list[str]:
    """Each construct of ``declaration`` no tool supports (compiling refuses the chart), with
    where it is: invoke callbacks, delayed events, multi-target transitions, async callbacks,
    and two states of one id (python-statemachine keys states by id and keeps one).

    ``runs=False``: leave out what only a run cannot follow (async callbacks, ``async_only``):
    the tools that run nothing of the chart (diagrams, path enumeration) take it."""
    if not is_chart_class(declaration):
        raise not_a_chart(declaration, compiled_form=False)
    return [entry for entry, only_runs in _scan(declaration) if runs or not only_runs]


def undeclared_targets(declaration: type[StateChart[Any]]) -> list[str]:
    """``transition a --go--> voting goes to a state 'voting' Chart does not declare ...`` for
    each transition whose target is a ``State`` the chart does not hold: one made outside the
    class body (``voting = State()`` at module level: python-statemachine gives it no id) or
    another chart's (``Other.voting``). python-statemachine takes such a class; an instance
    taking the transition is left in no state at all, or fails (``InvalidStateValue``), so
    every tool refuses it by name."""
    name = declaration.__name__
    declared, pending = [], list(declaration.states)  # the tree: two children of one id too
    while pending:
        state = pending.pop(0)
        declared.append(state)
        pending.extend([*state.states, *(getattr(state, "history", ()) or ())])
    own = {id(state) for state in declared}
    by_id = {state.id for state in declared}
    found = []
    for state in declared:
        for transition in state.transitions:
            for target in transition.targets:
                if id(target) in own or not hasattr(target, "id"):
                    continue  # (a str target: python-statemachine refuses the class itself)
                heir = _heir_holding(declaration, target)
                if heir is not None:
                    found.append(_added_by_subclass(declaration, state, transition, target, heir))
                    continue
                label, whose = _foreign(declaration, target)
                if label in by_id:
                    whose += f", another object than its own {label!r}"
                events = "|".join(str(e) for e in transition.events) or "(eventless)"
                found.append(
                    f"transition {state.id} --{events}--> {label} goes to a state {label!r} "
                    f"{name} does not declare ({whose}: an instance taking it is left in no "
                    f"state, or fails); declare the state in {name} and go to that one")
    return list(dict.fromkeys(found))


def malformed_guards(declaration: type[StateChart[Any]]) -> list[str]:
    """``guard 'has_job and' (cond) on transition idle --go--> busy is no boolean expression
    python-statemachine reads (invalid syntax) ...`` for each ``cond``/``unless`` text
    python-statemachine's own parser refuses. It takes such a class and refuses every instance
    (``InvalidDefinition: Failed to parse boolean expression``), so every tool refuses it by
    name rather than drawing, counting or mutating a chart no run can make."""
    name = declaration.__name__
    found = []
    for state in _all_states(declaration):
        for transition in state.transitions:
            for spec in transition._specs:
                if (spec.group != CallbackGroup.COND or not isinstance(spec.func, str)
                        or spec.func.isidentifier()):
                    continue
                reason = _unparsable(spec.func)
                if reason:
                    kind = "cond" if spec.expected_value else "unless"
                    found.append(
                        f"guard {spec.func!r} ({kind}) on transition "
                        f"{describe_transition(transition)} is no boolean expression "
                        f"python-statemachine reads ({reason}): every instance of {name} fails "
                        f"(InvalidDefinition); write names joined by and/or/not")
    return list(dict.fromkeys(found))


def _unparsable(text: str) -> str | None:
    """Why python-statemachine's parser refuses the guard ``text``, or None when it reads it."""
    def hook(_name: str) -> Any:
        return lambda *args, **kwargs: True
    try:
        parse_boolean_expr(text, hook, operator_mapping)  # type: ignore[no-untyped-call]
    except SyntaxError as err:
        return err.msg or "invalid syntax"
    except UnsupportedExpression as err:
        return str(err)
    return None


def _heir_holding(declaration: type, target: object) -> type | None:
    """The first subclass of ``declaration`` (at any depth, defined so far) that declares the
    state ``target``, or None."""
    for subclass in declaring_subclasses(declaration):
        if any(state is target for state in getattr(subclass, "states_map", {}).values()):
            return subclass
    return None


def _added_by_subclass(declaration: type, state: Any, transition: DeclaredTransition,
                       target: Any, heir: type) -> str:
    """The refusal of a transition a subclass added to its base chart's state
    (``pause = Base.running.to(paused)`` in ``Pausable(Base)``): python-statemachine shares a
    base's ``State`` objects with its subclasses, so the base holds the transition too."""
    name, events = declaration.__name__, "|".join(str(e) for e in transition.events)
    shown = events or "(eventless)"
    added = f"{events} = " if events else ""
    return (f"transition {state.id} --{shown}--> {target.id} goes to a state {target.id!r} "
            f"{name} does not declare: its subclass {heir.__name__} added it to {name}'s own "
            f"state {state.id!r} ({added}{name}.{state.id}.to({target.id}) in "
            f"{heir.__name__}'s class body; python-statemachine shares a base chart's states "
            f"with its subclasses, so {name} holds the transition too, and an instance of "
            f"{name} taking it fails, InvalidStateValue); a subclass may add transitions out of "
            f"its own states only: make both charts from one factory, or declare "
            f"{heir.__name__} whole, or name {reference(heir)}, which takes it")


def _foreign(declaration: type[StateChart[Any]], target: Any) -> tuple[str, str]:
    """A state ``declaration`` does not hold, named for a message: its id (or, made outside
    any class, which has none, the name the chart's module gives it) and whose it is."""
    module = sys.modules.get(declaration.__module__)
    names = dict(vars(module)) if module is not None else {}
    for key, value in names.items():
        if value is target:
            return (target.id or key), (f"a State made outside the class body, {key!r} of "
                                        f"module {declaration.__module__!r}")
    for key, value in names.items():
        if (isinstance(value, type) and issubclass(value, StateChart) and value is not declaration
                and any(s is target for s in getattr(value, "states_map", {}).values())):
            return target.id, f"chart {key}'s state"
    return (target.id or "?"), "a State made outside the class body, or another chart's"


def named_targets(declaration: type[StateChart[Any]]) -> list[str]:
    """``transition go of Chart goes to 'voting', a str, not a State ...`` for each transition
    given a state's name where python-statemachine takes the ``State`` itself
    (``idle.to("voting")``): it refuses the class with ``'str' object has no attribute
    'transitions'``, naming neither. Reads a class python-statemachine was refusing as it made
    it (its states are known by then)."""
    found = []
    for state in list(getattr(declaration, "states_map", {}).values()):
        for transition in state.transitions:
            events = "|".join(str(e) for e in transition.events)
            for target in transition.targets:
                if isinstance(target, str):
                    what = f"transition {events}" if events else (
                        f"an eventless transition of {state.id!r}")
                    found.append(f"{what} of {declaration.__name__} goes to {target!r}, a str, "
                                 f"not a State: name the state itself "
                                 f"({state.id}.to({target}))")
    return list(dict.fromkeys(found))


def async_only(declaration: type[StateChart[Any]]) -> list[str]:
    """The chart's own async callbacks (``async callback 'fetch' on transition ...``): no
    compiled run, coverage, contract check, live view or mutant run follows them, but
    drawing the chart or enumerating its paths calls none of them."""
    return [entry for entry, only_runs in _scan(declaration) if only_runs]


def _scan(declaration: type[StateChart[Any]]) -> list[tuple[str, bool]]:
    """``unsupported``'s entries in declaration order, each with whether only a run cannot
    follow it (an async callback)."""
    found = [(entry, False) for entry in same_ids(declaration) + _redeclared(declaration)]
    states = _all_states(declaration)
    # and the history states (not in ``states_map``): their default is a transition too
    for state in [*states, *(h for s in states for h in getattr(s, "history", ()) or ())]:
        for spec in state._specs:
            # (one the chart defines by naming convention, ``on_invoke_<state>``, too: an
            # instance runs it as the state is entered)
            if spec.group == CallbackGroup.INVOKE and _declared(declaration, spec):
                found.append((f"invoke {_invoked(spec.func)} on state {state.id!r}", False))
        for transition in state.transitions:
            if transition.initial:
                continue
            where = describe_transition(transition)
            if len(transition.targets) > 1:
                found.append((f"transition {where} with {len(transition.targets)} targets",
                              False))
            for event in transition.events:
                if getattr(event, "delay", 0):
                    found.append((f"delayed event {str(event)!r} on transition {where}", False))
            for spec in transition._specs:
                if _is_async(declaration, spec):
                    found.append((f"async callback {_name(spec.func)!r} on transition {where}",
                                  True))
        for spec in state._specs:
            if _is_async(declaration, spec):
                found.append((f"async callback {_name(spec.func)!r} of state {state.id!r}",
                              True))
    return list(dict.fromkeys(found))


def same_ids(declaration: type[StateChart[Any]]) -> list[str]:
    """``N states with id 'x' (in 'a', 'b')`` for each id declared by several states (children
    of different compound states may share a name; python-statemachine's ``states_map`` keeps
    one of them, and every tool would answer for that one); for one ``State`` bound to several
    names of the class body (``lambda_ = State()``, then ``for _s in (idle, lambda_): ...``
    leaves ``_s`` bound to it), which python-statemachine names after the last and lists once
    per name, ``state '_s' is one State bound to 2 names ...`` (``aliased``)."""
    parents: dict[str, list[tuple[str, object]]] = {}
    pending = list(declaration.states)
    while pending:
        state = pending.pop(0)
        parent = state.parent.id if state.parent is not None else declaration.__name__
        parents.setdefault(state.id, []).append((parent, state))
        pending.extend(state.states)
        pending.extend(getattr(state, "history", ()) or ())
    found = []
    for state_id, where in parents.items():
        if len(where) < 2:
            continue
        if all(state is where[0][1] for _, state in where):
            found.append(aliased(declaration, state_id, where[0][1], len(where)))
        else:
            found.append(f"{len(where)} states with id {state_id!r} "
                         f"(in {', '.join(repr(parent) for parent, _ in where)})")
    return found


def aliased(declaration: type, state_id: str, state: object, listed: int) -> str:
    """``state '_s' is one State bound to 2 names in Pipeline's class body ...``: what
    python-statemachine made of a state bound to several names, and which to delete."""
    names = [name for name, value in vars(declaration).items() if value is state]
    bound = f" ({', '.join(names)})" if len(names) > 1 else ""
    fix = (f"del {', '.join(names[1:])} after the loop, or keep one name" if len(names) > 1
           else "keep one name")
    return (f"state {state_id!r} is one State bound to {listed} names in "
            f"{declaration.__name__}'s class body{bound}: an alias, or a loop variable left "
            f"there (for s in (a, b): ...); python-statemachine names it after the last, "
            f"{state_id!r}, and lists it {listed} times: {fix}")


def _redeclared(declaration: type[StateChart[Any]]) -> list[str]:
    """``event 'go' declared twice in Door (line 6: a.to(b); line 7: b.to(c)) ...`` for each
    event name a class body (the chart's or a compound state's) assigns transitions to twice:
    python-statemachine keeps the last assignment and the first one's transitions, left
    unnamed, become eventless (taken at once, with no event sent). Read from the class's
    source (a class without one, made by ``exec`` or in a REPL, is not checked); ``go =
    a.to(b) | b.to(c)``, ``go |= b.to(c)`` and ``go = go | b.to(c)`` declare one event."""
    if not any(t.is_eventless for state in _all_states(declaration)
               for t in state.transitions):
        return []  # (nothing was made eventless: no refusal to make)
    try:
        lines, first = inspect.getsourcelines(declaration)
        tree = ast.parse(inspect.cleandoc("\n" + "".join(lines)) if lines[0][:1].isspace()
                         else "".join(lines))
    except (OSError, TypeError, SyntaxError, IndexError):
        return []
    found: list[str] = []
    pending = [(node, node.name) for node in tree.body if isinstance(node, ast.ClassDef)][:1]
    while pending:
        body, where = pending.pop(0)
        seen: dict[str, ast.Assign] = {}
        for node in body.body:
            if isinstance(node, ast.ClassDef):
                pending.append((node, f"{where}.{node.name}"))
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and _transitions(node.value)):
                continue
            if any(k.arg == "event" for n in ast.walk(node.value) if isinstance(n, ast.Call)
                   for k in n.keywords):
                continue  # (``event=`` names its transitions' events itself)
            name = node.targets[0].id
            before = seen.get(name)
            reads_itself = any(isinstance(n, ast.Name) and n.id == name
                               for n in ast.walk(node.value))
            if before is not None and not reads_itself:
                old, new = ast.unparse(before.value), ast.unparse(node.value)
                plain = "Event(" not in old + new
                found.append(
                    f"event {name!r} declared twice in {where} (line "
                    f"{before.lineno + first - 1}: {old}; line {node.lineno + first - 1}: "
                    f"{new}): python-statemachine keeps the last and makes the first's "
                    f"transitions eventless (declare one event"
                    + (f" with |: {name} = {old} | {new})" if plain else " for both)"))
            seen[name] = node
    return found


def _transitions(value: ast.expr) -> bool:
    """Whether a class-body value declares transitions (``a.to(b)``, ``a.from_(b)``,
    ``Event(...)``, or ``|`` of them)."""
    for node in ast.walk(value):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("to", "from_", "Event") or (name == "itself" and isinstance(
                    func, ast.Attribute)):
                return True
    return False


def _is_async(declaration: type[StateChart[Any]], spec: Any) -> bool:
    func = getattr(declaration, spec.func, None) if isinstance(spec.func, str) else spec.func
    return inspect.iscoroutinefunction(func)


def hierarchical(declaration: type[StateChart[Any]]) -> list[str]:
    """Each construct of ``declaration`` that needs the general compiled run
    (``machines/statechart_run.py``) rather than the flat fast path, with where it is:
    compound, parallel and history states, eventless transitions, validators and guards that
    are not one method name of the model (expressions, callables, methods of the chart
    class)."""
    if not is_chart_class(declaration):
        raise not_a_chart(declaration, compiled_form=False)
    found = []
    for state in _all_states(declaration):
        if state.parallel:
            found.append(f"parallel state {state.id!r}")
        elif state.is_compound:
            found.append(f"compound state {state.id!r}")
        for history in getattr(state, "history", ()) or ():
            found.append(f"history state {history.id!r} in {state.id!r}")
        for transition in state.transitions:
            if transition.initial:
                continue
            where = describe_transition(transition)
            if transition.is_eventless:
                found.append(f"eventless transition {where}")
            if not transition.targets:
                found.append(f"targetless transition {where}")
            for spec in transition._specs:
                if spec.group == CallbackGroup.VALIDATOR and not spec.is_convention:
                    found.append(f"validator {_name(spec.func)!r} on transition {where}")
                if (spec.group == CallbackGroup.COND and not spec.is_convention
                        and getattr(spec.func, "calexec_constant", None) is None):
                    if not (isinstance(spec.func, str) and spec.func.isidentifier()):
                        found.append(f"guard {_name(spec.func)!r} on transition {where}")
                    elif callable(getattr(declaration, spec.func, None)):
                        # the flat run asks only its model; python-statemachine the chart too
                        found.append(f"guard {spec.func!r} on transition {where}, a method "
                                     f"of the chart class")
    return found


def actions(declaration: type[StateChart[Any]]) -> list[str]:
    """Each action ``declaration`` declares (or defines by naming convention on the class),
    with where, and each class-level listener (``listeners = [...]``: its callbacks and
    guards): what the flat fast path would not call (the general run does)."""
    if not is_chart_class(declaration):
        raise not_a_chart(declaration, compiled_form=False)
    found = [f"class-level listener {_name(entry) if isinstance(entry, type) else repr(entry)!r}"
             for entry in class_listeners(declaration)]
    groups = {CallbackGroup.ENTER: "enter", CallbackGroup.EXIT: "exit",
              CallbackGroup.BEFORE: "before", CallbackGroup.ON: "on", CallbackGroup.AFTER: "after"}
    # ``prepare_event`` (the chart's own: it adds to every event's data, which guards read)
    found += [f"prepare action {_name(spec.func)!r} of the chart" for spec in declaration._specs
              if spec.group == CallbackGroup.PREPARE and _declared(declaration, spec)]
    for state in _all_states(declaration):
        for spec in state._specs:
            if spec.group in groups and _declared(declaration, spec):
                found.append(f"{groups[spec.group]} action {_name(spec.func)!r} of state "
                             f"{state.id!r}")
        for transition in state.transitions:
            if transition.initial:
                continue
            for spec in transition._specs:
                if spec.group in groups and _declared(declaration, spec):
                    found.append(f"{groups[spec.group]} action {_name(spec.func)!r} on "
                                 f"transition {describe_transition(transition)}")
    return list(dict.fromkeys(found))


def model_callbacks(declaration: type[StateChart[Any]]) -> list[str]:
    """The names of the validators and actions ``declaration`` declares by name
    (``validators="in_good_standing"``, ``on="stamp"``, ``State(enter="greet")``) that the
    chart class does not define: python-statemachine looks them up on the model, and refuses
    an instance whose model has none (``InvalidDefinition: Did not found name ...``). Guards
    are not listed (``CompiledChart.guard_names``), nor naming-convention callbacks (optional)."""
    groups = {CallbackGroup.VALIDATOR, CallbackGroup.ENTER, CallbackGroup.EXIT,
              CallbackGroup.BEFORE, CallbackGroup.ON, CallbackGroup.AFTER}
    states = _all_states(declaration)
    found: list[str] = []
    for state in [*states, *(h for s in states for h in getattr(s, "history", ()) or ())]:
        specs = list(state._specs)
        for transition in state.transitions:
            specs += list(transition._specs)
        for spec in specs:
            if (spec.group in groups and not spec.is_convention and isinstance(spec.func, str)
                    and spec.func.isidentifier() and not hasattr(declaration, spec.func)):
                found.append(spec.func)
    return list(dict.fromkeys(found))


def class_listeners(declaration: type[StateChart[Any]]) -> list[object]:
    """The chart's own class-level ``listeners = [...]`` entries, in order: those calexec's
    tools add there to hear python-statemachine instances (coverage, contracts, the inspector;
    they carry ``calexec_tool``) are not the chart's and hear compiled runs otherwise."""
    return [entry for entry in getattr(declaration, "_class_listeners", ())
            if not getattr(entry, "calexec_tool", False)]


def semantics(declaration: type[StateChart[Any]]) -> str | None:
    """Why the flat fast path cannot follow ``declaration``'s semantics (the general run
    does), or None."""
    if not issubclass(declaration, StateMachine):
        return (f"{declaration.__name__} is a StateChart (a refused event is ignored, callback "
                f"errors become events): the flat fast path follows StateMachine semantics only")
    changed = [f"{flag} = {getattr(declaration, flag)!r}" for flag in _SEMANTIC_FLAGS
               if getattr(declaration, flag) != getattr(StateMachine, flag)]
    if changed:
        return (f"{declaration.__name__} sets {', '.join(changed)}: the flat fast path follows "
                f"StateMachine's defaults only")
    return None


#: the class flags that choose python-statemachine's semantics (StateMachine and StateChart
#: differ in each); a StateMachine that sets one to another value is not run by its defaults
_SEMANTIC_FLAGS = ("allow_event_without_transition", "catch_errors_as_events",
                   "enable_self_transition_entries", "atomic_configuration_update")


def _declared(declaration: type[StateChart[Any]], spec: Any) -> bool:
    if not spec.is_convention:
        return True
    return isinstance(spec.func, str) and callable(getattr(declaration, spec.func, None))


def dotted_event(event: str) -> str:
    """The SCXML name python-statemachine also registers for ``done_state_x``,
    ``done_invoke_x`` and ``error_x`` (itself for any other name): the event a transition
    declared as ``done_state_x`` is taken on, and its record's ``event``."""
    for prefix in ("done_state_", "done_invoke_"):
        if event.startswith(prefix):
            return f"{prefix[:-1].replace('_', '.')}.{event[len(prefix):]}"
    if event.startswith("error_"):
        return event.replace("_", ".")
    return event


def _name(func: Any) -> str:
    """A callback as its chart declared it: a name as written, a callable by
    ``guard_expr.callable_name`` (a lambda by its source text, never ``<lambda>``)."""
    return func if isinstance(func, str) else callable_name(func)


def _invoked(func: Any) -> str:
    """An invoke as its state declared it: a name quoted (``'work'``, a function's), an
    invoke handler object by its own ``repr`` when its class writes one
    (``timeout(0.15, on='expired')`` of ``statemachine.contrib.timeout``), not the name of the
    private class python-statemachine wraps it in or that handler's (``'_Timeout'``)."""
    handler = getattr(func, "_invoke_handler", func)  # python-statemachine's wrapper
    if not isinstance(handler, (str, type)) and not inspect.isroutine(handler) \
            and "__repr__" in {n for k in type(handler).__mro__[:-1] for n in vars(k)}:
        return repr(handler)
    return repr(_name(func))


def refuse_unsupported(declaration: type[StateChart[Any]], tool: str,
                       runs: bool = True) -> None:
    """Raise ``UnsupportedChart`` naming every unsupported construct of ``declaration``
    (``runs=False``: all but the async callbacks, see ``unsupported``); first, a transition to
    a state the chart does not declare (``undeclared_targets``) and a guard no instance can
    parse (``malformed_guards``), declaration bugs rather than constructs to support."""
    wrong = undeclared_targets(declaration) + malformed_guards(declaration)
    if wrong:
        raise UnsupportedChart(f"{declaration.__name__}: {'; '.join(wrong)}")
    found = unsupported(declaration, runs)
    if found:
        remedies = [INVOKE_REMEDY] if any(entry.startswith("invoke ") for entry in found) else []
        delayed = delayed_events(declaration)
        if delayed:
            remedies.append(delay_remedy(*delayed[0]))
        remedy = f" ({'; '.join(remedies)})" if remedies else ""
        raise UnsupportedChart(f"{declaration.__name__}: {tool} does not support yet: "
                               f"{'; '.join(found)}{remedy}")


def delayed_events(declaration: type[StateChart[Any]]) -> list[tuple[str, float]]:
    """``(event id, delay in ms)`` of each event a transition of ``declaration`` declares with
    ``delay=`` (``fire = Event(armed.to(boom), delay=100)``), in declaration order."""
    found: dict[str, float] = {}
    for state in _all_states(declaration):
        for transition in state.transitions:
            for event in transition.events:
                delay = getattr(event, "delay", 0)
                if delay:
                    found.setdefault(str(event), delay)
    return list(found.items())


def delay_remedy(event: str, delay_ms: float) -> str:
    """What to do about a delayed event, said after its refusal: python-statemachine delivers
    it from a timer of its own, ``delay`` ms after it is sent, which no tool follows."""
    ms = f"{delay_ms:g}"
    return (f"python-statemachine delivers a delayed event from a timer of its own, {ms} ms "
            f"after it is sent, which no tool follows: drop delay={ms} from the Event and, "
            f"where your code sends {event!r}, have a timer of yours call send({event!r}) "
            f"{ms} ms later (a test then sends it at once)")


#: what to do about a refused invoke, said after its refusal: python-statemachine runs an
#: invoke in a thread of its own as its state is entered and sends the event it ends with
#: (``timeout(5, on='expired')`` sends ``expired``), which no tool follows
INVOKE_REMEDY = ("an invoke runs as its state is entered, in python-statemachine's own thread, "
                 "and sends its event from there, which no tool follows: drop invoke= and send "
                 "that event from your own code, e.g. for timeout(5, on='expired') keep the "
                 "transition on 'expired' and have a timer of yours call send('expired') "
                 "5 s after the state is entered")


def alive(declaration: type) -> list[StateChart[Any]]:
    """The python-statemachine instances of exactly ``declaration`` alive now, found among the
    objects that refer to the class (an instance refers to its class): those a listener added
    to the class's ``_class_listeners`` from now on would miss, such as one the chart's module
    made as it was imported (``LAMP = Lamp()``) before a tool could add it. Not the bare
    instance a compiled general run keeps as its ``machine`` (made without ``__init__``: no
    listeners of its own; its run is heard through the compiled chart)."""
    return [found for found in gc.get_referrers(declaration)
            if isinstance(found, StateChart) and type(found) is declaration
            and "_listeners" in vars(found)]


class ToolListener:
    """Base of the python-statemachine listeners calexec's tools add to a chart's instances
    (coverage, contracts, the live view): not the chart's own (``calexec_tool``:
    ``class_listeners`` leaves it out), and undoable. ``join(machine)`` adds it to an instance
    alive already; put in the class's ``_class_listeners``, python-statemachine calls it for
    each instance made while it is there (a callable entry: ``__call__`` answers this same
    listener, ``setup`` hears the instance). It remembers every instance it joined by a weak
    reference (it keeps none alive), and ``leave_all`` removes it from each: enabling and
    disabling a tool over and over leaves a long-lived instance's listeners as they were."""

    #: not the chart's own class-level listener (``class_listeners``)
    calexec_tool = True

    def __init__(self) -> None:
        #: the instances this listener was added to, while they live
        self.calexec_joined: weakref.WeakSet[StateChart[object]] = weakref.WeakSet()
        # (instances are made on any thread: a copy of the set must not see it change)
        self.calexec_joining = threading.Lock()

    def __call__(self) -> ToolListener:
        return self

    def setup(self, machine: StateChart[object]) -> None:
        """python-statemachine made ``machine`` with this listener among its class's."""
        with self.calexec_joining:
            self.calexec_joined.add(machine)

    def join(self, machine: StateChart[object]) -> None:
        """Add this listener to ``machine``, an instance made before it was a class's."""
        machine.add_listener(self)  # type: ignore[no-untyped-call]  # (python-statemachine untyped)
        with self.calexec_joining:
            self.calexec_joined.add(machine)

    def leave_all(self) -> None:
        """Remove this listener from every instance it joined and is still alive."""
        with self.calexec_joining:
            joined = list(self.calexec_joined)
            self.calexec_joined.clear()
        for machine in joined:
            remove_listener(machine, self)

    def leave_class(self, declaration: type) -> None:
        """Take this listener out of ``declaration``'s class-level listeners and out of those
        of every subclass declared while it was there (python-statemachine copies a base's
        list into a subclass as it creates it), then ``leave_all``."""
        pending = [declaration]
        while pending:
            klass = pending.pop()
            listeners: list[object] = getattr(klass, "_class_listeners", [])
            while self in listeners:
                listeners.remove(self)
            pending.extend(klass.__subclasses__())
        self.leave_all()


def remove_listener(machine: StateChart[object], listener: object) -> bool:
    """Undo ``machine.add_listener(listener)`` (python-statemachine 3.2 offers no call for it):
    forget the listener and every callback resolved from it (keyed ``<attr>@<id>``). The
    callback lists are replaced, not changed in place, so a ``send`` on another thread
    iterates the old list or the new one. Whether ``machine`` had it."""
    try:
        listeners: dict[int, object] = machine._listeners
        registry = list(machine._callbacks._registry.values())
        if listeners.get(id(listener)) is not listener:
            return False
        suffix = f"@{id(listener)}"
        found = [executor for executor in registry
                 if any(key.endswith(suffix) for key in executor.items_already_seen)]
        kept = [(executor, deque(w for w in executor.items
                                 if not w.unique_key.endswith(suffix)),
                 {key for key in executor.items_already_seen if not key.endswith(suffix)})
                for executor in found]
    except (AttributeError, TypeError):
        # another python-statemachine 3.x keeps them otherwise: the listener stays on the
        # instance, inert as before this existed (its tool is off), nothing half-removed
        log.debug("python-statemachine: a listener is not removable from %s instances",
                  type(machine).__name__)
        return False
    del listeners[id(listener)]
    for executor, items, seen in kept:
        executor.items = items
        executor.items_already_seen = seen
    return True
