"""Stop 54's toolkit probe: a newcomer team's own charts (compound, parallel, history with a
default, odd names, ...) through every toolkit command; each test is a defect found there."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from statemachine import HistoryState, State, StateChart, StateMachine

from calexec.machines import diagrams, mutants
from calexec.machines.chart_contracts import ContractViolation, enable_contracts, invariant
from calexec.machines.compiled import compile_chart, compiled
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


#: a chart module that builds from its chart as it is imported, as an app does: a compiled
#: table, and an instance (whose guards python-statemachine resolves when it is made)
BUILT_AT_IMPORT = """
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
LIGHT = Light(Road())
"""

#: run in a process of its own, as the mutation runner runs a test command: the hook
#: install_from_env sets stays in the process
AFTER_THE_HOOK = """
import json, sys
from calexec.machines import mutants
from statemachine.exceptions import TransitionNotAllowed
from calexec.machines.compiled import ChartTransitionError

mutants.install_from_env()
import light_built

said = {}
try:
    light_built.TABLE.run(light_built.Road()).send("go")
    said["table"] = "taken"
except ChartTransitionError as refused:
    said["table"] = type(refused).__name__
try:
    light_built.LIGHT.send("go")
    said["instance"] = "taken"
except TransitionNotAllowed:
    said["instance"] = "refused"
print(json.dumps(said))
"""


@pytest.mark.parametrize(("mutant", "table"), [
    ("drop:red-go->green", "IllegalTransition"),
    ("guard-false:red-go->green:clear", "GuardRejected"),
])
def test_a_mutant_reaches_what_the_charts_module_builds_as_it_is_imported(
        tmp_path: Path, mutant: str, table: str) -> None:
    (tmp_path / "light_built.py").write_text(textwrap.dedent(BUILT_AT_IMPORT))
    ack = tmp_path / "ack"
    env = {k: v for k, v in os.environ.items() if k not in (mutants.ENV, mutants.ACK_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    env[mutants.ENV] = f"light_built:Light@{mutant}"
    env[mutants.ACK_ENV] = str(ack)
    out = subprocess.run([sys.executable, "-c", AFTER_THE_HOOK], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {"table": table, "instance": "refused"}
    assert ack.read_text() == f"light_built:Light@{mutant}\n"  # applied, and once


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
