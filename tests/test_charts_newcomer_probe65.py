"""Stop 65, a newcomer's own charts through the toolkit (an order workflow with compound,
parallel and history states; a retry/backoff chart; a door chart whose states come from an
Enum, ``States.from_enum``, on a model object). python-statemachine keys a chart's
``states_map`` by each state's *value*, which ``State(value=...)`` and an Enum's states make
differ from the id every tool names a state by: the tools that looked states up by id there
failed or went blind on such a chart."""

from __future__ import annotations

from enum import Enum

import pytest
from statemachine import State, StateChart, StateMachine
from statemachine.states import States

from calexec.machines.diagrams import ACTIVE_FILL, active_configuration, render_chart_dot
from calexec.machines.paths import as_data


class Door(Enum):
    CLOSED = 1
    OPEN = 2
    LOCKED = 3


class Lockable:
    def __init__(self) -> None:
        self.state = None
        self.has_key = True

    def key_ok(self) -> bool:
        return self.has_key


class DoorChart(StateMachine):
    _ = States.from_enum(Door, initial=Door.CLOSED, use_enum_instance=True)

    open = _.CLOSED.to(_.OPEN)
    close = _.OPEN.to(_.CLOSED)
    lock = _.CLOSED.to(_.LOCKED, cond="key_ok")
    unlock = _.LOCKED.to(_.CLOSED, cond="key_ok")


class Kiln(StateChart):  # type: ignore[type-arg]
    idle = State(initial=True, value="IDLE")

    class firing(State.Compound):
        heating = State(initial=True, value="HEATING")
        cooled = State(final=True, value="COOLED")
        cool = heating.to(cooled)
        reheat = cooled.to(heating)

    start = idle.to(firing)


class Named(StateMachine):
    rot_ = State("Rot", initial=True, value="R")
    green = State("Go now", value="G")

    go = rot_.to(green)
    stop = green.to(rot_)


def _node(dot: str, state: str) -> str:
    return next(line for line in dot.splitlines() if line.strip().startswith(f"{state} ["))


def test_an_enum_charts_state_is_highlighted_by_its_id() -> None:
    # the live inspector draws the state holding most runs, so its page and every drawing of
    # an Enum chart answered 500 (KeyError: 'LOCKED'), as render_chart_dot raised here
    assert active_configuration(DoorChart, "LOCKED") == ("LOCKED",)
    dot = render_chart_dot(DoorChart, active_state="LOCKED")
    assert f"fillcolor={ACTIVE_FILL}" in _node(dot, "LOCKED")
    assert ACTIVE_FILL not in _node(dot, "CLOSED")
    dot = render_chart_dot(Kiln, active_state="firing,cooled")
    assert f"fillcolor={ACTIVE_FILL}" in _node(dot, "cooled")


def test_a_state_declared_with_a_value_keeps_its_own_name_in_the_drawing() -> None:
    dot = render_chart_dot(Named)
    assert 'label="Rot (rot_)"' in _node(dot, "rot_")
    assert 'label="Go now (green)"' in _node(dot, "green")


def test_paths_refuse_a_transition_out_of_a_final_child_declared_with_a_value() -> None:
    # as for the same chart without value=: entering cooled raises done.state.firing, yet
    # reheat takes firing on; charts paths offered "start cool reheat", exit 0
    with pytest.raises(ValueError, match=r"cooled --reheat--> heating out of cooled, a final "
                                         r"state of firing"):
        as_data(Kiln)


@pytest.mark.requires_tool("dot")
def test_the_live_inspector_draws_an_enum_chart() -> None:
    from starlette.testclient import TestClient

    from calexec.machines.inspector import Inspector, inspector_app

    door = DoorChart(Lockable())
    door.send("lock")
    inspector = Inspector()
    inspector.register(DoorChart, runs=lambda: [door])
    with TestClient(inspector_app(inspector), raise_server_exceptions=False) as client:
        assert client.get("/").status_code == 200
        busiest = client.get("/DoorChart.svg")
        assert busiest.status_code == 200 and 'id="s_LOCKED"' in busiest.text
        assert client.get("/DoorChart.svg?active=OPEN").status_code == 200
        refused = client.get("/DoorChart.svg?active=Door.OPEN")
        assert refused.status_code == 400 and "CLOSED, OPEN, LOCKED" in refused.text


