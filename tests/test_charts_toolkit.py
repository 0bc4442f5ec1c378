"""The statechart toolkit's public API on a chart that is not calexec's (issue 26): every tool
takes the chart class; ``calexec charts draw|paths MODULE:CLASS`` on a user's project, with
their bad input named in one line (exit 2); calexec's own charts through the same API render
exactly the committed diagrams."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from statemachine import State, StateMachine

from calexec.cli import main as cli
from calexec.machines import diagrams
from calexec.machines.chartref import load_chart
from calexec.machines.charts import DECLARED
from calexec.machines.compiled import CHARTS, compile_chart, compiled
from calexec.machines.coverage import TransitionRecorder, report, track
from calexec.machines.paths import GuardTable, as_data, drive, state_paths, transition_tour

REPO = Path(__file__).resolve().parent.parent


class Door(StateMachine):
    """A chart of the test's own: a guarded event with a fallback, a self-loop, two finals."""

    closed = State(initial=True)
    opened = State()
    locked = State()
    removed = State(final=True)
    broken = State(final=True)

    open = closed.to(opened, cond="has_handle") | closed.to(broken)
    close = opened.to(closed)
    lock = closed.to(locked, unless="jammed")
    unlock = locked.to.itself(cond="jammed") | locked.to(closed)  # type: ignore[no-untyped-call]
    remove = opened.to(removed)


def test_one_compiled_form_per_class_named_after_it():
    chart = compiled(Door)
    assert compiled(Door) is chart and compiled(chart) is chart
    assert chart.name == "Door" and chart.declaration is Door
    assert chart.initial == "closed" and chart.finals == {"removed", "broken"}
    assert compile_chart(Door) is not chart  # a fresh table, listeners of its own
    with pytest.raises(ValueError, match="already compiled as 'Door', not 'door'"):
        compiled(Door, "door")
    with pytest.raises(TypeError, match="is not a python-statemachine chart class"):
        compiled(State)  # type: ignore[arg-type]


def test_diagram_of_a_user_chart_names_its_own_module():
    dot = diagrams.render_chart_dot(Door)
    assert dot == diagrams.render_chart_dot(compiled(Door))
    assert f"Door (declared in {Door.__module__.replace('.', '/')}.py)" in dot
    assert "calexec/machines/charts.py" not in dot
    assert "Open [has_handle]" in dot and "Open [else]" in dot and "Lock [!jammed]" in dot


def test_calexec_charts_render_their_committed_diagrams_through_the_same_api():
    for name, declaration in DECLARED.items():
        committed = (REPO / "diagrams" / f"{name}.dot").read_text(encoding="utf-8")
        assert diagrams.render_chart_dot(declaration) == committed, name
        assert diagrams.render_chart_dot(CHARTS[name]) == committed, name
        assert compiled(declaration) is CHARTS[name]


def test_state_paths_and_tour_drive_real_instances_to_every_state_and_transition():
    recorder = TransitionRecorder()
    undo = track(Door, recorder)
    try:
        for state, walk in state_paths(Door).items():
            model = GuardTable.for_chart(Door)
            machine = Door(model)
            for step, outcomes in zip(walk.steps, walk.guards):
                model.outcomes = dict(outcomes)
                machine.send(step.event)
            assert list(machine.configuration_values) == [state] and walk.end == state
        recorder.clear()
        tour = transition_tour(Door)
        for walk in tour:
            model = GuardTable.for_chart(Door)
            machine = Door(model)
            for step, outcomes in zip(walk.steps, walk.guards):
                model.outcomes = dict(outcomes)
                machine.send(step.event)
        (coverage,) = report([Door], recorder)
        assert coverage.complete and coverage.percent == 100.0, coverage.untaken
        assert len(tour) == 2  # two finals: a walk ends in each
    finally:
        undo()
    recorder.clear()
    Door(GuardTable.for_chart(Door, default=False)).send("lock")
    assert recorder.hits == set()  # untracked: the class listener is gone


def test_tracked_compiled_runs_are_recorded_too():
    recorder = TransitionRecorder()
    undo = track(Door, recorder)
    try:
        for walk in transition_tour(Door):
            drive(compiled(Door).run(GuardTable.for_chart(Door)), walk)
    finally:
        undo()
    assert report([Door], recorder)[0].complete


def test_paths_as_data_is_json_a_test_can_iterate():
    data = json.loads(json.dumps(as_data(Door)))
    assert data["class"] == f"{Door.__module__}:Door" and data["initial"] == "closed"
    assert data["states"]["broken"] == [
        {"event": "open", "from": "closed", "to": "broken", "guards": {"has_handle": False}}]
    assert len(data["transitions"]) == len(compiled(Door).transitions)
    taken = {(s["from"], s["event"], s["to"]) for walk in data["tour"] for s in walk}
    assert taken == {(t.source, t.event, t.target) for t in compiled(Door).transitions}


