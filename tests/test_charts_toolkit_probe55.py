"""Stop 55's toolkit probe: the leftovers of stop 54 (a history state's default transition in
coverage and mutation; listeners piling up on live instances) and a newcomer's own chart
through every toolkit command; each test is a defect found there."""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Callable

import pytest
from statemachine import HistoryState, State, StateChart, StateMachine

from calexec.drivers.tools.interleave import explore_threads, replay_threads
from calexec.machines import mutants
from calexec.machines.chart_contracts import enable_contracts, invariant
from calexec.machines.chart_support import UnsupportedChart
from calexec.machines.compiled import compiled
from calexec.machines.coverage import (
    TransitionListener,
    TransitionRecorder,
    describe,
    report,
    track,
)
from calexec.machines.inspector import Inspector, PathLog
from calexec.machines.paths import GuardTable, as_data, drive
from calexec.machines.statechart_run import StatechartRun


def _drawer() -> type[StateMachine]:
    """A fresh chart class (``compiled`` and ``track`` keep state on the class): entering
    ``box.h`` before ``box`` was ever left takes the history's default ``h.to(c)``."""

    class Drawer(StateMachine):
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

    return Drawer


def _default_of(chart: type[StateMachine]) -> str:
    """How coverage lists ``chart``'s history default (its source is the history state)."""
    return "h --(eventless)--> c"


def test_a_history_default_is_a_transition_coverage_lists_and_counts_once_taken() -> None:
    """A python-statemachine instance and a compiled run: the default is declared, untaken
    while only restored histories were entered, counted once an empty history is entered."""
    for kind in ("instance", "compiled"):
        chart = _drawer()
        listed = [describe(t) for t in compiled(chart).transitions]
        assert _default_of(chart) in listed, listed
        recorder = TransitionRecorder()
        undo = track(chart, recorder)
        try:
            (before,) = report([chart], recorder)
            assert _default_of(chart) in [describe(t) for t in before.untaken]
            if kind == "instance":
                machine = chart()
                machine.send("enter")
                assert [s.id for s in machine.configuration] == ["box", "c"]
            else:
                run = compiled(chart).run(None)
                run.send("enter")
                assert set(run.configuration) == {"box", "c"}
        finally:
            undo()
        (after,) = report([chart], recorder)
        assert _default_of(chart) not in [describe(t) for t in after.untaken], kind
        assert after.covered == 2, (kind, [describe(t) for t in after.untaken])


def test_a_restored_history_does_not_count_its_default() -> None:
    chart = _drawer()
    machine = chart()
    machine.send("enter")  # default: box, c
    machine.send("nxt")  # box, a
    machine.send("leave")  # records a
    recorder = TransitionRecorder()
    undo = track(chart, recorder)
    try:
        machine.send("enter")  # restores a: the default is not taken
        assert [s.id for s in machine.configuration] == ["box", "a"]
    finally:
        undo()
    (coverage,) = report([chart], recorder)
    assert _default_of(chart) in [describe(t) for t in coverage.untaken]


def test_a_history_default_is_mutated_inside_its_compound() -> None:
    chart = _drawer()
    found = [m.id for m in mutants.derive(chart, targets_per_transition=0)]
    assert "drop:h-->c" in found, found
    retargeted = sorted(m.detail for m in mutants.derive(chart, 0) if m.transition == "h-->c"
                        and m.kind == "target")
    # a history's default enters a state of its compound (SCXML): the other children only
    assert retargeted == ["a", "b"], retargeted
    mutated = _drawer()
    mutants.apply(mutated, "target:h-->c:b")
    machine = mutated()
    machine.send("enter")
    assert [s.id for s in machine.configuration] == ["box", "b"]
    dropped = _drawer()
    mutants.apply(dropped, "drop:h-->c")
    machine = dropped()
    machine.send("enter")
    assert list(machine.configuration) == []  # an empty history without default: nothing


def test_the_live_view_counts_a_history_default_an_instance_takes() -> None:
    chart = _drawer()
    inspector = Inspector()
    entry = inspector.register(chart, counts=dict)
    try:
        machine = chart()
        machine.send("enter")
    finally:
        inspector.close()
    default = next(t.id for t in compiled(chart).transitions if describe(t) == _default_of(chart))
    assert entry.taken()[default] == 1, entry.taken()


class Lamp(StateMachine):
    """A long-lived instance (``LAMP``) made before any tool was enabled, and others made
    while one is."""

    off = State(initial=True)
    on = State()
    flip = off.to(on) | on.to(off)

    @invariant("on", "off")
    def fine(model: object) -> bool:
        return True


LAMP = Lamp()


def _hooks(machine: StateMachine) -> int:
    """How many listeners ``machine`` has (each one called on every transition)."""
    return len(machine.active_listeners)


