"""Transition coverage of any chart: which declared transitions were actually taken.

Every function takes a chart as its class or its ``CompiledChart`` (``compiled.compiled``).
A ``TransitionRecorder`` collects ``(chart name, transition id)`` keys. It is a chart listener:
whoever wants coverage attaches one to the charts it cares about (``track(Chart, recorder)``,
or ``with recording([Chart]) as recorder:``), and every transition a run of those charts takes
then adds its key: a ``ChartRun`` of the compiled chart, or a python-statemachine instance of
the class (``track`` adds a class-level ``TransitionListener``; one instance can also be given
``listeners=[TransitionListener(Chart)]``). Nothing is recorded, and nothing global is
consulted on the hot path, when no recorder is attached (production). The pytest plugin
(``calexec.machines.coverage_plugin``, ``--chart-coverage=MODULE:CLASS``) tracks the charts it
is given for the session; a test may attach its own recorder beside it for one scenario.
``set.add`` is atomic under the GIL, so several threads may record at once.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs
from statemachine import StateChart
from statemachine.transition import Transition as DeclaredTransition

from calexec.machines.chart_support import ToolListener, alive, bound_name, reference
from calexec.machines.compiled import ChartLike, CompiledChart, Transition, compiled


class TransitionRecorder:
    """The set of taken transition keys ``(chart name, transition id)``; a chart listener
    (``chart.attach(recorder)``): calling it with a ``Transition`` records its key."""

    __slots__ = ("hits", "charts")

    def __init__(self) -> None:
        self.hits: set[tuple[str, int]] = set()
        #: chart name -> the chart class ``track``/``recording`` record under it (a key is
        #: ``(chart name, transition id)``: two classes of one name would mix their counts)
        self.charts: dict[str, type] = {}

    def claim(self, chart: ChartLike) -> None:
        """Record ``chart`` under its name here; a ``ValueError`` naming both when another
        chart class of that name is recorded here already (its transition ids would count as
        this one's: ``shop.orders:Order`` covered by the runs of ``billing.orders:Order``)."""
        shared = compiled(chart)
        known = self.charts.setdefault(shared.name, shared.declaration)
        if known is not shared.declaration:
            raise ValueError(_same_name(shared.name, known, shared.declaration))

    def __call__(self, transition: Transition) -> None:
        self.hits.add(transition.key)

    def clear(self) -> None:
        """Forget every recorded transition."""
        self.hits.clear()


@contextmanager
def recording(charts: Iterable[ChartLike]) -> Iterator[TransitionRecorder]:
    """A fresh recorder attached to ``charts`` (compiled runs only) for the ``with`` block
    (detached after it; other listeners, such as the plugin's recorder, keep recording beside
    it)."""
    shared = tuple(compiled(chart) for chart in _charts(charts, "recording"))
    recorder = TransitionRecorder()
    for chart in shared:
        chart.refuse_runs()  # (its own async callbacks: no run to record)
        recorder.claim(chart)
    for chart in shared:
        chart.attach(recorder)
    try:
        yield recorder
    finally:
        for chart in shared:
            chart.detach(recorder)


def track(chart: ChartLike, recorder: TransitionRecorder) -> Callable[[], None]:
    """Record into ``recorder`` every transition any run of ``chart`` takes from now on: its
    compiled runs (``recorder`` attached to ``compiled(chart)``) and every python-statemachine
    instance of its class, those created from now on (a ``TransitionListener`` added to the
    class's listeners) and those alive already (``alive``: the listener added to each).
    Returns the call that undoes both, the listener removed from every instance it joined."""
    shared = compiled(chart)
    _recorder(recorder, "track")
    # (a chart with async callbacks of its own: no compiled run of it is made, but its
    # python-statemachine instances, run on the async engine, call the listener as any does)
    recorder.claim(shared)
    listener = TransitionListener(shared, recorder)
    declaration = shared.declaration
    shared.attach(recorder)
    # python-statemachine 3 collects a class's ``listeners`` attribute at class creation into
    # this list and instantiates nothing for an entry that is not callable: the same listener
    # object joins every instance created while it is there (no public API adds one later)
    class_listeners: list[Any] = declaration._class_listeners
    class_listeners.append(listener)
    # and the instances alive already: one its module made as it was imported (``LAMP =
    # Lamp()`` under the class), before the plugin or ``charts cover`` could call this
    for machine in alive(declaration):
        listener.join(machine)

    def undo() -> None:
        shared.detach(recorder)
        listener.listening = False
        # from the class, its subclasses declared meanwhile and every instance it joined
        listener.leave_class(declaration)

    return undo


class TransitionListener(ToolListener):
    """python-statemachine listener that reports the transitions a real instance of
    ``chart``'s declaration takes: to ``recorder`` when given, else to the chart's listeners
    (as if a ``ChartRun`` of it had taken them)."""

    def __init__(self, chart: ChartLike, recorder: TransitionRecorder | None = None) -> None:
        super().__init__()
        self.chart = compiled(chart)
        self.recorder = recorder
        #: False once the ``track`` that made it is undone: it then records nothing
        self.listening = True

    def after_transition(self, event: object, transition: DeclaredTransition,
                         machine: StateChart[object]) -> None:
        """Called by python-statemachine after each transition (``event`` is the trigger;
        None for an eventless transition, which the compiled chart keys by ``""``), then for
        the default of each empty history state it entered (python-statemachine calls no
        listener for those)."""
        if not self.listening:
            return
        taken = self.chart.record_of(transition, event)
        if taken is None:  # the initial pseudo-transition is not a declared one
            return
        for record in (taken, *self.chart.history_defaults(transition, machine.history_values)):
            if self.recorder is not None:
                self.recorder(record)
            else:
                self.chart.notify(record)


@attrs.frozen
class ChartCoverage:
    """Coverage of one chart: the declared transitions and which of them were not taken."""

    chart: str
    declared: int
    covered: int
    untaken: tuple[Transition, ...]

    @property
    def complete(self) -> bool:
        return self.covered == self.declared

    @property
    def percent(self) -> float:
        """Covered share of the declared transitions (100.0 for a chart with none)."""
        return 100.0 if self.declared == 0 else 100.0 * self.covered / self.declared

    def line(self) -> str:
        """``transition coverage <chart>: <covered>/<declared>``."""
        return f"transition coverage {self.chart}: {self.covered}/{self.declared}"


def _charts(charts: object, function: str) -> list[ChartLike]:
    """``charts`` of ``recording``/``report``, a collection of charts, as a list; one chart
    class given alone (``recording(Kiosk)``), a str or anything not iterable is a
    ``TypeError`` naming the argument and what to write."""
    if isinstance(charts, (type, CompiledChart, str, StateChart)) or not isinstance(
            charts, Iterable):
        shown = getattr(charts, "__name__", None) or f"{charts!r:.60}"
        named = shown
        if isinstance(charts, StateChart):  # an instance: its class is the chart
            named = type(charts).__name__
            shown = f"<{named} instance>"
        example = f"[{named}]" if function == "recording" else f"[{named}], recorder"
        raise TypeError(f"{function}(charts={shown}): expected a list of chart classes (or "
                        f"CompiledCharts), e.g. {function}({example})")
    return list(charts)


def _recorder(recorder: object, function: str) -> None:
    """``recorder`` of ``track``/``report``: a ``TransitionRecorder``, else a ``TypeError``
    naming it."""
    if not isinstance(recorder, TransitionRecorder):
        raise TypeError(f"{function}(..., recorder={recorder!r:.60}): expected a "
                        f"TransitionRecorder (TransitionRecorder(), or the one recording() "
                        f"yields)")


def report(charts: Iterable[ChartLike], recorder: TransitionRecorder) -> list[ChartCoverage]:
    """Per-chart coverage of ``charts`` from what ``recorder`` saw. Two chart classes of one
    name (among ``charts``, or one of them and a class the recorder recorded under that name)
    are a ``ValueError`` naming both: their keys are the same."""
    result = []
    shared = list(map(compiled, _charts(charts, "report")))
    _recorder(recorder, "report")
    named: dict[str, type] = dict(recorder.charts)
    for chart in shared:
        known = named.setdefault(chart.name, chart.declaration)
        if known is not chart.declaration:
            raise ValueError(_same_name(chart.name, known, chart.declaration))
    for chart in shared:
        untaken = tuple(t for t in chart.transitions if t.key not in recorder.hits)
        result.append(
            ChartCoverage(
                chart=chart.name,
                declared=len(chart.transitions),
                covered=len(chart.transitions) - len(untaken),
                untaken=untaken,
            )
        )
    return result


def _same_name(name: str, one: type, other: type) -> str:
    # (by the names their modules bind them to: two charts a factory made in one module share
    # the class name it gave them, ``stages:Pipeline`` twice, a reference that imports neither)
    return (f"two chart classes named {name}, {reference(one)} and {reference(other)}: "
            f"coverage counts a transition by its chart's name and id, so their counts would "
            f"mix; give one class another name")


def gate_percentage(text: str) -> float | None:
    """A coverage or mutation gate as given (``--min``, ``--chart-coverage-min``,
    ``chart_coverage_min``, ``--fail-under``): a number 0..100, with or without a ``%``
    (``90%``: until stop 71 refused as "expected a percentage"); None for anything else
    (a word, nan, inf, 1e400, a value out of range), which the caller refuses naming its
    flag."""
    number = text.strip()
    number = number[:-1].rstrip() if number.endswith("%") else number
    if not PERCENTAGE_TEXT.fullmatch(number):  # (float() also reads "1_0" and "٣")
        return None
    value = float(number)
    return value if 0 <= value <= 100 else None  # (1e400: inf, not in range)


#: a gate's number as a command line writes it: ASCII digits, a point, an exponent (the
#: command line's numbers, ``calexec.cliargs.NUMBER_TEXT``, which machines/ cannot import;
#: until stop 74 ``--min 1_0`` was 10 % and ``--min ٩٠`` 90 %)
PERCENTAGE_TEXT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def describe(transition: Transition, chart: ChartLike | None = None) -> str:
    """``Source --event [guards]--> Target`` for listings of untaken transitions. Given the
    ``chart``, in the diagrams' notation: an unguarded fallback of a guarded alternative reads
    ``[else]`` and an internal transition ends `` (internal)`` (until stop 72 the fallback
    ``data = established.to.itself(cond="window_open") | established.to.itself(internal=True)``
    was listed untaken as ``established --data--> established``, which reads as the
    alternative a test took)."""
    guards = f" [{', '.join(transition.guards)}]" if transition.guards else ""
    event = transition.event or "(eventless)"
    internal = False
    if chart is not None:
        from calexec.machines.diagrams import internal as is_internal

        table = compiled(chart)
        slot = table.table.get((transition.source, transition.event), ())
        if not guards and transition.event and any(
                t.guards for t in slot if t.id < transition.id):
            guards = " [else]"
        internal = is_internal(table, transition)
    text = f"{transition.source} --{event}{guards}--> {transition.target}"
    return f"{text} (internal)" if internal else text


def other_imports(chart: ChartLike) -> list[str]:
    """The other module names under which this process imported the file declaring ``chart``
    (``app.kettle`` loaded, the tests' ``kettle``): each is a class of its own, whose runs a
    recorder tracking ``chart`` never hears. Sorted; empty when there are none."""
    declaration = compiled(chart).declaration
    home = sys.modules.get(declaration.__module__)
    path = getattr(home, "__file__", None)
    if not path:
        return []
    found = []
    for name, module in list(sys.modules.items()):
        other = getattr(module, "__file__", None)
        if module is home or not other:
            continue
        try:
            same = os.path.samefile(other, path)
        except OSError:
            continue
        if not same:  # (another file's module: never asked for the name, its __getattr__ may raise)
            continue
        try:  # (by the name its module binds it to: a factory's chart, ``Hotfix``, bears
            # the class name it was given, ``Pipeline``, which its module binds to nothing)
            twin = getattr(module, bound_name(declaration), None)
        except Exception:  # noqa: BLE001 - a module's own __getattr__ may raise anything
            continue
        if isinstance(twin, type) and twin is not declaration:
            found.append(name)
    return sorted(found)


def import_directory(chart: ChartLike, name: str, searched: Iterable[str],
                     cwd: str | None = None) -> str | None:
    """The directory module ``name`` (one of ``other_imports(chart)``) of the file declaring
    ``chart`` is imported from, relative to ``cwd`` (default: the current directory), when it
    is none of the ``searched`` ``sys.path`` entries; None when it is one, or is not known.
    ``MODULE:CLASS`` is imported from ``searched``: a module found only from a directory the
    tests put on ``sys.path`` themselves (``sys.path.insert`` in a test, after the chart was
    loaded) is not found from there, so ``name:Class`` alone would be refused
    (``cannot import module``) unless that directory is added (``PYTHONPATH``)."""
    declaration = compiled(chart).declaration
    home = sys.modules.get(declaration.__module__)
    file = getattr(home, "__file__", None)
    if not isinstance(file, str) or not file:
        return None
    root = os.path.dirname(os.path.realpath(file))
    if os.path.basename(file) == "__init__.py":
        root = os.path.dirname(root)
    for _ in name.split(".")[:-1]:
        root = os.path.dirname(root)
    base = cwd or os.getcwd()
    if any(os.path.realpath(os.path.join(base, entry)) == root for entry in searched):
        return None
    try:
        return os.path.relpath(root, base)
    except ValueError:  # another drive
        return root