class Kiosk(StateMachine):
    """Compound and parallel states: where a path ends is more than its last step's target."""

    class on(State.Compound):  # noqa: N801 - a state's id is its name
        class lit(State.Parallel):  # noqa: N801
            class screen(State.Compound):  # noqa: N801
                dark = State(initial=True)
                bright = State()
                glow = dark.to(bright)
            class door(State.Compound):  # noqa: N801
                shut = State(initial=True)
                ajar = State()
                pull = shut.to(ajar, cond="unlocked")
        idle = State(initial=True)
        wake = idle.to(lit)
    off = State(final=True)
    unplug = on.to(off)


def test_paths_json_says_the_configuration_each_path_ends_in():
    """stop 44: ``--json`` gave each step's target only, so a test could not tell the
    configuration a walk of a hierarchical chart ends in (its regions, its ancestors)."""
    data = json.loads(json.dumps(as_data(Kiosk)))
    ends = data["ends"]
    assert ends["states"]["ajar"] == "on,lit,screen,dark,door,ajar"
    assert ends["states"]["idle"] == "on,idle"
    index = {(t["from"], t["event"]): i for i, t in enumerate(data["transitions"])}
    assert ends["transitions"][index[("shut", "pull")]] == "on,lit,screen,dark,door,ajar"
    assert ends["transitions"][index[("on", "unplug")]] == "off"
    assert len(ends["tour"]) == len(data["tour"]) and "off" in ends["tour"]
    for walk, end in zip(data["tour"], ends["tour"]):  # the end is where a real instance is
        model = GuardTable.for_chart(Kiosk)
        machine = Kiosk(model)
        for step in walk:
            model.outcomes = step["guards"]
            machine.send(step["event"])
        assert set(machine.configuration_values) == set(end.split(","))
    flat = as_data(Door)["ends"]
    assert flat["states"] == {state: state for state in compiled(Door).states}
    assert flat["transitions"] == [t.target for t in compiled(Door).transitions]


# ---- the commands, run from a user's project directory --------------------------------------
PROJECT = """
    from statemachine import State, StateMachine


    class Light(StateMachine):
        off = State(initial=True)
        on = State()
        gone = State(final=True)

        switch = off.to(on, cond="powered") | on.to(off)
        unplug = on.to(gone)


    NOT_A_CHART = 42


    class Base(StateMachine):  # a base the project's charts share: no states of its own
        pass
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project directory holding ``<module>.py`` (a name of its own per test: the
    import is cached) with the chart ``Light``; the commands run from it."""
    module = f"light_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(PROJECT))
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "exiting_mod.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path, module