def test_enable_disable_cycles_leave_every_instance_s_listeners_as_they_were() -> None:
    before = _hooks(LAMP)
    made: list[StateMachine] = []
    for _ in range(5):
        undo = track(Lamp, TransitionRecorder())
        monitor = enable_contracts(Lamp)
        inspector = Inspector()
        inspector.register(Lamp, counts=dict)
        made.append(Lamp())  # made while they are enabled: each tool's listener joins it
        assert _hooks(made[-1]) == _hooks(Lamp()) == before + 3
        LAMP.send("flip")
        inspector.close()
        monitor.disable()
        undo()
    assert _hooks(LAMP) == before, LAMP.active_listeners
    for machine in made:
        assert _hooks(machine) == before, machine.active_listeners
        machine.send("flip")  # still runs, with nothing of the tools left
    assert [s.id for s in LAMP.configuration] == ["on"]


def test_a_subclass_declared_while_tools_are_enabled_keeps_none_of_their_listeners() -> None:
    """python-statemachine copies the class-level listeners into a subclass as it creates it:
    one declared while the tools are enabled (a test's own variant of the chart) got theirs
    for good, and so did every instance of it made after they were disabled."""
    subclasses = []
    for _ in range(3):
        undo = track(Lamp, TransitionRecorder())
        monitor = enable_contracts(Lamp)
        inspector = Inspector()
        inspector.register(Lamp, counts=dict)

        class SmartLamp(Lamp):
            pass

        subclasses.append(SmartLamp)
        during = SmartLamp()
        inspector.close()
        monitor.disable()
        undo()
        assert _hooks(during) == 0, during.active_listeners
    for subclass in subclasses:
        assert _hooks(subclass()) == 0, subclass().active_listeners


def test_a_tool_listener_keeps_no_instance_alive() -> None:
    recorder = TransitionRecorder()
    undo = track(Lamp, recorder)
    try:
        machine = Lamp()
        gone = weakref.ref(machine)
        del machine
        gc.collect()
        assert gone() is None
    finally:
        undo()


def test_a_followed_instance_s_path_takes_the_history_default_as_a_compiled_run_s_does() -> None:
    chart = _drawer()
    inspector = Inspector()
    inspector.register(chart, counts=dict)
    try:
        trails = []
        for run_id, run in (("instance", chart()), ("compiled", compiled(chart).run(None))):
            inspector.paths.follow(run_id, run)
            run.send("enter")
            trails.append([(step["from"], step["to"], step["via"]) for step in
                           (inspector.paths.record(run_id) or {})["trail"]])
    finally:
        inspector.close()
    # (since stop 61 a step into a history names the state it entered, ``via`` the history)
    assert trails[0] == trails[1] == [("out", "c", "h"), ("h", "c", None)], trails


class NoStates(StateChart):
    """A newcomer's base class of charts: no states of its own."""


def test_a_chart_without_states_given_to_the_explorer_is_refused_naming_charts() -> None:
    def scenario(clock: object) -> Callable[[], bool]:
        return lambda: True

    for explore in (lambda: explore_threads(scenario, seeds=range(1), charts=[NoStates]),
                    lambda: replay_threads(scenario, [], charts=[NoStates])):
        with pytest.raises(ValueError, match=r"^charts: NoStates: declaration NoStates "
                                             r"declares no states"):
            explore()


class Deck(StateChart):
    """A history default declared with a guard, which python-statemachine never asks: entering
    the empty history enters ``play`` whatever ``has_tape`` answers (here a lambda)."""

    class on(State.Compound):
        stop = State(initial=True)
        play = State()
        press = stop.to(play) | play.to(stop)
        h = HistoryState()
        h.to(play, cond=lambda: False)

    off = State(initial=True)
    power = off.to(on) | on.to(off)
    resume = off.to(on.h)


def test_a_history_default_s_guard_that_python_statemachine_ignores_is_no_guard_of_the_tools(
) -> None:
    machine = Deck()
    machine.send("resume")
    assert [s.id for s in machine.configuration] == ["on", "play"]  # the guard is not asked
    (default,) = [t for t in compiled(Deck).transitions if t.source == "h"]
    assert default.guards == (), default
    assert [m.kind for m in mutants.derive(Deck) if m.transition == "h-->play"] == [
        "drop", "target"]  # no guard mutant: each would be equivalent
    steps = as_data(Deck)["transitions"][-1]
    assert (steps["from"], steps["to"], steps["guards"]) == ("h", "play", []), steps


class Fetching(StateChart):
    """The chart's own async callback on a history's default (``h.to(c, on="fetch")``)."""

    class box(State.Compound):
        a = State(initial=True)
        c = State()
        nxt = a.to(c) | c.to(a)
        h = HistoryState()
        h.to(c, on="fetch")

    out = State(initial=True)
    enter = out.to(box.h)
    leave = box.to(out)

    async def fetch(self) -> int:
        return 1


def test_an_async_callback_on_a_history_default_is_refused_naming_it() -> None:
    named = "async callback 'fetch' on transition h --(eventless)--> c"
    with pytest.raises(UnsupportedChart, match=re.escape(named)):
        compiled(Fetching).run(None)  # (was: blamed on "the model or a listener")
    # mutation takes it since stop 70 (its test command runs the chart's instances on
    # python-statemachine's async engine); the history's default is mutated as any
    assert "drop:h-->c" in {mutant.id for mutant in mutants.derive(Fetching)}


