"""The toolkit on hierarchical charts (issue 26): paths by configuration, transition coverage
of the general run and of python-statemachine instances, mutants derived and applied, and the
diagram's clusters, on charts with compound, parallel and history states."""

from __future__ import annotations

import pytest
from statemachine import HistoryState, State, StateChart

from calexec.machines import diagrams, mutants
from calexec.machines.compiled import compile_chart, compiled
from calexec.machines.coverage import (
    TransitionListener,
    TransitionRecorder,
    describe,
    recording,
    report,
    track,
)
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
            # its default: ``restore`` from the start, nothing recorded yet, enters it (without
            # one python-statemachine enters nothing there, and ``paths`` refuses the chart)
            h.to(colour)

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


class Player(StateChart):
    """Two regions of three states each, moved by their own events: a newcomer's first
    parallel chart. Its configurations: ``off`` and the 3 x 3 of ``on``."""

    class on(State.Parallel):
        class source(State.Compound):
            radio = State(initial=True)
            cd = State()
            aux = State()
            next_source = radio.to(cd) | cd.to(aux) | aux.to(radio)

        class volume(State.Compound):
            low = State(initial=True)
            mid = State()
            high = State()
            louder = low.to(mid) | mid.to(high)
            quieter = high.to(mid) | mid.to(low)

    off = State(initial=True)
    power = off.to(on) | on.to(off)


class Mixer(StateChart):
    """Three regions of three states each (the review's chart): ``off`` and the 3 x 3 x 3 of
    ``on``."""

    class on(State.Parallel):
        class bass(State.Compound):
            b1 = State(initial=True)
            b2 = State()
            b3 = State()
            bass_up = b1.to(b2) | b2.to(b3) | b3.to(b1)

        class mids(State.Compound):
            m1 = State(initial=True)
            m2 = State()
            m3 = State()
            mids_up = m1.to(m2) | m2.to(m3) | m3.to(m1)

        class treble(State.Compound):
            t1 = State(initial=True)
            t2 = State()
            t3 = State()
            treble_up = t1.to(t2) | t2.to(t3) | t3.to(t1)

    off = State(initial=True)
    power = off.to(on) | on.to(off)


def _real_run(declaration: type[StateChart], events: tuple[str, ...],
              recorder: TransitionRecorder | None = None) -> StateChart:
    listeners = [] if recorder is None else [TransitionListener(compiled(declaration), recorder)]
    machine = declaration(listeners=listeners)
    for event in events:
        machine.send(event)
    return machine


def _real_distances(declaration: type[StateChart]) -> tuple[
        dict[frozenset[str], int], dict[str, int], dict[int, int]]:
    """Breadth-first over python-statemachine instances (each replayed from the start),
    keyed by the set of active states: the shortest number of events to every configuration,
    to a configuration containing every state, and to taking every transition (by id)."""
    chart = compiled(declaration)
    start = frozenset(_real_run(declaration, ()).configuration_values)
    reach: dict[frozenset[str], tuple[str, ...]] = {start: ()}
    taking: dict[int, int] = {}
    frontier = [start]
    while frontier:
        ahead = []
        for configuration in frontier:
            events = reach[configuration]
            for event in chart.events:
                recorder = TransitionRecorder()
                machine = _real_run(declaration, events, recorder)
                recorder.clear()
                machine.send(event)
                for _, transition_id in recorder.hits:
                    taking.setdefault(transition_id, len(events) + 1)
                after = frozenset(machine.configuration_values)
                if after not in reach:
                    reach[after] = (*events, event)
                    ahead.append(after)
        frontier = ahead
    to_state: dict[str, int] = {}
    for configuration, events in reach.items():  # reach is in breadth-first order
        for state in configuration:
            to_state.setdefault(state, len(events))
    return {c: len(e) for c, e in reach.items()}, to_state, taking


@pytest.mark.parametrize(("declaration", "count"), [(Player, 10), (Mixer, 28)],
                         ids=["two-regions", "three-regions"])
