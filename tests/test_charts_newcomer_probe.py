"""A newcomer's own charts through the toolkit (stop 52): each test here is a defect found by
pointing docs/framework.md's tools at charts written from python-statemachine's own
documentation, with python-statemachine's behaviour as the oracle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from statemachine import State, StateChart, StateMachine
from statemachine.exceptions import TransitionNotAllowed

from calexec.machines.compiled import ChartTransitionError, compiled
from calexec.machines.coverage import TransitionRecorder, recording, report, track
from calexec.machines.inspector import Inspector
from calexec.machines.paths import (
    GuardTable,
    PathNotFollowed,
    as_data,
    drive,
    transition_paths,
    transition_tour,
)


class Door(StateMachine):
    """A flat chart whose guards are names, as the docs ask; its model answers two of them
    with a value, as python-statemachine's documentation allows ("a method, property or
    attribute name")."""

    closed = State(initial=True)
    opened = State()
    locked = State(final=True)
    open = closed.to(opened, cond="unlocked")
    close = opened.to(closed)
    lock = closed.to(locked, cond="has_key", unless="jammed")


class Household:
    """``unlocked`` a plain attribute, ``has_key`` a property, ``jammed`` a method."""

    def __init__(self, unlocked: bool, key: bool, jam: bool) -> None:
        self.unlocked = unlocked
        self.key = key
        self.jam = jam

    @property
    def has_key(self) -> bool:
        return self.key

    def jammed(self) -> bool:
        return self.jam


def _answer(send: object, event: str) -> str:
    try:
        send(event)  # type: ignore[operator]
    except (TransitionNotAllowed, ChartTransitionError):
        return "refused"
    return "taken"


_FLAGS = st.tuples(st.booleans(), st.booleans(), st.booleans())


@settings(max_examples=80, deadline=None)
@given(_FLAGS, st.lists(st.tuples(st.sampled_from(["open", "close", "lock"]), _FLAGS),
                        max_size=12))
def test_a_guard_the_model_answers_with_a_property_or_attribute_is_read_as_an_instance_reads_it(
        start, steps):
    """The flat run called ``model.unlocked()`` and raised ``TypeError: ... model.unlocked is
    bool True, not a method`` where a python-statemachine instance of the same chart on the
    same model reads the attribute (and the property) and takes the transition."""
    mine, theirs = Household(*start), Household(*start)
    instance, run = Door(theirs), compiled(Door).run(mine)
    for event, flags in steps:
        mine.unlocked, mine.key, mine.jam = flags
        theirs.unlocked, theirs.key, theirs.jam = flags
        assert _answer(run.send, event) == _answer(instance.send, event), (event, flags)
        assert [run.state] == [s.id for s in instance.configuration]


def test_a_run_on_a_model_with_value_guards_takes_event_data_and_can_as_a_flat_run():
    """``send`` with data and ``can`` answer the same on such a model (the value guards are
    read, the method guard still gets the data its signature names)."""

    class Gate(StateMachine):
        shut = State(initial=True)
        up = State()
        raise_it = shut.to(up, cond=["powered", "heavy_enough"])
        lower = up.to(shut)

    class Plant:
        powered = True

        def heavy_enough(self, weight: int = 0) -> bool:
            return weight > 3

    run = compiled(Gate).run(Plant())
    assert not run.can("raise_it", weight=1)
    assert run.can("raise_it", weight=5)
    assert run.send("raise_it", weight=5) == "up"
    run.model.powered = False
    run.send("lower")
    assert not run.can("raise_it", weight=5)


class Ticket(StateMachine):
    """Flat, but a guard expression: the general run (``StatechartRun``)."""

    new = State(initial=True)
    open_ = State()
    closed = State(final=True)
    triage = new.to(open_, cond="assigned and not duplicate")
    close = open_.to(closed)


class Desk:
    def __init__(self) -> None:
        self.assigned = False
        self.duplicate = False


def test_the_inspector_follows_a_general_runs_refusals_with_their_guards():
    """docs/framework.md: a followed run's path has "refusals with their guards included for
    a compiled run". A chart with a guard expression takes the general run, whose trail kept
    only taken transitions: the refused ``triage`` was missing from the path."""
    inspector = Inspector()
    try:
        inspector.register(Ticket, counts=dict)
        run = compiled(Ticket).run(Desk())
        inspector.paths.follow("t1", run)
        try:
            run.send("triage")
        except ChartTransitionError:
            pass
        else:  # pragma: no cover - the guard refuses
            raise AssertionError("triage was taken with its guard false")
        run.model.assigned = True
        run.send("triage")
        record = inspector.paths.record("t1")
        assert record is not None
        assert [(s["event"], s["from"], s["to"], s["refused_by"]) for s in record["trail"]] == [
            ("triage", "new", None, ["assigned", "!duplicate"]),
            ("triage", "new", "open_", None)]
    finally:
        inspector.close()