def test_a_chart_file_given_without_a_class_is_named_as_a_file(tmp_path, monkeypatch,
                                                                capsys) -> None:
    # `calexec charts paths enums.py` answered "did you mean 'enums:py'?": the file's
    # extension offered as a chart class, which the next run refuses in turn
    from calexec.cli import main as cli

    (tmp_path / "src").mkdir()
    for where in ("doors.py", "src/doors.py"):
        (tmp_path / where).write_text("from statemachine import State, StateMachine\n")
    monkeypatch.chdir(tmp_path)
    for given, module in (("doors.py", "doors"), ("./doors.py", "doors"),
                          (str(tmp_path / "doors.py"), "doors"), ("src/doors.py", "src.doors")):
        assert cli(["charts", "paths", given]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "did you mean" not in line, line
        assert line.endswith(f"{given!r} is a file path, not a module name: name its module and "
                             f"a chart class it declares after a colon, {module}:CLASS"), line


class Retry(StateChart):  # type: ignore[type-arg]
    idle = State(initial=True)
    running = State()
    done = State(final=True)

    start = idle.to(running)
    finish = running.to(done, cond="succeeded")

    def on_enter_running(self) -> None:  # an action: the general run
        self.model.attempts += 1


class Misspelt:
    attempts = 0

    def succeded(self) -> bool:
        return True


def test_a_general_run_of_a_model_missing_a_guard_names_the_chart_and_the_fix() -> None:
    # it was python-statemachine's "Error on transition finish from Running to Done when
    # resolving callbacks: Did not found name 'succeeded' from model or statemachine": no chart,
    # no model, nothing to do
    from statemachine.exceptions import InvalidDefinition

    from calexec.machines.compiled import compiled

    with pytest.raises(InvalidDefinition) as refused:
        compiled(Retry).run(Misspelt())
    assert str(refused.value).startswith("Retry: error on transition finish from Running to "
                                         "Done when resolving callbacks: ")
    assert str(refused.value).endswith(
        "; did you mean 'succeded'? (the model is Misspelt: give it a method succeeded, or "
        "correct the name in the chart)")


class Order:
    def __init__(self) -> None:
        self.state = None
        self.paid = False

    def payment_ok(self) -> bool:
        return self.paid


class OrderFlow(StateChart):  # type: ignore[type-arg]
    cart = State(initial=True)
    done = State(final=True)

    class fulfilment(State.Parallel):
        class payment(State.Compound):
            pending = State(initial=True)
            settled = State(final=True)
            settle = pending.to(settled, cond="payment_ok")

        class shipping(State.Compound):
            picking = State(initial=True)
            packed = State(final=True)
            pack = picking.to(packed)

    checkout = cart.to(fulfilment)
    done_state_fulfilment = fulfilment.to(done)


def test_a_followed_statechart_run_shows_an_event_its_guards_refused() -> None:
    # StateChart semantics ignore the refused event (no GuardRejected raised): the followed
    # run's path left it out, so the live view of an order stuck in `pending` never said that
    # payment_ok refused `settle`, as it says for a StateMachine's run
    from calexec.machines.compiled import compiled
    from calexec.machines.inspector import PathLog

    order = Order()
    run = compiled(OrderFlow).run(order)
    paths = PathLog()
    paths.follow("o7", run)
    run.send("checkout")
    run.send("settle")  # refused by payment_ok: ignored, as an instance ignores it
    run.send("checkout")  # no transition of the configuration names it: no guard refused it
    assert run.state == "fulfilment,payment,pending,shipping,picking"
    record = paths.record("o7")
    assert record is not None
    assert [(s["event"], s["from"], s["to"], s["refused_by"]) for s in record["trail"]] == [
        ("checkout", "cart", "fulfilment", None), ("settle", "pending", None, ["payment_ok"])]
    order.paid = True
    run.send("settle")
    run.send("pack")
    assert run.state == "done"


def test_a_slotted_models_saved_state_is_where_the_run_starts() -> None:
    # a @dataclass(slots=True) model has no __dict__: its saved state was not read, so the
    # flat run started CLOSED where the instance restores LOCKED (`unlock` then refused as
    # IllegalTransition), and the general run started in the initial state without a word
    from dataclasses import dataclass

    from calexec.machines.compiled import UnsupportedChart, compiled

    @dataclass(slots=True)
    class Ticket:
        state: object = None
        has_key: bool = True

        def key_ok(self) -> bool:
            return self.has_key

    assert list(DoorChart(Ticket(state=Door.LOCKED)).configuration_values) == [Door.LOCKED]
    run = compiled(DoorChart).run(Ticket(state=Door.LOCKED))
    assert run.state == "LOCKED"
    run.send("unlock")
    assert run.state == "CLOSED"
    assert compiled(DoorChart).run(Ticket()).state == "CLOSED"  # an unset state: the initial

    @dataclass(slots=True)
    class Saved:
        state: object = "pending"
        paid: bool = False

        def payment_ok(self) -> bool:
            return self.paid

    with pytest.raises(UnsupportedChart, match=r"the model already holds state='pending'"):
        compiled(OrderFlow).run(Saved())


def test_the_inspector_says_which_state_an_enum_member_answered_for_it_is() -> None:
    # an app's active= written as an instance reads its state
    # (next(iter(door.configuration_values)): Door.LOCKED, the state's value) was refused
    # naming the chart's ids alone, not that the answer was LOCKED's value nor what to answer
    from calexec.machines.inspector import Inspector

    door = DoorChart(Lockable())
    door.send("lock")
    inspector = Inspector()
    inspector.register(DoorChart, runs=lambda: [door],
                       active=lambda: next(iter(door.configuration_values)))
    inspector.register(DoorChart, name="by_counts", counts=lambda: {Door.LOCKED: 1})
    inspector.register(DoorChart, name="typo", counts=lambda: {"LOKED": 1})
    charts = inspector.live()["charts"]
    assert isinstance(charts, dict)
    for name, key in (("DoorChart", "active"), ("by_counts", "counts")):
        assert charts[name]["error"].endswith(
            f'{key}= function given to register answered a state the chart does not have: '
            f'"Door.LOCKED" (its states, by id: CLOSED, OPEN, LOCKED); "Door.LOCKED" is the '
            f'value of state LOCKED: answer its id, LOCKED'), charts[name]["error"]
    assert charts["typo"]["error"].endswith('"LOKED" (its states, by id: CLOSED, OPEN, LOCKED)')
