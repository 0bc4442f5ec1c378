"""The toolkit on hierarchical charts (issue 26): paths by configuration, transition coverage
of the general run and of python-statemachine instances, mutants derived and applied, and the
diagram's clusters, on charts with compound, parallel and history states."""

from __future__ import annotations

import pytest
from statemachine import HistoryState, State, StateChart

from calexec.machines import diagrams, mutants
from calexec.machines.compiled import compile_chart, compiled
from calexec.machines.coverage import TransitionListener, TransitionRecorder, recording, report
from calexec.machines.paths import (
    GuardTable,
    drive,
    state_paths,
    transition_paths,
    transition_tour,
)


def lamp() -> type[StateChart]:
    """A fresh chart class per call (mutation changes a class in place)."""

    class Lamp(StateChart):
        class lit(State.Parallel):
            class colour(State.Compound):
                warm = State(initial=True)
                cold = State()
                shift = warm.to(cold, cond="allowed") | cold.to(warm)

            class power(State.Compound):
                low = State(initial=True)
                high = State()
                spent = State(final=True)
                boost = low.to(high)
                burn = high.to(spent)

            h = HistoryState(type="deep")

        dark = State(initial=True)
        switch = dark.to(lit) | lit.to(dark)
        restore = dark.to(lit.h)
        done_state_power = lit.to(dark)

    return Lamp


def test_state_paths_reach_every_state_by_configuration() -> None:
    chart = compile_chart(lamp())
    walks = state_paths(chart)
    assert set(walks) == set(chart.states)
    assert walks["cold"].events == ("switch", "shift")
    assert walks["cold"].end == "lit,colour,power,low,cold"
    assert walks["cold"].guards[-1] == {"allowed": True}
    # spent is entered and left in one macrostep (done.state.power leaves lit)
    assert walks["spent"].events == ("switch", "boost", "burn") and walks["spent"].end == "dark"


def test_transition_paths_and_the_tour_take_every_transition_on_a_real_run() -> None:
    chart = compile_chart(lamp())
    assert [p.transition for p in transition_paths(chart)] == list(chart.transitions)
    tour = transition_tour(chart)
    with recording([chart]) as recorder:
        for walk in tour:
            run = chart.run(GuardTable.for_chart(chart))
            end = drive(run, walk)  # type: ignore[arg-type]
            assert end == walk.end
    assert report([chart], recorder)[0].complete, [t for t in chart.transitions
                                                  if t.key not in recorder.hits]


def test_a_done_state_transition_is_reached_by_the_events_that_raise_it() -> None:
    """Only the chart raises ``done.state.power`` (when ``power`` reaches its final child):
    its path and the tour reach it by ``boost``, ``burn``, as docs/framework.md says. They
    sent ``done.state.power`` itself from outside (``switch``, ``done.state.power``), which a
    test following them would do with the lamp's power never spent."""
    chart = compile_chart(lamp())
    (path,) = [p for p in transition_paths(chart) if p.transition.event == "done.state.power"]
    assert path.events == ("switch", "boost", "burn")
    sent = {event for walk in transition_tour(chart) for event in walk.events}
    assert not any(event.startswith("done.state.") for event in sent), sent