def test_paths_command_prints_text_and_json(project, capsys):
    _, module = project
    assert cli(["charts", "paths", f"{module}:Light"]) == 0
    out = capsys.readouterr().out
    assert "shortest path to every state:" in out and "  gone: switch[powered] unplug" in out
    assert cli(["charts", "paths", f"{module}:Light", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chart"] == "Light" and set(data["states"]) == {"off", "on", "gone"}
    assert sum(len(walk) for walk in data["tour"]) >= 3
    assert data["ends"]["tour"] == ["gone"] and data["ends"]["states"]["gone"] == "gone"


@pytest.mark.requires_tool("dot")
def test_draw_writes_then_check_passes_and_a_stale_file_fails(project, capsys):
    root, module = project
    assert cli(["charts", "draw", f"{module}:Light", "--png"]) == 0
    assert sorted(p.name for p in (root / "diagrams").iterdir()) == [
        "Light.dot", "Light.png", "Light.svg"]
    dot = (root / "diagrams" / "Light.dot").read_text()
    assert f"Light (declared in {module}.py)" in dot
    assert cli(["charts", "draw", f"{module}:Light", "--png", "--check"]) == 0
    (root / "diagrams" / "Light.dot").write_text(dot + "// edited by hand\n")
    capsys.readouterr()
    assert cli(["charts", "draw", f"{module}:Light", "--check"]) == 1
    err = capsys.readouterr().err
    assert "Light.dot: differs from the declared chart" in err
    assert f"fix: calexec charts draw {module}:Light" in err


def test_check_without_files_fails_naming_them(project, capsys):
    _, module = project
    assert cli(["charts", "draw", f"{module}:Light", "--check", "--out", "nowhere"]) == 1
    err = capsys.readouterr().err
    assert "nowhere/Light.dot: missing" in err and "nowhere/Light.svg: missing" in err


@pytest.mark.parametrize("command", ["draw", "paths"])
@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("{m}", "'{m}': expected MODULE:CLASS"),
        ("no_such_module:Light", "'no_such_module:Light': cannot import module 'no_such_module'"),
        ("broken_mod:Light", "'broken_mod:Light': cannot import module 'broken_mod' from "),
        ("{m}:Nope", "'{m}:Nope': module '{m}' has no attribute 'Nope'"),
        ("{m}:NOT_A_CHART", "'{m}:NOT_A_CHART': NOT_A_CHART is int 42, not a python-statemachine "
                            "chart class"),
        ("{m}:State", "'{m}:State': State is type"),
        # found following docs/framework.md as a newcomer: each of these exited 70 (internal
        # error), exited 3 with no message, or blamed a relative import
        ("{m}:Base", "'{m}:Base': Base declares no states"),
        ("exiting_mod:Light", "'exiting_mod:Light': cannot import module 'exiting_mod' from "),
        ("./{m}.py:Light", "'./{m}.py:Light': './{m}.py' is a file path, not a module name: "
                           "name the module, without the path and .py: {m}:Light"),
        ("{m}.py:Light", "'{m}.py:Light': '{m}.py' is a file path"),
    ],
    ids=["no-colon", "no-module", "module-raises", "no-attribute", "not-a-class", "not-a-chart",
         "no-states", "module-exits", "file-path", "file-name"],
)
def test_bad_chart_reference_is_one_line_exit_2(project, capsys, command, ref, message):
    _, module = project
    ref, message = ref.format(m=module), message.format(m=module)
    assert cli(["charts", command, ref]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].startswith(f"calexec charts {command}: {message}"), lines[0]
    assert captured.out == ""