LAMP = '''
from statemachine import State, StateChart, StateMachine


class Lamp(StateMachine):
    off = State(initial=True)
    on = State()
    switch = off.to(on) | on.to(off)
'''

LAMP_TEST = '''
from lamp import Lamp


def test_switch_turns_it_on():
    lamp = Lamp()
    lamp.send("switch")
    assert list(lamp.configuration_values) == ["on"]
'''


def _charts(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "calexec.cli", "charts", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600, check=False)


def test_mutate_takes_the_same_chart_given_twice_once_and_names_two_charts_of_one_name(tmp_path):
    """docs/framework.md: a chart given as CHART "is taken the same way" as --chart. Given both
    ways (or twice), mutate refused it, exit 2, as "two charts share a name in ['lamp:Lamp',
    'lamp:Lamp']; use NAME=module:Class", as if they were two charts; cover counts it once."""
    (tmp_path / "lamp.py").write_text(LAMP)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "__init__.py").write_text("")
    (tmp_path / "other" / "lamp.py").write_text(LAMP)
    (tmp_path / "test_lamp.py").write_text(LAMP_TEST)
    command = f"{sys.executable} -m pytest -q -p no:cacheprovider test_lamp.py"
    twice = _charts(tmp_path, "mutate", "lamp:Lamp", "--chart", "lamp:Lamp", "--test-cmd",
                    command, "--mutant", "drop:off-switch->on", "--json")
    assert twice.returncode == 0, twice.stderr
    report = json.loads(twice.stdout)
    assert [(m["chart"], m["id"], m["status"]) for m in report["mutants"]] == [
        ("Lamp", "drop:off-switch->on", "killed")]
    two = _charts(tmp_path, "mutate", "--chart", "lamp:Lamp", "--chart", "other.lamp:Lamp",
                  "--test-cmd", command)
    assert two.returncode == 2
    assert two.stderr.strip().splitlines() == [
        "calexec charts mutate: --chart: 'lamp:Lamp' and 'other.lamp:Lamp' are two charts "
        "named Lamp; name one: NAME=module:Class (e.g. Lamp2=other.lamp:Lamp)"]


def test_a_chart_registered_under_a_name_that_is_no_str_is_refused_naming_it():
    """``register(Chart, name=5)`` was taken, and then the inspector's page answered every
    request 500 (``html.escape`` of an int), hiding every chart registered beside it."""
    inspector = Inspector()
    try:
        for name in (5, b"Lamp", ["Lamp"]):
            try:
                inspector.register(Ticket, counts=dict, name=name)  # type: ignore[arg-type]
            except TypeError as refused:
                assert str(refused).startswith(f"register(Ticket): name={name!r}: expected a str")
            else:
                raise AssertionError(f"name={name!r} was registered")
        assert inspector.live()["charts"] == {}
        inspector.register(Ticket, counts=dict, name="tickets/v2")
        assert list(inspector.live()["charts"]) == ["tickets/v2"]
    finally:
        inspector.close()


class Resumed(StateMachine):
    """A chart whose runs start where ``start_configuration_values`` says (python-statemachine
    3), not at its declared initial state, which paths start from (docs/framework.md)."""

    start_configuration_values = ["waiting"]
    fresh = State(initial=True)
    waiting = State()
    served = State(final=True)
    call = fresh.to(waiting) | waiting.to(served, cond="ready") | waiting.to(fresh)


def test_driving_a_path_on_a_run_started_elsewhere_says_where_it_started():
    """``drive`` of a ``Resumed`` path raised PathNotFollowed "... the run is in 'served' (a
    StateChart ignores a refused event and turns an action's error into error.execution)":
    a reason that is not the chart's (a StateMachine, no action); it now says the run started
    in the chart's start_configuration_values and paths from the declared initial state."""
    walk = next(w for w in transition_tour(Resumed))
    try:
        drive(compiled(Resumed).run(GuardTable.for_chart(Resumed, outcomes=walk.start)), walk)
    except PathNotFollowed as missed:
        message = str(missed)
    else:  # pragma: no cover - the run starts in 'waiting'
        raise AssertionError("the walk from 'fresh' was followed by a run started in 'waiting'")
    assert message.startswith("Resumed: step 1 of "), message
    assert message.endswith("(the run started in the chart's start_configuration_values "
                            "['waiting']; paths start from the declared initial state "
                            "'fresh')"), message