def menu(guarded: bool) -> type[StateChart]:
    """``back`` inside the menu goes up a level (from ``sub``, where the menu opens); from
    ``main`` the menu's own ``back`` leaves it. ``guarded``: going up needs ``has_parent``."""

    class Menu(StateChart):
        class menu(State.Compound):
            sub = State(initial=True)
            main = State()
            back = sub.to(main, cond="has_parent") if guarded else sub.to(main)
            open_sub = main.to(sub)

        home = State(initial=True)
        enter = home.to(menu)
        back = menu.to(home)

    return Menu


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded-child", "guarded-child"])
def test_a_path_takes_its_transition_where_a_child_has_the_same_event(guarded: bool) -> None:
    """A state's transitions are selected before its ancestors': in ``sub``, ``back`` is the
    child's. The path of ``menu --back--> home`` was ``enter back`` with no guard outcome (a
    real run went to ``main``); now it goes on to ``main`` first, or refuses the child's guard.
    Likewise a transition shadowed by an unguarded one declared before it is named, as on a
    flat chart (it was given a path)."""
    chart = compile_chart(menu(guarded))
    for path in transition_paths(chart):
        with recording([chart]) as recorder:
            drive(chart.run(GuardTable.for_chart(chart)), path)  # type: ignore[arg-type]
        assert path.transition.key in recorder.hits, (path.transition, path.events, path.guards)
    (leave,) = [p for p in transition_paths(chart) if p.transition.target == "home"]
    if guarded:
        assert leave.events == ("enter", "back") and leave.guards[-1] == {"has_parent": False}
    else:
        assert leave.events == ("enter", "back", "back")


def test_a_shadowed_transition_of_a_hierarchical_chart_is_named() -> None:
    class Shadowed(StateChart):
        class box(State.Compound):
            a = State(initial=True)
            b = State()
            c = State()
            go = a.to(b) | a.to(c)
            back = b.to(a) | c.to(a)

    with pytest.raises(ValueError, match=r"transition a --go--> c can never be taken "
                                         r"\(shadowed by a --go--> b"):
        transition_paths(Shadowed)


def test_an_event_of_two_regions_moves_both_on_the_paths_as_on_a_real_run() -> None:
    """``toggle`` is declared in both regions of a parallel state: a real run toggles both.
    The configuration graph took one candidate per event, so the walks' ends (and the
    configurations behind every later step) were ones no run reaches: the walk to ``l_on``
    ended in ``l_on, r_off``, the tour's in ``l_off, r_broken`` where a real run is in
    ``l_on, r_broken``."""

    class Lights(StateChart):
        class both(State.Parallel):
            class left(State.Compound):
                l_off = State(initial=True)
                l_on = State()
                toggle = l_off.to(l_on) | l_on.to(l_off)

            class right(State.Compound):
                r_off = State(initial=True)
                r_on = State()
                r_broken = State()
                toggle = r_off.to(r_on) | r_on.to(r_off)
                smash = r_on.to(r_broken)

        idle = State(initial=True)
        start = idle.to(both)

    def real_end(events: tuple[str, ...]) -> str:
        lights = Lights()
        for event in events:
            lights.send(event)
        return ",".join(lights.configuration_values)

    chart = compile_chart(Lights)
    walks = state_paths(chart)
    assert set(walks["l_on"].end.split(",")) >= {"l_on", "r_on"}
    for state, walk in walks.items():
        if state in walk.end.split(","):  # not a state entered and left in one macrostep
            assert set(walk.end.split(",")) == set(real_end(walk.events).split(",")), state
    for walk in transition_tour(chart):
        assert set(walk.end.split(",")) == set(real_end(walk.events).split(",")), walk.events


def test_coverage_counts_the_general_run_and_python_statemachine_alike() -> None:
    declaration = lamp()
    chart = compiled(declaration)
    with recording([chart]) as recorder:
        run = chart.run(GuardTable.for_chart(chart))
        run.send("switch")
        run.send("shift")
    compiled_hits = set(recorder.hits)
    assert {chart.transitions[t].event for _, t in compiled_hits} == {"switch", "shift"}
    real_recorder = TransitionRecorder()
    machine = declaration(model=GuardTable.for_chart(chart),
                          listeners=[TransitionListener(chart, real_recorder)])
    machine.send("switch")
    machine.send("shift")
    assert real_recorder.hits == compiled_hits
    # a done.state event counts its transition, whichever name it was declared with
    with recording([chart]) as recorder:
        run = chart.run(GuardTable.for_chart(chart))
        for event in ("switch", "boost", "burn"):
            run.send(event)
    assert "done.state.power" in {chart.transitions[t].event for _, t in recorder.hits}