def test_a_file_path_of_a_package_module_is_answered_with_its_dotted_module(project, capsys):
    """A newcomer gives ``pkg/chart.py:Light`` for a chart in a package of the project: the
    answer said to run from ``pkg/`` and name ``chart:Light``, which fails on the package's
    relative imports (``attempted relative import with no known parent package``); it names
    the module as imported from the project directory, ``pkg.chart:Light``, which works."""
    root, module = project
    package = root / f"pkg_{module}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "rules.py").write_text("POWER = 'powered'\n")
    (package / "chart.py").write_text(
        "from statemachine import State, StateMachine\n\nfrom .rules import POWER\n\n\n"
        "class Light(StateMachine):\n    off = State(initial=True)\n    on = State()\n"
        "    switch = off.to(on, cond=POWER) | on.to(off)\n")
    for given in (f"pkg_{module}/chart.py", f"./pkg_{module}/chart", str(package / "chart.py")):
        assert cli(["charts", "paths", f"{given}:Light"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line == (f"calexec charts paths: '{given}:Light': '{given}' is a file path, not a "
                        f"module name: name the module, as imported from {root} "
                        f"(e.g. pkg_{module}.chart:Light)"), line
    assert cli(["charts", "paths", f"pkg_{module}.chart:Light"]) == 0
    assert "switch[powered]" in capsys.readouterr().out


def test_compiling_a_chart_base_class_without_states_is_a_value_error_naming_it():
    """python-statemachine accepts a chart class that declares no state (an abstract base);
    compiling one failed with ``AttributeError: ... 'initial_state'`` (exit 70 from the
    commands and the pytest plugin's INTERNALERROR)."""

    class NoStates(StateMachine):
        pass

    with pytest.raises(ValueError, match="NoStates declares no states"):
        compile_chart(NoStates)


KETTLE = """
    from statemachine import State, StateChart


    class Kettle(StateChart):
        cold = State(initial=True)
        boiling = State()
        whistling = State(final=True)
        heat = cold.to(boiling)
        boiling.to(whistling)  # eventless: as soon as it boils
"""


def test_an_eventless_transition_is_named_eventless_by_paths_and_cover(project, capsys):
    """It was printed ``boiling ----> whistling`` (an empty event between the dashes) by
    ``charts paths``, the coverage listings and contract violations."""
    from calexec.machines.coverage import describe

    root, module = project
    (root / f"kettle_{module}.py").write_text(textwrap.dedent(KETTLE))
    assert cli(["charts", "paths", f"kettle_{module}:Kettle"]) == 0
    out = capsys.readouterr().out
    assert "  boiling --(eventless)--> whistling: heat" in out, out
    chart = compiled(load_kettle(module))
    (eventless,) = [t for t in chart.transitions if t.event == ""]
    assert describe(eventless) == "boiling --(eventless)--> whistling"


def load_kettle(module: str) -> type:
    from calexec.machines.chartref import load_chart

    return load_chart(f"kettle_{module}:Kettle")


def test_check_of_a_file_that_is_not_utf8_is_stale_not_an_internal_error(project, capsys):
    """``charts draw --check`` read the files as UTF-8: a binary file under the .dot or .svg
    name was ``internal error: UnicodeDecodeError``, exit 70."""
    root, module = project
    (root / "diagrams").mkdir()
    (root / "diagrams" / "Light.dot").write_bytes(b"\xff\xfe\x00 not text")
    (root / "diagrams" / "Light.svg").write_bytes(b"\x1f\x8b\x08\x00\xff binary")
    assert cli(["charts", "draw", f"{module}:Light", "--check"]) == 1
    err = capsys.readouterr().err
    assert "Light.dot: differs from the declared chart" in err, err
    assert "Light.svg: not rendered from the current DOT" in err, err


def test_paths_json_is_json_when_the_chart_module_prints_at_import(project, capsys):
    """A newcomer's package prints a banner when imported (``print`` in ``__init__``):
    ``charts paths --json`` wrote it before the JSON, so ``... --json | jq`` failed. What the
    module prints goes to stderr; the JSON alone to stdout."""
    root, module = project
    package = root / f"noisy_{module}"
    package.mkdir()
    (package / "__init__.py").write_text(
        f"print('noisy package imported')\nfrom {module} import Light\n")
    assert cli(["charts", "paths", f"noisy_{module}:Light", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["chart"] == "Light"
    assert "noisy package imported" in captured.err


def test_a_path_whose_guard_the_chart_class_answers_itself_names_that_guard():
    """A newcomer declares a guard as a method of the chart class (``def ready(self)``, as
    python-statemachine's docs do): paths name ``go[ready]``, but a run driven with a
    ``GuardTable`` never hears the outcome (python-statemachine asks the chart before the
    model), and ``drive`` said the step was not taken because 'a StateChart ignores a refused
    event and turns an action's error into error.execution', which sends them looking for an
    error that is not there. It names the guard, where it is declared, and what to do."""
    from statemachine import StateChart

    from calexec.machines.paths import PathNotFollowed

    class Own(StateChart):
        a = State(initial=True)
        b = State()
        c = State(final=True)
        go = a.to(b, cond="ready") | a.to(c)
        fin = b.to(c)

        def ready(self) -> bool:
            return False

    chart = compile_chart(Own)
    walk = next(w for w in transition_tour(chart) if w.events == ("go", "fin"))
    with pytest.raises(PathNotFollowed) as caught:
        drive(chart.run(GuardTable.for_chart(chart)), walk)
    assert str(caught.value) == (
        "Own: step 1 of 2, a --go--> b, was not taken: the run is in 'c' (guard(s) 'ready' "
        "(of Own) are methods of the chart class, which python-statemachine asks before the "
        "model: the outcomes the step set on the model were not heard; move them to the model, "
        "or drive the chart with a model of your own)")


def test_draw_refuses_to_overwrite_another_module_s_chart_of_the_same_name(project, capsys):
    """stop 44: ``charts draw a:Light`` then ``charts draw b:Light`` into one ``--out``
    silently replaced the first chart's files (both are ``Light.*``)."""
    root, module = project
    other = f"other_{module}"
    (root / f"{other}.py").write_text(textwrap.dedent(PROJECT))
    out = root / "diagrams"
    out.mkdir()
    first = diagrams.render_chart_dot(compiled(load_chart(f"{module}:Light")))
    (out / "Light.dot").write_text(first)  # what `charts draw {module}:Light` wrote
    assert cli(["charts", "draw", f"{other}:Light"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines == [f"calexec charts draw: {other}:Light: {Path('diagrams', 'Light.dot')} is "
                     f"the diagram of another chart named Light, declared in {module}.py (this "
                     f"one is declared in {other}.py); draw one of them into another --out, or "
                     f"delete {Path('diagrams', 'Light.dot')} to replace it"], captured.err
    assert (out / "Light.dot").read_text() == first  # untouched
    assert cli(["charts", "draw", f"{other}:Light", "--check"]) == 1
    assert (f"Light.dot: the diagram of another chart named Light, declared in {module}.py "
            f"(this one is declared in {other}.py)") in capsys.readouterr().err
    cli(["charts", "draw", f"{module}:Light"])  # its own chart: redrawn (or graphviz named)
    assert "another chart" not in capsys.readouterr().err