class Boiler(StateChart):
    """It cools down by itself (an eventless transition) once ``cooled`` holds and
    ``hot_enough`` does not: guards that change after the boiler got hot, not on the step that
    made it hot (``warm`` needs ``hot_enough``)."""

    cold = State(initial=True)
    heating = State()
    hot = State()
    heat = cold.to(heating)
    warm = heating.to(hot, cond="hot_enough") | heating.to.itself(internal=True)
    hot.to(cold, cond="cooled and not hot_enough")  # eventless
    drain = hot.to(cold)


def test_paths_reach_an_eventless_transition_whose_guards_change_after_the_step_that_arrived():
    """python-statemachine takes the eventless transitions the model's answers enable before
    the next event it is sent (``heat`` sent in ``hot`` with ``cooled``: hot -> cold, then
    cold -> heating). ``charts paths`` explored only eventless transitions taken within the
    macrostep of the step that arrived, and refused the chart, exit 2: "Boiler: transition(s)
    hot --(eventless)--> cold taken from no reachable configuration", a declaration bug it
    does not have."""
    eventless = next(t for t in compiled(Boiler).transitions if t.event == "")
    data = as_data(Boiler)  # raised ValueError
    (entry,) = [t for t in data["transitions"] if t["event"] == "" and t["from"] == "hot"]
    steps = entry["path"]
    assert steps and steps[-1]["event"] is not None
    # the path drives a python-statemachine instance through the eventless transition ...
    model = GuardTable.for_chart(Boiler)
    seen: list[tuple[str, str]] = []

    class Watch:
        def after_transition(self, source: State, target: State) -> None:
            seen.append((source.id, target.id))

    boiler = Boiler(model, listeners=[Watch()])
    for step in steps:
        model.outcomes = step["guards"]
        boiler.send(step["event"])
    assert ("hot", "cold") in seen
    assert [s.id for s in boiler.configuration] == [steps[-1]["to"]]
    # ... and the compiled run, as drive follows it
    (path,) = [p for p in transition_paths(Boiler) if p.transition == eventless]
    run = compiled(Boiler).run(GuardTable.for_chart(Boiler))
    before = compiled(Boiler).taken[eventless.id]
    drive(run, path)
    assert compiled(Boiler).taken[eventless.id] == before + 1
    # and the tour takes every transition, the eventless one included
    assert {t.id for walk in transition_tour(Boiler) for t in walk.steps} | {eventless.id} == {
        t.id for t in compiled(Boiler).transitions}


class Fallback(StateMachine):
    """A guard named ``default``, as ``GuardTable`` names its own fallback answer."""

    a = State(initial=True)
    b = State()
    c = State(final=True)
    go = a.to(b, cond="default") | a.to(c)
    back = b.to(a)


def test_a_guard_named_default_is_answered_by_the_guard_table_as_any_other():
    """``GuardTable.for_chart`` made a method ``default`` that the instance's own ``default``
    attribute (its fallback, True) hid: python-statemachine read the attribute, so ``go`` took
    ``a -> b`` under ``{"default": False}`` and the tour's walk to ``c`` was not followed."""
    for walk in as_data(Fallback)["tour"]:
        model = GuardTable.for_chart(Fallback)
        machine = Fallback(model)
        for step in walk:
            model.outcomes = step["guards"]
            machine.send(step["event"])
            assert [s.id for s in machine.configuration] == [step["to"]], step
    for walk in transition_tour(Fallback):
        assert drive(compiled(Fallback).run(GuardTable.for_chart(Fallback)), walk) == walk.end
    table = GuardTable.for_chart(Fallback, default=False)
    assert table.default() is False  # the chart's guard, answering the fallback


class Bookkeeping(StateMachine):
    a = State(initial=True)
    b = State(final=True)
    close = a.to(b, cond="outcomes")


