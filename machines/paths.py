"""Model-based test paths from a compiled chart (as XState's graph utilities).

For every declared transition: the shortest event path from the initial state that ends by
taking it (breadth-first over states, guards considered satisfiable). Because the first
transition whose guards pass wins, each step also carries the guard outcomes that make that
step's transition the winner (its ``cond`` true, its ``unless`` false, and one guard of every
earlier candidate for the same state and event failing). A driver sets those outcomes on its
model (for the executor: the fault plan) before sending the step's event.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from types import MappingProxyType

import attrs

from calexec.machines.compiled import ChartRun, CompiledChart, Transition


@attrs.frozen
class Path:
    """The shortest way to take ``transition``: ``steps[-1] is transition``.

    ``events[i]`` is ``steps[i].event``; ``guards[i]`` maps guard name -> required outcome for
    step ``i`` (guards not named are irrelevant to that step).
    """

    transition: Transition
    steps: tuple[Transition, ...]
    guards: tuple[Mapping[str, bool], ...]

    @property
    def events(self) -> tuple[str, ...]:
        return tuple(step.event for step in self.steps)

    @property
    def target(self) -> str:
        return self.transition.target


def winning_guards(chart: CompiledChart, transition: Transition) -> Mapping[str, bool] | None:
    """Guard outcomes under which ``transition`` is the one taken, or ``None`` if it is
    shadowed (an earlier candidate for the same state and event can never be refused).

    Greedy: each earlier candidate is refused by its first guard not already fixed the other
    way; enough for the declared charts, where guards of competing transitions do not clash.
    """
    outcome: dict[str, bool] = {name: True for name in transition.conds}
    for name in transition.unless:
        if outcome.get(name) is True:
            return None
        outcome[name] = False
    for earlier in chart.table[(transition.source, transition.event)]:
        if earlier is transition:
            return MappingProxyType(outcome)
        refusals = [(n, False) for n in earlier.conds] + [(n, True) for n in earlier.unless]
        for name, value in refusals:
            if outcome.get(name, value) == value:
                outcome[name] = value
                break
        else:
            return None
    raise ValueError(f"{chart.name}: transition {transition} is not in its own table slot")


def transition_paths(chart: CompiledChart) -> list[Path]:
    """One shortest path per declared transition, in ``chart.transitions`` order.

    Raises ``ValueError`` naming any transition that is shadowed or whose source state is
    unreachable: both are declaration bugs.
    """
    guards = {t.id: winning_guards(chart, t) for t in chart.transitions}
    reach: dict[str, tuple[Transition, ...]] = {chart.initial: ()}
    frontier = deque([chart.initial])
    while frontier:
        state = frontier.popleft()
        for transition in chart.outgoing(state):
            if guards[transition.id] is not None and transition.target not in reach:
                reach[transition.target] = reach[state] + (transition,)
                frontier.append(transition.target)
    paths = []
    for transition in chart.transitions:
        if guards[transition.id] is None:
            raise ValueError(f"{chart.name}: transition {transition} can never be taken (shadowed)")
        if transition.source not in reach:
            raise ValueError(f"{chart.name}: source of {transition} is unreachable")
        steps = reach[transition.source] + (transition,)
        # every step's guards are known: a shadowed transition is never on a path (the BFS skips it)
        paths.append(Path(transition, steps, tuple(guards[s.id] or {} for s in steps)))
    return paths


class GuardTable:
    """A model for driving bare charts: guard ``name`` returns ``outcomes.get(name, default)``.

    Build one with ``GuardTable.for_chart(chart)``: python-statemachine resolves guard names
    on the model when an instance is created, so the guards must exist as methods.
    """

    def __init__(self, outcomes: Mapping[str, bool] | None = None, default: bool = True) -> None:
        self.outcomes: dict[str, bool] = dict(outcomes or {})
        self.default = default

    @classmethod
    def for_chart(cls, chart: CompiledChart, **kwargs: object) -> GuardTable:
        """An instance whose class has one method per guard name of ``chart``."""
        methods = {name: _guard_method(name) for name in sorted(chart.guard_names)}
        table: GuardTable = type(f"{cls.__name__}_{chart.name}", (cls,), methods)(**kwargs)
        return table


def _guard_method(name: str) -> Callable[[GuardTable], bool]:
    def guard(self: GuardTable) -> bool:
        return self.outcomes.get(name, self.default)

    guard.__name__ = name
    return guard


def drive(run: ChartRun, path: Path) -> str:
    """Send ``path``'s events to ``run`` (whose model is a ``GuardTable``), setting each step's
    guard outcomes first; return the final state. Raises as ``ChartRun.send`` does."""
    for step, outcomes in zip(path.steps, path.guards):
        run.model.outcomes = dict(outcomes)
        run.send(step.event)
    return run.state
