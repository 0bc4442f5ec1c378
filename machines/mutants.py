"""Mutants of a declared python-statemachine chart, derived from its declaration.

Chart mutation testing (``calexec charts mutate``) asks whether a test suite notices when a
chart is wrong. The mutants are enumerated from any python-statemachine chart class (flat
or hierarchical: nested states' transitions too), nothing is written per mutant:

- ``guard-true`` / ``guard-false``: one declared guard (a ``cond`` or ``unless`` entry of one
  transition) replaced by a constant guard returning True / False. The ``unless`` sense is
  kept: an ``unless`` guard forced true refuses its transition.
- ``drop``: one declared transition removed.
- ``target``: one declared transition sent to another state of the chart.

A history state's default (``h.to(c)``) is a declared transition too, mutated after every
state's own: its targets are the other states of the history's compound only.

A mutant is applied **in place** to the declaration class (its ``State`` and ``Transition``
objects, which every instance and ``compiled.compile_chart`` read), so the compiled table and
every real ``StateMachine`` built afterwards run the mutant. In a test process this happens at
import: ``install_from_env`` (run from a ``sitecustomize`` the mutation runner puts on
``PYTHONPATH``) reads ``CALEXEC_CHART_MUTANT=<module>:<Class>@<mutant id>`` and mutates the
class as soon as python-statemachine has created it, before anything derived from it (for
calexec, ``machines.compiled``; a table or an instance the chart's own module makes as it is
imported: ``TABLE = compiled(Light)``, ``GATE = Gate(BADGE)``) is built, or else right after
its module is executed. It then appends the same string to the file named by
``CALEXEC_CHART_MUTANT_ACK``, which is how the runner knows the mutant really ran. Nothing here
runs, and nothing is imported, when the variable is unset.

The hook waits on ``sys.meta_path`` for the module's import and must stay ahead of finders
inserted later: pytest's assertion-rewriting hook inserts itself first and claims every module
of a distribution that provides a pytest plugin (calexec itself, through its coverage plugin),
so ``sys.meta_path`` becomes a list that inserts at index 1 while the hook is pending at 0; the
hook then finds the module through those finders and wraps their loader. A command that never
imports the chart never triggers it: no acknowledgement, and the runner reports the mutant as
an error, not as a survivor.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import types
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib.machinery import ModuleSpec
from typing import Any

import attrs
from statemachine import StateChart, StateMachine
from statemachine.callbacks import CallbackGroup, CallbackSpec

from calexec.machines.chart_support import dotted_event, not_a_chart, refuse_unsupported
from calexec.machines.guard_expr import callable_name, canonical

ENV = "CALEXEC_CHART_MUTANT"
ACK_ENV = "CALEXEC_CHART_MUTANT_ACK"
KINDS = ("guard-true", "guard-false", "drop", "target")


@attrs.frozen
class Mutant:
    """One mutant of one chart. ``id`` is ``<kind>:<transition>[:<detail>]``, where
    ``transition`` is ``Source-event->Target`` (``#n`` for the n-th duplicate; a
    ``done_state_x`` transition by its event ``done.state.x`` alone) and ``detail``
    the guard or the new target. A guard's detail reads one way only (``guard_detail``): an
    expression in the diagrams' notation (``has_job,!toner_empty``), a lambda by its source;
    ``!`` leads an ``unless`` alone (``!fused``, ``!(a or b)``), a ``cond`` expression that
    starts with ``!`` is parenthesized (``(!motor_hot)``), a second guard of one transition
    with the same detail gets ``#2``. ``aliases``: the ids the mutant had before, until stop
    63 (the guard's text as written, ``has_job and not  toner_empty``, ``<lambda>``) and
    until stop 61 (python-statemachine's text of the guard, ``!a or b`` for ``unless="a or
    b"``), still taken by ``apply``, ``--mutant`` and the ``--equivalent`` list when they
    name no other mutant."""

    id: str
    kind: str
    transition: str
    detail: str = ""
    aliases: tuple[str, ...] = ()


def constant_guard(value: bool) -> Callable[..., bool]:
    """A guard that always answers ``value``; ``compiled.compile_chart`` folds it."""

    def guard(*_args: Any, **_kwargs: Any) -> bool:
        return value

    guard.__name__ = f"forced_{str(value).lower()}"
    # a marker on the function object (a function takes any attribute; mypy knows none)
    guard.calexec_constant = value  # type: ignore[attr-defined]
    return guard


def _guard_specs(transition: Any) -> list[CallbackSpec]:
    return [s for s in transition._specs if s.group == CallbackGroup.COND and not s.is_convention]


def _states(declaration: type[StateMachine]) -> list[Any]:
    if not declaration.states:  # an abstract base: as compiling it, named (not "no mutant")
        raise ValueError(f"{declaration.__name__}: declaration {declaration.__name__} declares "
                         f"no states")
    # (async callbacks of its own: a mutant changes the declaration, and the test command
    # runs its instances on python-statemachine's async engine as it runs the chart's)
    refuse_unsupported(declaration, "chart mutation", runs=False)
    return list(declaration.states_map.values())  # nested states too, in declaration order


def _sites(declaration: type[StateMachine], targets_per_transition: int) -> Iterator[tuple[Mutant, Callable[[], None]]]:
    """Every mutant of ``declaration`` with the action that applies it, in declaration order:
    for each state (declaration order), each transition (declaration order): guard mutants,
    then the drop, then the target mutants."""
    states = _states(declaration)
    seen: dict[str, int] = {}
    seen_before: dict[str, int] = {}
    # each state's transitions, then (after every state's) each history state's default
    # (``h.to(c)``), as ``compiled.compile_chart`` lists them
    owners = [*states, *(h for state in states for h in getattr(state, "history", ()) or ())]
    for state in owners:
        for transition in list(state.transitions):
            if transition.initial:
                continue
            names = [str(e) for e in transition.events]
            # ``done_state_x`` also declares ``done.state.x`` (python-statemachine registers
            # both, as for ``error_x``): one event, the one it raises, as coverage names it
            # (until stop 64 both, ``checkout-done_state_checkout+done.state.checkout->...``)
            events = "+".join(e for e in names if dotted_event(e) == e or dotted_event(e)
                              not in names)  # no "|": ids go in tables
            target = transition.target.id if transition.target is not None else "(none)"
            base = f"{state.id}-{events}->{target}"
            seen[base] = seen.get(base, 0) + 1
            label = base if seen[base] == 1 else f"{base}#{seen[base]}"
            before = f"{state.id}-{'+'.join(names)}->{target}"
            seen_before[before] = seen_before.get(before, 0) + 1
            old = before if seen_before[before] == 1 else f"{before}#{seen_before[before]}"
            labels = (label,) if old == label else (label, old)  # (the label of before: aliases)
            # (a history's default has none: python-statemachine never asks its ``cond``)
            specs = [] if state.is_history else _guard_specs(transition)
            details = _guard_details(specs)
            for spec, detail, legacy in zip(specs, details, _legacy(specs, details)):
                for value in (True, False):
                    kind = f"guard-{str(value).lower()}"
                    aliases = tuple(f"{kind}:{one}:{word}" for one in labels
                                    for word in (detail, *legacy))[1:]
                    yield (Mutant(f"{kind}:{label}:{detail}", kind, label, detail, aliases),
                           _force(transition, spec, value))
            yield (Mutant(f"drop:{label}", "drop", label, aliases=tuple(
                f"drop:{one}" for one in labels[1:])), _drop(state, transition))
            # a history's default enters a state of the history's compound (SCXML): only
            # those are its other targets, and never the history itself
            inside = ([s for s in states if s.is_descendant(state.parent)]
                      if state.is_history else states)
            for new in _other_targets(inside, transition, targets_per_transition):
                yield (Mutant(f"target:{label}:{new.id}", "target", label, new.id, tuple(
                    f"target:{one}:{new.id}" for one in labels[1:])),
                       _retarget(transition, new))


def guard_detail(spec: CallbackSpec) -> str:
    """How a guard mutant's id names ``spec``, one stable word of the toolkit's notation
    (``guard_expr.canonical``): a name as written; an expression as diagrams draw it, its
    conditions joined by ``,`` (``cond="has_job and not  toner_empty"`` ->
    ``has_job,!toner_empty``, whatever its spacing or spelling); a callable by
    ``guard_expr.callable_name`` (a lambda by its source text, never ``<lambda>``). ``!``
    leads an ``unless`` alone (``!fused``, ``!(a or b)``); a ``cond`` whose word starts with
    ``!`` is parenthesized (``(!motor_hot)``), which would read as an ``unless``."""
    expected = spec.expected_value is not False
    if isinstance(spec.func, str):
        return canonical(spec.func, expected)
    text = callable_name(spec.func)
    if expected:
        return f"({text})" if text.startswith("!") else text
    return f"!{text}" if text.isidentifier() else f"!({text})"


def _raw_detail(spec: CallbackSpec) -> str:
    """A guard's detail from stop 61 to stop 63: python-statemachine's text of it as written
    (an expression's spacing included, every lambda ``<lambda>``)."""
    text = str(spec.attr_name)
    if spec.expected_value is False:
        return f"!{text}" if text.isidentifier() else f"!({text})"
    return f"({text})" if text.lstrip().startswith("!") else text


def _numbered(words: list[str]) -> list[str]:
    """``#n`` on the n-th of one word (``cond=["a", "a"]``), so that each is an id of its own."""
    seen: dict[str, int] = {}
    numbered = []
    for word in words:
        seen[word] = seen.get(word, 0) + 1
        numbered.append(word if seen[word] == 1 else f"{word}#{seen[word]}")
    return numbered


def _guard_details(specs: list[CallbackSpec]) -> list[str]:
    """``guard_detail`` of each of one transition's guards, ``#n`` on the n-th of one detail
    (``cond=["a", "a"]``), so that each mutant has an id of its own."""
    return _numbered([guard_detail(spec) for spec in specs])


def _legacy(specs: list[CallbackSpec], details: list[str]) -> list[tuple[str, ...]]:
    """The details each guard's id had before where they differ from today's and still name
    this guard alone: until stop 63 the guard's text as written (``_raw_detail``), until stop
    61 python-statemachine's ``str(spec)`` (the first of one text: the one ``apply`` took), and
    no other guard's detail now."""
    taken = set(details)
    raw = _numbered([_raw_detail(spec) for spec in specs])
    found: set[str] = set()
    legacy = []
    for spec, detail, before in zip(specs, details, raw):
        old = str(spec)
        words = []
        for word in (before, old):
            if word != detail and word not in taken and word not in found and word not in words:
                words.append(word)
        found.update((before, old))
        legacy.append(tuple(words))
    return legacy


def _other_targets(states: list[Any], transition: Any, limit: int) -> list[Any]:
    """The states a ``target`` mutant may send ``transition`` to. ``limit`` 0: every other
    state. Otherwise the first ``limit`` of: the source itself (the event does nothing; not
    for a history's default, whose source is no state), then the states declared after the
    original target, wrapping round (a deterministic spread over early, late and final
    states). Either way the states a transition from outside
    enters exactly as it enters the original target, or as it enters a state taken before,
    come last (a compound and its initial child: such a mutant ends in the same
    configuration)."""
    original, source = transition.target, transition.source
    if original is None:  # a targetless transition: nothing to retarget
        return []
    if original in states:
        start = states.index(original)
        after = [s for s in states[start + 1:] + states[:start] if s is not original]
    else:  # a history target (not among the states): every state, the first one too
        after = list(states)
    stay = [] if source is original or source.is_history else [source]  # (no history target)
    ordered = after if limit == 0 else stay + [s for s in after if s is not source]
    # a state whose default entry is the original's (a compound and its initial child, a
    # parallel state and a region's initial state) ends the transition in the same
    # configuration: such a mutant survives every test that checks configurations. Likewise
    # two targets entered alike (``processing`` and its initial child ``fulfilment``) are one
    # mutant twice. Those come last, so a limit spends its mutants on targets a test can tell
    # apart, each a configuration of its own.
    same = _entered(original) if original in states else None
    seen: set[frozenset[str]] = set()
    first: list[Any] = []
    again: list[Any] = []
    alike: list[Any] = []
    for state in ordered:
        entered = _entered(state)
        (alike if entered == same else again if entered in seen else first).append(state)
        seen.add(entered)
    ordered = first + again + alike
    return ordered if limit == 0 else ordered[:limit]


def _default_entry(state: Any, into: set[str]) -> None:
    """Add ``state`` and what entering it enters by default: a compound's initial child, every
    region of a parallel state, recursively."""
    into.add(state.id)
    children = list(state.states)
    if not children:
        return
    if not state.parallel:
        children = [next((c for c in children if c.initial), children[0])]
    for child in children:
        _default_entry(child, into)


def _entered(state: Any) -> frozenset[str]:
    """The configuration a transition from outside every ancestor of ``state`` ends in when it
    targets ``state``: its ancestors, ``state`` and its default entry, and the default entry of
    the other regions of each parallel ancestor."""
    into: set[str] = set()
    _default_entry(state, into)
    child, parent = state, state.parent
    while parent is not None:
        into.add(parent.id)
        if parent.parallel:
            for region in parent.states:
                if region is not child:
                    _default_entry(region, into)
        child, parent = parent, parent.parent
    return frozenset(into)


def _force(transition: Any, spec: CallbackSpec, value: bool) -> Callable[[], None]:
    def apply() -> None:
        items = transition._specs.items
        items[items.index(spec)] = CallbackSpec(
            constant_guard(value), CallbackGroup.COND, priority=spec.priority,
            expected_value=spec.expected_value)
    return apply


def _drop(state: Any, transition: Any) -> Callable[[], None]:
    def apply() -> None:
        state.transitions.transitions.remove(transition)
    return apply


def _retarget(transition: Any, new: Any) -> Callable[[], None]:
    def apply() -> None:
        transition._targets = [new]
        transition.is_self = new is transition.source
    return apply


def _chart_class(declaration: object) -> type[StateMachine]:
    """The chart class of ``declaration``: the class itself, or a ``CompiledChart``'s (as every
    other tool takes either); anything else is a TypeError naming it, as ``compiled`` says
    it, instead of an AttributeError from the first attribute read."""
    if isinstance(declaration, type) and issubclass(declaration, StateChart):
        return declaration  # type: ignore[return-value]  # a StateMachine is a StateChart
    # at call time, and only for what is no chart class: a mutant applied as calexec's own
    # chart classes are created must not import compiled, which imports their module
    from calexec.machines.compiled import CompiledChart

    if isinstance(declaration, CompiledChart):
        return declaration.declaration  # type: ignore[return-value]  # a StateChart class
    raise not_a_chart(declaration)


def derive(declaration: type[StateMachine], targets_per_transition: int = 2) -> list[Mutant]:
    """Every mutant of the chart class ``declaration`` (or of a ``CompiledChart``'s), flat or
    hierarchical (see ``_sites``). ``targets_per_transition``: target mutants per
    transition, an int >= 0 (0: every other state); another value is a TypeError or
    ValueError naming it."""
    declaration = _chart_class(declaration)
    if not isinstance(targets_per_transition, int) or isinstance(targets_per_transition, bool):
        raise TypeError(f"targets_per_transition={targets_per_transition!r}: expected an int "
                        ">= 0 (0: every other state)")
    if targets_per_transition < 0:
        raise ValueError(f"targets_per_transition={targets_per_transition}: must be >= 0 "
                         "(0: every other state)")
    return [mutant for mutant, _ in _sites(declaration, targets_per_transition)]


#: the chart classes a mutant was applied to in this process (``mutated``)
_MUTATED: weakref.WeakSet[type] = weakref.WeakSet()


def mutated(declaration: object) -> bool:
    """Whether ``apply`` mutated the chart class ``declaration`` (or a ``CompiledChart``'s) in
    this process: a mutation run's test process, its mutant applied at import. A check a
    test makes against the chart as declared (``GuardTable.for_chart(..., strict=True)``)
    is the unmutated run's to make, which ``charts mutate`` runs first."""
    return _chart_class(declaration) in _MUTATED


def sharing_states(declaration: type[StateMachine]) -> list[type]:
    """The other chart classes holding some of ``declaration``'s very ``State`` objects: its
    base charts and subclasses (as far as they are defined) that python-statemachine gave
    them (``class Urgent(Ticket): pass``; a subclass that declares its states anew shares
    none). ``apply`` mutates those objects, so a mutant of ``declaration`` changes these
    charts too, and a test of one of them may kill it. Declaration order: bases, then
    subclasses; empty when there is none."""
    mine = {id(state) for state in getattr(declaration, "states_map", {}).values()}
    related: list[type] = [base for base in declaration.__mro__[1:]
                           if isinstance(base, type) and issubclass(base, StateChart)]
    pending = list(declaration.__subclasses__())
    while pending:
        sub = pending.pop(0)
        if sub not in related:
            related.append(sub)
            pending.extend(sub.__subclasses__())
    return [other for other in related if any(
        id(state) in mine for state in (getattr(other, "states_map", None) or {}).values())]


def apply(declaration: type[StateMachine], mutant_id: str) -> Mutant:
    """Mutate ``declaration`` in place by ``mutant_id`` (as ``derive`` names it, with any
    number of target mutants). Raises ``ValueError`` for an unknown id, ``TypeError`` for a
    ``declaration`` that is not a chart class (a ``CompiledChart`` included: the class is
    mutated in place, and the compiled table made before would not see it). A base chart or
    subclass sharing ``declaration``'s states (``sharing_states``) is mutated with it."""
    if _chart_class(declaration) is not declaration:
        raise TypeError(f"apply({declaration!r}, ...): pass the chart class itself; apply "
                        "mutates it in place, and a CompiledChart made before would not see "
                        "the mutation")
    for mutant, action in _sites(declaration, 0):
        # (an alias, an id of before, is no other mutant's id: ``_legacy``, ``_sites``)
        if mutant_id == mutant.id or mutant_id in mutant.aliases:
            action()
            _MUTATED.add(declaration)
            return mutant
    raise ValueError(f"{declaration.__name__}: no mutant {mutant_id!r} (see derive())")


class ApplyAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` right after ``name`` is executed by its own loader."""

    def __init__(self, name: str, callback: Callable[[types.ModuleType], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: ModuleSpec | None = find(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, self.callback)
                sys.meta_path.remove(self)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, callback: Callable[[Any], None]) -> None:
        self.inner, self.callback = inner, callback

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        self.callback(module)

    def __getattr__(self, name: str) -> Any:
        # the rest of the loader's protocol is the inner loader's: ``python -m chart_module``
        # asks it for ``get_code`` (runpy runs the code itself, as ``__main__``), tools for
        # ``get_source``, ``is_package``, ``get_resource_reader``
        return getattr(self.inner, name)


def env_value(text: str) -> str:
    """``text`` as an environment value holding its UTF-8 bytes, whatever this process's
    locale: Python encodes ``os.environ`` (and a child's ``env=``) with the file system
    encoding, ASCII under ``LC_ALL=C PYTHONUTF8=0``, where a mutant id naming a non-ASCII
    state (``drop:rangé-emprunter->prêté``) was a UnicodeEncodeError ending ``charts mutate``
    as an internal error. Read back with :func:`env_text`."""
    return os.fsdecode(text.encode("utf-8", "surrogateescape"))


def env_text(value: str) -> str:
    """An environment value's (or a command-line argument's) UTF-8 bytes as text (what
    :func:`env_value` wrote, whatever the locale of the process that reads it; bytes that are
    no UTF-8 as lone surrogates)."""
    try:
        return os.fsencode(value).decode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # (text already: characters the file system encoding has not)
        return value


def install_from_env(environ: Mapping[str, str] = os.environ) -> None:
    """Arrange for the mutant named by ``CALEXEC_CHART_MUTANT`` to be applied (see the module
    docstring). Does nothing when it is unset."""
    value = environ.get(ENV)
    if not value:
        return
    value = env_text(value)
    target, _, mutant_id = value.partition("@")
    module_name, _, class_name = target.partition(":")
    if not (module_name and class_name and mutant_id):
        raise ValueError(f"{ENV}={value!r}: expected <module>:<Class>@<mutant id>")

    state = {"applying": False, "done": False}

    def mutate_class(chart: Any) -> None:
        if state["done"] or state["applying"]:  # once, whichever way reaches it first
            return
        state["applying"] = True
        try:
            apply(chart, mutant_id)
        finally:
            state["applying"] = False
        state["done"] = True
        ack = environ.get(ACK_ENV)
        if ack:
            # (a module named from a file name that is no UTF-8 holds a lone surrogate: the
            # runner reads the file back so)
            with open(ack, "a", encoding="utf-8", errors="surrogateescape") as out:
                out.write(value + "\n")

    def mutate(module: Any) -> None:
        mutate_class(getattr(module, class_name))

    # as soon as the class exists: what its module does with it as it is imported
    # (``TABLE = compiled(Light)``, ``GATE = Gate(BADGE)``: a table, an instance whose guards
    # python-statemachine resolved when it was made) is then the mutant's, not the chart's
    meta = type(StateChart)
    created = meta.__init__

    def init(cls: Any, *args: Any, **kwargs: Any) -> None:
        created(cls, *args, **kwargs)
        # a class statement of the module's own body only (its namespace names it): a class a
        # factory makes (``Hotfix = make_pipeline("Pipeline", ...)``, ``type(...)``) bears the
        # name it was given, which may be another chart's name in that module; it is mutated
        # once bound, by ``mutate`` (until stop 70 the first class of that name made was:
        # ``fac:Pipeline``'s mutants went to ``Hotfix``, all surviving or never applied)
        namespace = args[2] if len(args) > 2 else kwargs.get("attrs")
        if (cls.__module__ == module_name and cls.__qualname__ == class_name
                and isinstance(namespace, dict) and namespace.get("__qualname__") == class_name):
            mutate_class(cls)

    meta.__init__ = init  # type: ignore[method-assign]  # the process runs one mutant: its hook
    after_import(module_name, mutate)


def after_import(module_name: str, callback: Callable[[types.ModuleType], None]) -> None:
    """``callback(module)`` once module ``module_name`` is executed by this process's own
    import (at once when it is already): an ``ApplyAfterImport`` hook kept first on
    ``sys.meta_path``, a finder inserted at the front later (pytest's assertion rewriter)
    going right behind it. Imports nothing itself."""
    if module_name in sys.modules:
        callback(sys.modules[module_name])
        return
    if not isinstance(sys.meta_path, _HookFirst):
        sys.meta_path = _HookFirst(sys.meta_path)
    list.insert(sys.meta_path, 0, ApplyAfterImport(module_name, callback))


class _HookFirst(list):  # type: ignore[type-arg]  # sys.meta_path's items are any finders
    """``sys.meta_path`` while an ``ApplyAfterImport`` hook is pending at index 0: a finder
    inserted at the front later (pytest's assertion rewriter) goes right behind it."""

    def insert(self, index: Any, item: Any) -> None:
        if index == 0 and self and isinstance(self[0], ApplyAfterImport):
            index = 1
        super().insert(index, item)