def test_a_configuration_of_a_parallel_chart_is_one_node_whatever_order_its_regions_moved_in(
        declaration: type[StateChart], count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A configuration reached by two event orders (``power louder next_source`` and
    ``power next_source louder``) was two nodes: the active states were compared in the order
    python-statemachine lists them, which is the order they were entered in. The review's
    three regions of three states explored 202 nodes for 28 configurations, so
    ``MAX_CONFIGURATIONS`` was reached about seven times too early. Explored now: exactly the
    configurations python-statemachine reaches, and every walk and path is still a shortest
    one that a real instance follows."""
    from calexec.machines import paths

    to_configuration, to_state, taking = _real_distances(declaration)
    assert len(to_configuration) == count
    chart = compile_chart(declaration)  # a fresh compiled chart: its graph is explored here
    monkeypatch.setattr(paths, "MAX_CONFIGURATIONS", count - 1)
    with pytest.raises(ValueError, match=rf"more than {count - 1} configurations reachable"):
        state_paths(chart)
    chart = compile_chart(declaration)
    monkeypatch.setattr(paths, "MAX_CONFIGURATIONS", count)
    walks = state_paths(chart)
    for state, walk in walks.items():
        assert len(walk.events) == to_state[state], (state, walk.events)
        ended = list(_real_run(declaration, walk.events).configuration_values)
        assert state in ended and ",".join(ended) == walk.end, (state, walk.events, walk.end)
    for path in transition_paths(chart):
        recorder = TransitionRecorder()
        _real_run(declaration, path.events, recorder)
        assert path.transition.key in recorder.hits, (path.transition, path.events)
        assert len(path.events) == taking[path.transition.id], (path.transition, path.events)
    with recording([chart]) as recorder:
        for walk in transition_tour(chart):
            assert ",".join(_real_run(declaration, walk.events).configuration_values) == walk.end
            assert drive(chart.run(GuardTable.for_chart(chart)), walk) == walk.end
    assert report([chart], recorder)[0].complete


class Race(StateChart):
    """Both regions leave the parallel state on ``leave``. python-statemachine selects the
    transitions of the atomic states in configuration order, and of two that exit the same
    states the first one wins: which region leaves depends on which moved last (after ``ma``
    the configuration lists ``b1`` before ``a2``)."""

    class both(State.Parallel, initial=True):
        class left(State.Compound):
            a1 = State(initial=True)
            a2 = State()
            ma = a1.to(a2) | a2.to(a1)

        class right(State.Compound):
            b1 = State(initial=True)
            b2 = State()
            mb = b1.to(b2) | b2.to(b1)

    out_left = State(final=True)
    out_right = State(final=True)
    leave = (both.left.a1.to(out_left) | both.left.a2.to(out_left)
             | both.right.b1.to(out_right) | both.right.b2.to(out_right))


class Restart(StateChart):
    """``restart`` goes from a region's state to its own region. Its domain is the chart's
    root (a parallel state is not compound), so it exits the other region too, and the two
    regions' ``restart`` conflict as ``Race``'s ``leave`` do: ``b2``'s is taken only where
    ``b2`` is listed before ``a``, after ``poke`` re-entered ``a``."""

    class both(State.Parallel, initial=True):
        class left(State.Compound):
            a = State(initial=True)
            poke = a.to(a)

        class right(State.Compound):
            b1 = State(initial=True)
            b2 = State()
            mb = b1.to(b2) | b2.to(b1)

    restart = both.left.a.to(both.left) | both.right.b2.to(both.right)


@pytest.mark.parametrize(("declaration", "transition", "by_order"), [
    (Race, "b2 --leave--> out_right", (("ma", "mb", "leave"), ("mb", "ma", "leave"))),
    (Restart, "b2 --restart--> right", (("mb", "restart"), ("mb", "poke", "restart"))),
], ids=["leaving-the-parallel-state", "to-its-own-region"])
def test_paths_tell_configurations_apart_by_order_where_python_statemachine_does(
        declaration: type[StateChart], transition: str,
        by_order: tuple[tuple[str, ...], tuple[str, ...]]) -> None:
    """Where the order of the active states decides which transition an event takes, one set
    of active states is more than one configuration: ``transition`` is taken only from its
    source listed before the other region's atomic state (the second event sequence, not
    the first, though both send the last event from the same set of active states), an
    order a graph keyed by the set alone never explores: it named the transition
    unreachable."""
    first, second = (_real_run(declaration, events[:-1]) for events in by_order)
    assert set(first.configuration_values) == set(second.configuration_values)
    taken = []
    for events in by_order:
        recorder = TransitionRecorder()
        _real_run(declaration, events, recorder)
        taken.append({describe(compiled(declaration).transitions[i]) for _, i in recorder.hits})
    assert transition not in taken[0] and transition in taken[1], taken
    chart = compile_chart(declaration)
    for path in transition_paths(chart):
        recorder = TransitionRecorder()
        _real_run(declaration, path.events, recorder)
        assert path.transition.key in recorder.hits, (path.transition, path.events)
    for state, walk in state_paths(chart).items():
        ended = ",".join(_real_run(declaration, walk.events).configuration_values)
        assert ended == walk.end, (state, walk.events)
    with recording([chart]) as recorder:
        for walk in transition_tour(chart):
            assert ",".join(_real_run(declaration, walk.events).configuration_values) == walk.end
            assert drive(chart.run(GuardTable.for_chart(chart)), walk) == walk.end
    assert report([chart], recorder)[0].complete


def test_an_eventless_transition_the_chart_takes_as_it_starts_has_an_empty_path() -> None:
    """python-statemachine runs eventless transitions in the initial macrostep: a chart whose
    initial state is left at once by one (a newcomer's ``a.to(b, cond="ready")``) takes it
    with no event sent. Its path is empty, the tour's walks take it, and a real run that
    follows the tour covers every transition (paths named it "taken from no reachable
    configuration" and refused the chart)."""

    class Boot(StateChart):
        checking = State(initial=True)
        ready = State()
        done = State(final=True)
        checking.to(ready, cond="self_test_ok")
        finish = ready.to(done)

        def self_test_ok(self) -> bool:
            return True

    chart = compile_chart(Boot)
    paths = {p.transition.target: p for p in transition_paths(chart)}
    assert paths["ready"].steps == () and paths["done"].events == ("finish",)
    assert state_paths(chart)["ready"].steps == ()
    tour = transition_tour(chart)
    assert [walk.events for walk in tour] == [("finish",)]
    with recording([chart]) as recorder:
        for walk in tour:
            drive(chart.run(GuardTable.for_chart(chart)), walk)  # type: ignore[arg-type]
    assert report([chart], recorder)[0].complete


def test_a_chart_whose_only_transition_is_taken_as_it_starts_has_one_empty_walk() -> None:
    class Blink(StateChart):
        on = State(initial=True)
        off = State(final=True)
        on.to(off)

    chart = compile_chart(Blink)
    assert [p.steps for p in transition_paths(chart)] == [()]
    assert [(walk.steps, walk.end) for walk in transition_tour(chart)] == [((), "off")]


def test_guarded_eventless_alternatives_after_an_event_are_each_reached() -> None:
    """A newcomer's self-test: ``power`` enters ``selftest``, which an eventless transition
    leaves for ``running`` when ``healthy`` holds and for ``failed`` unless it does. The
    macrostep of ``power`` evaluates those guards under the step's outcomes, as a
    ``GuardTable`` model answers them (paths ran the macrostep with every guard passing:
    ``failed`` "taken from no reachable configuration", the chart refused)."""

    class SelfTest(StateChart):
        off = State(initial=True)
        selftest = State()
        running = State()
        failed = State(final=True)
        power = off.to(selftest)
        selftest.to(running, cond="healthy")
        selftest.to(failed, unless="healthy")
        halt = running.to(failed)

        def healthy(self) -> bool:
            return True

    chart = compile_chart(SelfTest)
    paths = {(p.transition.source, p.transition.target): p for p in transition_paths(chart)}
    assert paths[("selftest", "failed")].events == ("power",)
    assert paths[("selftest", "failed")].guards == ({"healthy": False},)
    assert state_paths(chart)["failed"].events == ("power",)
    with recording([chart]) as recorder:
        for walk in transition_tour(chart):
            assert drive(chart.run(GuardTable.for_chart(chart)), walk) == walk.end  # type: ignore[arg-type]
    assert report([chart], recorder)[0].complete


def test_an_eventless_transition_guarded_by_unless_follows_the_guard_table() -> None:
    """``check.to(ok, unless="broken")``: a ``GuardTable`` model answers ``broken`` True
    when a step names no outcome, so ``power`` stays in ``check`` and ``fix`` can be taken
    (paths let the eventless transition pass whatever its guard: ``fix`` was "taken from no
    reachable configuration", and a walk's ``end`` was not where a real run ends)."""

    class Check(StateChart):
        off = State(initial=True)
        check = State()
        ok = State(final=True)
        power = off.to(check)
        check.to(ok, unless="broken")
        fix = check.to(ok)

        def broken(self) -> bool:
            return True

    chart = compile_chart(Check)
    paths = {p.transition.event or "(eventless)": p for p in transition_paths(chart)}
    assert paths["fix"].events == ("power", "fix")
    assert paths["(eventless)"].guards == ({"broken": False},)
    with recording([chart]) as recorder:
        for walk in transition_tour(chart):
            assert drive(chart.run(GuardTable.for_chart(chart)), walk) == walk.end  # type: ignore[arg-type]
    assert report([chart], recorder)[0].complete


def test_an_eventless_alternative_only_the_start_could_take_has_a_start_step() -> None:
    """``power`` is left at start by ``power.to(selftest)``, and ``selftest`` at once for
    ``running`` (``healthy`` holds) or for ``failed`` (it does not). ``failed`` by that branch
    was "taken from no reachable configuration", then refused saying why (a path set outcomes
    only for the events it sends); its path now has a start, ``healthy`` false set before the
    chart starts, and a run started so takes it."""

    class PowerOn(StateChart):
        power = State(initial=True)
        selftest = State()
        running = State()
        failed = State(final=True)
        power.to(selftest)
        selftest.to(running, cond="healthy")
        selftest.to(failed, unless="healthy")
        halt = running.to(failed)

        def healthy(self) -> bool:
            return True

    chart = compile_chart(PowerOn)
    branch = next(p for p in transition_paths(chart)
                  if (p.transition.source, p.transition.target) == ("selftest", "failed"))
    assert (branch.steps, dict(branch.start), branch.started) == ((), {"healthy": False}, "failed")
    tour = transition_tour(chart)
    assert [(w.events, dict(w.start)) for w in tour] == [((), {"healthy": False}), (("halt",), {})]
    with recording([chart]) as recorder:
        for walk in tour:
            run = chart.run(GuardTable.for_chart(chart, outcomes=walk.start))
            assert drive(run, walk) == walk.end  # type: ignore[arg-type]
    assert report([chart], recorder)[0].complete


def test_a_step_keeps_refusing_the_eventless_transitions_of_where_it_is_sent() -> None:
    """``arm`` stops in ``hold`` only where ``ready`` is false; python-statemachine takes
    ``hold``'s eventless transition before the next event when that step's outcomes enable
    it. The ``abort`` step named no outcome (``ready`` answered True): a real run went to
    ``opened`` first and ignored ``abort``, while the walk said ``shut``."""

    class Gate(StateChart):
        closed = State(initial=True)
        hold = State()
        opened = State(final=True)
        shut = State(final=True)
        arm = closed.to(hold)
        hold.to(opened, cond="ready")
        abort = hold.to(shut)

        def ready(self) -> bool:
            return True

    chart = compiled(Gate)
    paths = {p.transition.target: p for p in transition_paths(chart)}
    assert paths["shut"].events == ("arm", "abort")
    assert paths["shut"].guards == ({"ready": False}, {"ready": False})
    undo = track(Gate, recorder := TransitionRecorder())
    try:
        for walk in transition_tour(chart):
            model = GuardTable.for_chart(chart)
            gate = Gate(model)
            for step, outcomes in zip(walk.steps, walk.guards):
                model.outcomes = dict(outcomes)
                gate.send(step.event)
            assert ",".join(map(str, gate.configuration_values)) == walk.end
    finally:
        undo()
    assert report([chart], recorder)[0].complete


class Valued(StateChart):
    """States declared with their own ``value=``: python-statemachine's ``states_map`` is keyed
    by value, the tools name states by id."""

    class outer(State.Compound):  # noqa: N801 - python-statemachine's declaration style
        a = State(initial=True, value=10)
        b = State(value=11)
        go = a.to(b)

    class both(State.Parallel):  # noqa: N801
        class left(State.Compound):  # noqa: N801
            up = State(initial=True, value="U")
            down = State(value="D")
            flip = up.to(down)

        class right(State.Compound):  # noqa: N801
            on = State(initial=True, value="ON")
            flip = on.to.itself()

    end = State(final=True)
    fin = outer.to(end)
    split = outer.to(both)
    stop = both.to(end)


def test_paths_of_a_chart_whose_states_have_values_drive_a_real_run():
    """``charts paths`` on such a chart was an internal error (``KeyError: 'a'``): it looked
    the ids of a configuration up in the map keyed by value."""
    for walk in transition_tour(Valued):
        run = compiled(Valued).run(GuardTable.for_chart(Valued, outcomes=walk.start))
        drive(run, walk)
    assert set(state_paths(Valued)) == set(compiled(Valued).states)


def test_every_derived_mutant_of_a_history_target_applies() -> None:
    """``derive`` named ``target:idle-restore->h:idle`` (the source, when the original target
    is a history state), but ``apply`` looked for it among the targets of a history
    transition without the chart's first state: ``no mutant``, which ``charts mutate``
    reported as "the command did not import the chart"."""

    def player() -> type[StateChart]:
        class Player(StateChart):
            idle = State(initial=True)

            class active(State.Compound):  # noqa: N801 - python-statemachine's style
                playing = State(initial=True)
                paused = State()
                pause = playing.to(paused)
                h = HistoryState()

            stopped = State(final=True)
            load = idle.to(active)
            stop = active.to(idle)
            eject = idle.to(stopped)
            restore = idle.to(active.h)

        return Player

    for limit in (0, 1, 2):
        for mutant in mutants.derive(player(), targets_per_transition=limit):
            mutants.apply(player(), mutant.id)


def test_a_target_mutant_ends_in_another_configuration_than_the_original() -> None:
    """The target mutants of a transition into a compound state were the next states declared,
    its initial child first: ``target:idle-load->active:playing`` enters exactly what
    ``load`` enters (``active``, ``playing``), an equivalent mutant no test can kill, reported
    as a survivor. States entered alike now come last: with the default two targets per
    transition, every target mutant of ``load`` and of ``start`` (into a parallel state's
    region) ends somewhere else; with every target (0) they are still derived, last."""

    def chart() -> type[StateChart]:
        class Player(StateChart):
            idle = State(initial=True)

            class active(State.Compound):  # noqa: N801 - python-statemachine's style
                playing = State(initial=True)
                paused = State()
                pause = playing.to(paused)

            class both(State.Parallel):  # noqa: N801
                class left(State.Compound):  # noqa: N801
                    l1 = State(initial=True)
                    l2 = State()
                    step = l1.to(l2)

                class right(State.Compound):  # noqa: N801
                    r1 = State(initial=True)

            done = State(final=True)
            load = idle.to(active)
            start = idle.to(both.left.l1)
            stop = active.to(idle) | both.to(idle)
            eject = idle.to(done)

        return Player

    def configuration_after(declaration: type[StateChart], event: str) -> set[str]:
        machine = declaration()
        machine.send(event)
        return {s.id for s in machine.configuration}

    for event, label in (("load", "idle-load->active"), ("start", "idle-start->l1")):
        expected = configuration_after(chart(), event)
        target_mutants = [m for m in mutants.derive(chart()) if m.kind == "target"
                          and m.transition == label]
        assert len(target_mutants) == 2, target_mutants
        for mutant in target_mutants:
            declaration = chart()
            mutants.apply(declaration, mutant.id)
            assert configuration_after(declaration, event) != expected, mutant.id
        every = [m.detail for m in mutants.derive(chart(), targets_per_transition=0)
                 if m.kind == "target" and m.transition == label]
        alike = {"idle-load->active": {"playing"}, "idle-start->l1": {"both", "left"}}[label]
        assert set(every[-len(alike):]) == alike, every


def test_two_target_mutants_of_one_transition_end_in_two_configurations() -> None:
    """A newcomer's ``note = draft.to.itself(internal=True)`` declared before a compound
    ``processing`` whose initial child is ``fulfilment``: the two default target mutants of
    ``note`` were ``...:processing`` and ``...:fulfilment``, which enter the same configuration
    (one mutant run twice, the second never telling a test anything the first did not). A
    target entered as an earlier one is entered comes last, as one entered as the original
    target already did; with every target (0) both are still derived."""

    def chart() -> type[StateChart]:
        class Workflow(StateChart):
            draft = State(initial=True)

            class processing(State.Compound):  # noqa: N801 - python-statemachine's style
                fulfilment = State(initial=True)
                on_hold = State()
                hold = fulfilment.to(on_hold)

            done = State(final=True)
            note = draft.to.itself(internal=True)
            submit = draft.to(processing)
            finish = processing.to(done)

        return Workflow

    def configuration_after(declaration: type[StateChart], event: str) -> frozenset[str]:
        machine = declaration()
        machine.send(event)
        return frozenset(s.id for s in machine.configuration)

    label = "draft-note->draft"
    targets = [m for m in mutants.derive(chart()) if m.kind == "target" and m.transition == label]
    assert [m.detail for m in targets] == ["processing", "on_hold"], targets
    ends = set()
    for mutant in targets:
        declaration = chart()
        mutants.apply(declaration, mutant.id)
        ends.add(configuration_after(declaration, "note"))
    assert len(ends) == 2, ends
    every = [m.detail for m in mutants.derive(chart(), targets_per_transition=0)
             if m.kind == "target" and m.transition == label]
    assert every == ["processing", "on_hold", "done", "fulfilment"], every
