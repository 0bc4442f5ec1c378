"""Stop 54's toolkit probe: a newcomer team's own charts (compound, parallel, history with a
default, odd names, ...) through every toolkit command; each test is a defect found there."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
from statemachine import HistoryState, State, StateChart, StateMachine

from calexec.machines import diagrams, mutants
from calexec.machines.chart_contracts import ContractViolation, enable_contracts, invariant
from calexec.machines.compiled import GuardRejected, IllegalTransition, compile_chart, compiled
from calexec.machines.coverage import TransitionRecorder, report, track
from calexec.machines.paths import as_data, state_paths, transition_paths, transition_tour


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


class Player(StateChart):
    """``resume`` is allowed from the start, before ``on`` was ever left: its history has
    recorded nothing and declares no default."""

    class on(State.Compound):
        playing = State(initial=True)
        paused = State()
        pause = playing.to(paused)
        h = HistoryState()

    off = State(initial=True)
    power = off.to(on) | on.to(off)
    resume = off.to(on.h)


def test_paths_name_a_history_entered_before_it_recorded_anything() -> None:
    machine = Player()
    machine.send("resume")
    assert list(machine.configuration) == []  # python-statemachine: nothing is active any more
    assert machine.send("power") is None and list(machine.configuration) == []
    for paths in (state_paths, transition_paths, transition_tour, as_data):
        with pytest.raises(ValueError) as refused:
            paths(compile_chart(Player))
        message = str(refused.value)
        assert "off --resume--> h (walk: resume) leaves no state active" in message, message
        assert "history state 'h' of 'on'" in message and "h.to(<state>)" in message, message


class Booting(StateChart):
    """The start's eventless transition enters a history that has recorded nothing."""

    class box(State.Compound):
        a = State(initial=True)
        b = State()
        n = a.to(b)
        h = HistoryState()

    boot = State(initial=True)
    boot.to(box.h)
    leave = box.to(boot)


def test_paths_name_a_history_the_start_enters_before_it_recorded_anything() -> None:
    assert list(Booting().configuration) == []
    with pytest.raises(ValueError, match=r"^Booting: the chart's start leaves no state active: "
                                         r"it enters history state 'h' of 'box'"):
        as_data(Booting)


def test_paths_of_a_history_with_a_default_enter_the_default() -> None:
    data = as_data(Drawer)
    assert data["ends"]["states"]["c"] == "box,c"
    assert [step["event"] for step in data["states"]["c"]] == ["enter"]


#: a chart module that compiles its chart as it is imported, as an app that runs the compiled
#: form does
COMPILED_AT_IMPORT = """
from statemachine import State, StateMachine
from calexec.machines.compiled import compiled


class Light(StateMachine):
    red = State(initial=True)
    green = State()
    go = red.to(green, cond="clear")
    stop = green.to(red)


class Road:
    def clear(self):
        return True


TABLE = compiled(Light)
"""


@pytest.mark.parametrize(("mutant", "refused"), [
    ("drop:red-go->green", IllegalTransition),
    ("guard-false:red-go->green:clear", GuardRejected),
])
def test_a_mutant_reaches_a_chart_its_module_compiles_at_import(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutant: str,
        refused: type[Exception]) -> None:
    module = f"light_compiled_{mutant.partition(':')[0].replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(COMPILED_AT_IMPORT))
    monkeypatch.syspath_prepend(str(tmp_path))
    ack = tmp_path / "ack"
    value = f"{module}:Light@{mutant}"
    mutants.install_from_env({mutants.ENV: value, mutants.ACK_ENV: str(ack)})
    try:
        light = __import__(module)
    finally:
        sys.modules.pop(module, None)
    assert ack.read_text() == value + "\n"  # applied, and once
    run = light.TABLE.run(light.Road())  # the table the module built as it was imported
    with pytest.raises(refused):
        run.send("go")


class Lamp(StateMachine):
    off = State(initial=True)
    on = State()
    flip = off.to(on) | on.to(off)


def test_coverage_counts_an_instance_made_before_tracking_began() -> None:
    """The app's one lamp, made as its module is imported (``LAMP = Lamp()``), which the
    pytest plugin and ``charts cover`` import before they call ``track``."""
    lamp = Lamp()  # alive before track, as a module-level instance is
    recorder = TransitionRecorder()
    undo = track(Lamp, recorder)
    try:
        lamp.send("flip")
        lamp.send("flip")
        later = Lamp()  # made while tracked: counted as before
        later.send("flip")
        (coverage,) = report([Lamp], recorder)
        assert (coverage.covered, coverage.declared) == (2, 2), coverage
    finally:
        undo()
    recorder.clear()
    lamp.send("flip")  # undone: nothing is recorded any more, from either instance
    later.send("flip")
    assert recorder.hits == set()


class Water:
    def __init__(self) -> None:
        self.litres = 1


class Kettle(StateMachine):
    cold = State(initial=True)
    boiling = State()
    heat = cold.to(boiling)
    cool = boiling.to(cold)

    @invariant("boiling")
    def has_water(water: Water) -> bool:
        return water.litres > 0


def test_contracts_are_checked_on_an_instance_made_before_they_were_enabled() -> None:
    """The app's one kettle, made as its module is imported (``KETTLE = Kettle(WATER)``),
    which ``--chart-contracts`` imports before it enables the contracts."""
    water = Water()
    kettle = Kettle(water)  # alive before the contracts are enabled
    monitor = enable_contracts(Kettle)
    try:
        water.litres = 0
        with pytest.raises(ContractViolation, match="has_water"):
            kettle.send("heat")
    finally:
        monitor.disable()
    assert [s.id for s in kettle.configuration] == ["boiling"]  # (an invariant: after)
    kettle.send("cool")
    kettle.send("heat")  # disabled: checked no more
    assert [s.id for s in kettle.configuration] == ["boiling"]


def test_tracking_leaves_a_general_runs_own_machine_alone() -> None:
    """A compiled general run keeps a bare instance of the chart class (no ``__init__`` run,
    no listeners of its own); one alive when tracking begins is heard through the compiled
    chart, as before, and not given the instance listener."""
    run = compiled(Player).run(object())
    recorder = TransitionRecorder()
    undo = track(Player, recorder)
    try:
        run.send("power")
    finally:
        undo()
    (coverage,) = report([Player], recorder)
    assert coverage.covered == 1, coverage