def test_coverage_counts_an_eventless_transition_a_python_statemachine_instance_takes() -> None:
    """python-statemachine calls its listeners with ``event=None`` for an eventless
    transition; the listener looked it up as ``"None"`` and never counted it, so
    ``--chart-coverage`` and ``charts cover`` listed it untaken after a run that took it."""

    class Kettle(StateChart):
        cold = State(initial=True)
        boiling = State()
        whistling = State(final=True)
        heat = cold.to(boiling)
        boiling.to(whistling)  # eventless: as soon as it boils

    chart = compiled(Kettle)
    recorder = TransitionRecorder()
    kettle = Kettle(listeners=[TransitionListener(chart, recorder)])
    kettle.send("heat")
    assert list(kettle.configuration_values) == ["whistling"]
    assert report([chart], recorder)[0].complete, recorder.hits


def test_mutants_are_derived_and_applied_on_nested_states() -> None:
    declaration = lamp()
    ids = [m.id for m in mutants.derive(declaration)]
    assert "guard-false:warm-shift->cold:allowed" in ids
    assert "drop:high-burn->spent" in ids
    assert any(i.startswith("target:dark-restore->h:") for i in ids)
    mutants.apply(declaration, "drop:high-burn->spent")
    run = compile_chart(declaration).run(GuardTable.for_chart(compiled(declaration)))
    run.send("switch")
    run.send("boost")
    assert run.send("burn") is None and "high" in run.configuration  # burn ignored now


def test_diagram_draws_clusters_and_history() -> None:
    dot = diagrams.render_chart_dot(lamp())
    assert "subgraph cluster_lit {" in dot and "subgraph cluster_colour {" in dot
    assert 'label="lit (parallel)"' in dot
    assert "h [" in dot and 'label="H*"' in dot
    assert "lhead=cluster_lit" in dot  # an edge to a compound state ends at its box


def test_a_path_leaving_a_compound_state_is_drawn() -> None:
    """A run's path that leaves a compound state (``lit --switch--> dark``) outlines that
    state's box; its cluster attributes were joined with a comma, which dot refuses (found
    following docs/framework.md with a chart of my own: the inspector's run page failed)."""
    import subprocess

    import needs

    chart = compiled(lamp())
    switch_off = next(t for t in chart.transitions if (t.source, t.event) == ("lit", "switch"))
    dot = diagrams.render_chart_dot(chart, "dark", {switch_off.id}, {})
    done = subprocess.run([needs.tool("dot"), "-Tsvg"], input=dot, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    svg = diagrams.render_path_svg(chart, [{"event": "switch", "from": "lit", "to": "dark"}])
    assert "<svg" in svg


def test_a_done_state_transition_of_a_state_without_a_final_child_is_named_with_why() -> None:
    """``done_state_running`` on a compound state with no final child: python-statemachine
    accepts it, the event is never raised. Paths sent it from outside ('finished: start
    done.state.running'); now that it is never sent, they say why ``finished`` is never
    entered."""

    class Job(StateChart):
        class running(State.Compound):
            step1 = State(initial=True)
            step2 = State()
            next_ = step1.to(step2)
            again = step2.to(step1)

        idle = State(initial=True)
        finished = State(final=True)
        start = idle.to(running)
        done_state_running = running.to(finished)

    with pytest.raises(ValueError) as raised:
        state_paths(Job)
    assert str(raised.value) == (
        "Job: state(s) finished never entered from idle (done.state.running: raised only when "
        "running reaches a final child state, in every region of a parallel state; no path "
        "does)")
    with pytest.raises(ValueError, match=r"transition\(s\) running --done.state.running--> "
                                         r"finished taken from no reachable configuration "
                                         r"\(done.state.running: raised only when"):
        transition_paths(Job)
