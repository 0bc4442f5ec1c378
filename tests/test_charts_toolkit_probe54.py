"""Stop 54's toolkit probe: a newcomer team's own charts (compound, parallel, history with a
default, odd names, ...) through every toolkit command; each test is a defect found there."""

from __future__ import annotations

import re

from statemachine import HistoryState, State, StateMachine

from calexec.machines import diagrams
from calexec.machines.compiled import compile_chart


class Drawer(StateMachine):
    """A history state with a default (``h.to(c)``): entering ``box.h`` before ``box`` was
    ever left enters ``c``, not the initial ``a``."""

    class box(State.Compound):
        a = State(initial=True)
        b = State()
        c = State()
        h = HistoryState()
        nxt = a.to(b) | b.to(c) | c.to(a)
        h.to(c)

    out = State(initial=True)
    enter = out.to(box.h)
    leave = box.to(out)


def test_a_history_states_default_transition_is_drawn() -> None:
    machine = Drawer()
    machine.send("enter")
    assert [s.id for s in machine.configuration] == ["box", "c"]  # what the diagram must say
    dot = diagrams.render_chart_dot(compile_chart(Drawer))
    edge = re.search(r"^h -> c \[(.*)\];$", dot, re.MULTILINE)
    assert edge is not None, dot
    assert diagrams.HISTORY_DEFAULT in edge.group(1)
    assert "style=dashed" in edge.group(1)
