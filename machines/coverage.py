"""Transition coverage: which declared transitions were actually taken.

A ``TransitionRecorder`` collects ``(chart name, transition id)`` keys. It is a chart listener:
whoever wants coverage attaches one to the compiled charts it cares about
(``chart.attach(recorder)``, or ``with recording(charts) as recorder:``), and every
``ChartRun.send`` on those charts then adds the taken transition's key. Nothing is recorded,
and nothing global is consulted on the hot path, when no recorder is attached (production).
The test suite's plugin (tests/transition_coverage_plugin.py) attaches one to every chart for
the session; a test may attach its own beside it for one scenario. Real python-statemachine
instances report through ``TransitionListener``, passed as
``listeners=[TransitionListener(chart)]``: to the chart's listeners, or to one recorder.
``set.add`` is atomic under the GIL, so several threads may record at once.

This module imports ``compiled`` only for type names: the charts never depend on coverage.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from calexec.machines.compiled import CompiledChart, Transition


class TransitionRecorder:
    """The set of taken transition keys ``(chart name, transition id)``; a chart listener
    (``chart.attach(recorder)``): calling it with a ``Transition`` records its key."""

    __slots__ = ("hits",)

    def __init__(self) -> None:
        self.hits: set[tuple[str, int]] = set()

    def __call__(self, transition: Transition) -> None:
        self.hits.add(transition.key)

    def clear(self) -> None:
        """Forget every recorded transition."""
        self.hits.clear()


@contextmanager
def recording(charts: Iterable[CompiledChart]) -> Iterator[TransitionRecorder]:
    """A fresh recorder attached to ``charts`` for the ``with`` block (detached after it;
    other listeners, such as the suite's recorder, keep recording beside it)."""
    charts = tuple(charts)
    recorder = TransitionRecorder()
    for chart in charts:
        chart.attach(recorder)
    try:
        yield recorder
    finally:
        for chart in charts:
            chart.detach(recorder)


class TransitionListener:
    """python-statemachine listener that reports the transitions a real instance of
    ``chart``'s declaration takes: to ``recorder`` when given, else to the chart's listeners
    (as if a ``ChartRun`` of it had taken them)."""

    def __init__(self, chart: CompiledChart, recorder: TransitionRecorder | None = None) -> None:
        self.chart = chart
        self.recorder = recorder

    def after_transition(self, event: Any, transition: Any) -> None:
        """Called by python-statemachine after each transition (``event`` is the trigger)."""
        taken = self.chart.by_declared.get((id(transition), str(event)))
        if taken is None:  # the initial pseudo-transition is not a declared one
            return
        if self.recorder is not None:
            self.recorder(taken)
        else:
            self.chart.notify(taken)


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

    def line(self) -> str:
        """``transition coverage <chart>: <covered>/<declared>``."""
        return f"transition coverage {self.chart}: {self.covered}/{self.declared}"


def report(charts: Iterable[CompiledChart], recorder: TransitionRecorder) -> list[ChartCoverage]:
    """Per-chart coverage of ``charts`` from what ``recorder`` saw."""
    result = []
    for chart in charts:
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


def describe(transition: Transition) -> str:
    """``Source --event [guards]--> Target`` for listings of untaken transitions."""
    guards = f" [{', '.join(transition.guards)}]" if transition.guards else ""
    return f"{transition.source} --{transition.event}{guards}--> {transition.target}"