def test_a_long_lived_instance_followed_again_and_again_keeps_one_trail_listener() -> None:
    """``paths.follow`` added a listener per follow that stayed when the run was no longer
    followed (followed again under its id, or older than the last ``keep``): an app that
    follows its one kiosk per session grew its listeners, each called on every event."""
    machine = Lamp()
    inspector = Inspector()
    inspector.paths.keep = 2
    for session in range(6):
        inspector.paths.follow(f"session-{session}", machine)
        inspector.paths.follow(f"session-{session}", machine)  # again, under the same id
        machine.send("flip")
    assert _hooks(machine) == 2, machine.active_listeners  # the last 2 followed
    record = inspector.paths.record("session-5")
    assert record is not None and [step["event"] for step in record["trail"]] == ["flip"]
    assert inspector.paths.record("session-3") is None


def test_a_transition_listener_given_to_a_general_run_counts_its_history_default() -> None:
    """A ``TransitionListener`` as one of a ``StatechartRun``'s ``listeners=`` reads the
    histories from the ``machine`` it is called with, the run's own."""
    chart = _drawer()
    recorder = TransitionRecorder()
    run = StatechartRun(compiled(chart), None, listeners=[TransitionListener(chart, recorder)])
    run.send("enter")
    run.send("nxt")
    run.send("leave")
    run.send("enter")  # restores a: no default
    assert set(run.configuration) == {"box", "a"}
    taken = sorted(describe(t) for t in compiled(chart).transitions if t.key in recorder.hits)
    assert taken == ["box --leave--> out", "c --nxt--> a", _default_of(chart),
                     "out --enter--> h"], taken


def test_deriving_the_mutants_of_a_chart_without_states_is_refused_naming_it() -> None:
    """Every other tool refuses a base class without states; ``derive`` answered no mutant
    (a mutation run of nothing, scored as if complete) and ``apply`` "no mutant"."""
    for call in (lambda: mutants.derive(NoStates), lambda: mutants.apply(NoStates, "drop:a-go->b")):
        with pytest.raises(ValueError, match=r"^NoStates: declaration NoStates declares no states"):
            call()


class Till(StateMachine):
    open_ = State(initial=True)
    paid = State(final=True)
    pay = open_.to(paid, cond="card_ok")


def test_guard_table_outcomes_that_are_no_mapping_are_a_type_error_naming_them() -> None:
    with pytest.raises(TypeError, match=r"outcomes=\['card_ok'\]: expected a mapping"):
        GuardTable.for_chart(Till, outcomes=["card_ok"])
    table = GuardTable.for_chart(Till)
    with pytest.raises(TypeError, match=r"outcomes='card_ok': expected a mapping"):
        table.outcomes = "card_ok"  # type: ignore[assignment]
    table.outcomes = {"card_ok": False, "gone_under_a_mutant": True}  # (a name is not checked)
    assert table.card_ok() is False  # type: ignore[attr-defined]  # (made by for_chart)


def test_driving_something_that_is_no_path_is_a_type_error_naming_it() -> None:
    run = compiled(Till).run(GuardTable.for_chart(Till))
    with pytest.raises(TypeError, match=r"^drive\(run, path='pay'\): expected a Path or Walk"):
        drive(run, "pay")  # type: ignore[arg-type]


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: Inspector(window_s=float("nan")), ValueError,
     r"^Inspector\(window_s=nan\): must be a finite number of seconds > 0"),
    (lambda: Inspector(window_s=0), ValueError, r"^Inspector\(window_s=0\)"),
    (lambda: Inspector(window_s="60"), TypeError, r"^Inspector\(window_s='60'\): expected a "
                                                   r"number of seconds"),
    (lambda: PathLog(keep=-1), ValueError, r"^PathLog\(keep=-1\): must be >= 1"),
    (lambda: PathLog(keep=0), ValueError, r"^PathLog\(keep=0\)"),
    (lambda: PathLog(steps="3"), TypeError, r"^PathLog\(steps='3'\): expected an int >= 1"),
])
def test_a_bad_inspector_setting_is_refused_naming_it(make: Callable[[], object],
                                                      error: type[Exception],
                                                      message: str) -> None:
    """(was: ``window_s=nan`` answered every ``live.json`` poll 500, ``keep=-1`` raised
    ``StopIteration`` from ``follow``, ``keep=0`` followed nothing)"""
    with pytest.raises(error, match=message):
        make()


def test_a_listener_another_python_statemachine_keeps_otherwise_stays_untouched():
    """``remove_listener`` reads python-statemachine 3.2's own fields (it has no call for it);
    an instance whose version keeps them otherwise is left as it was, the listener inert as
    before, and answered False, neither half-removed nor raising out of a tool's disable."""
    from types import SimpleNamespace

    from calexec.machines.chart_support import remove_listener

    listener = object()
    machine = SimpleNamespace(_listeners={id(listener): listener})  # no _callbacks
    assert remove_listener(machine, listener) is False  # type: ignore[arg-type]
    assert machine._listeners == {id(listener): listener}
