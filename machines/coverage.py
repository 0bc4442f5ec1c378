"""Transition coverage: which declared transitions were actually taken.

``RECORDER`` collects ``(chart name, transition id)`` keys. ``ChartRun.send`` adds to it when
``RECORDER.enabled`` (one attribute test and one ``set.add``; off by default, the pytest plugin
switches it on). Real python-statemachine instances report through ``TransitionListener``,
passed as ``listeners=[TransitionListener(chart)]``. ``set.add`` is atomic under the GIL, so
several threads may record at once.

This module must not import ``compiled`` at import time (``compiled`` imports the recorder);
reports take the compiled charts as arguments.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from calexec.machines.compiled import CompiledChart, Transition


class TransitionRecorder:
    """A switchable set of taken transition keys ``(chart name, transition id)``."""

    __slots__ = ("enabled", "hits")

    def __init__(self) -> None:
        self.enabled = False
        self.hits: set[tuple[str, int]] = set()

    def record(self, key: tuple[str, int]) -> None:
        """Record one taken transition (ignored while disabled)."""
        if self.enabled:
            self.hits.add(key)

    def clear(self) -> None:
        """Forget every recorded transition."""
        self.hits.clear()


RECORDER = TransitionRecorder()


class TransitionListener:
    """python-statemachine listener that records the transitions a real instance takes."""

    def __init__(self, chart: CompiledChart, recorder: TransitionRecorder = RECORDER) -> None:
        self.chart = chart
        self.recorder = recorder

    def after_transition(self, event: Any, transition: Any) -> None:
        """Called by python-statemachine after each transition (``event`` is the trigger)."""
        taken = self.chart.by_declared.get((id(transition), str(event)))
        if taken is not None:  # the initial pseudo-transition is not a declared one
            self.recorder.record(taken.key)


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


def report(
    charts: Iterable[CompiledChart], recorder: TransitionRecorder = RECORDER
) -> list[ChartCoverage]:
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