def test_a_guard_named_outcomes_is_refused_by_the_guard_table_naming_it():
    """A guard named ``outcomes`` cannot be a method of a table whose ``outcomes`` a test
    sets: ``for_chart`` made one anyway, and every step then answered the dict's truth."""
    try:
        GuardTable.for_chart(Bookkeeping)
    except ValueError as refused:
        assert str(refused) == (
            "GuardTable.for_chart(Bookkeeping): guard 'outcomes' on transition a --close--> b "
            "has the name of the table a test sets (model.outcomes = step['guards']); rename "
            "the guard, or drive the chart with a model of your own")
    else:
        raise AssertionError("a GuardTable was made for a guard named outcomes")


def _two_orders(tmp_path: Path, monkeypatch: object) -> tuple[type, type]:
    """``shop.orders:Order`` and ``billing.orders:Order``: two charts of one class name."""
    for package, states in (("shop", ("new", "done")), ("billing", ("open", "closed"))):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        first, second = states
        (tmp_path / package / "orders.py").write_text(
            "from statemachine import State, StateMachine\n\n\n"
            "class Order(StateMachine):\n"
            f"    {first} = State(initial=True)\n"
            f"    {second} = State(final=True)\n"
            f"    go_{package} = {first}.to({second})\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # type: ignore[attr-defined]
    import importlib

    shop = importlib.import_module("shop.orders").Order
    billing = importlib.import_module("billing.orders").Order
    return shop, billing


def test_the_coverage_api_refuses_two_charts_of_one_name_instead_of_mixing_their_counts(
        tmp_path, monkeypatch):
    """``recording([shop Order, billing Order])`` (the API docs/framework.md lists) reported
    the shop's Order 1/1 covered after only billing's Order ran: a key is (chart name,
    transition id), so billing's transition 0 counted as the shop's. ``charts cover`` and the
    pytest plugin refuse such a pair; the API now does too, naming both."""
    shop, billing = _two_orders(tmp_path, monkeypatch)
    expected = ("two chart classes named Order, shop.orders:Order and billing.orders:Order: "
                "coverage counts a transition by its chart's name and id, so their counts "
                "would mix; give one class another name")
    refusals = []
    try:
        with recording([shop, billing]):
            pass
    except ValueError as refused:
        refusals.append(str(refused))
    recorder = TransitionRecorder()
    undo = track(shop, recorder)
    try:
        track(billing, recorder)  # (refused before it attaches anything)
    except ValueError as refused:
        refusals.append(str(refused))
    finally:
        undo()
    try:
        report([shop, billing], TransitionRecorder())
    except ValueError as refused:
        refusals.append(str(refused))
    assert refusals == [expected] * 3
    # one of them alone is counted as before
    with recording([billing]) as alone:
        compiled(billing).run(None).send("go_billing")  # (recording: compiled runs)
    assert [c.line() for c in report([billing], alone)] == ["transition coverage Order: 1/1"]
    try:
        report([shop], alone)
    except ValueError as refused:
        assert str(refused) == expected.replace(
            "shop.orders:Order and billing.orders:Order",
            "billing.orders:Order and shop.orders:Order")
    else:
        raise AssertionError("the shop's Order was reported from billing's counts")


class Contradiction(StateMachine):
    a = State(initial=True)
    b = State(final=True)
    go = a.to(b, cond="ready and not ready") | a.to(a)
    stop = a.to(b, cond="ready", unless="ready")


def test_a_transition_whose_own_guards_contradict_is_named_for_them_not_for_no_rival():
    """``charts paths`` said "can never be taken (shadowed by , declared before it for the
    same state and event, whose guards cannot all be refused)": shadowed by nothing. It is the
    transition's own guards that cannot all hold."""
    try:
        as_data(Contradiction)
    except ValueError as refused:
        assert str(refused) == (
            "Contradiction: transition a --go--> b can never be taken: its own guards "
            "('ready and not ready') cannot all hold at once")
    else:
        raise AssertionError("a transition no outcome takes was given a path")


def test_a_chart_registered_under_an_empty_or_blank_name_is_refused_naming_it():
    """``register(Chart, name="")`` fell back to the chart's own name without a word (a name
    computed by the app that came out empty then clashed with, or hid behind, the chart's
    own), and ``name=" "`` was drawn on the page as a blank heading with a URL of a space.
    Both are a ValueError naming the name (stop 53)."""
    inspector = Inspector()
    try:
        for name in ("", " ", "\t"):
            try:
                inspector.register(Ticket, counts=dict, name=name)
            except ValueError as refused:
                assert str(refused).startswith(f"register(Ticket): name={name!r}: "), refused
            else:
                raise AssertionError(f"name={name!r} was registered")
        assert inspector.live()["charts"] == {}
    finally:
        inspector.close()
