"""A newcomer's python-statemachine 3 charts through the compiled runs (stop 46, charts3).

The fixtures (``tests/data/charts3/``): a media player (history, shallow and deep, inside
compounds; a parallel state in a compound inside a parallel root; internal and external self
transitions; one event of several prioritised transitions with cond lists and ``unless``; a
model object; a class-level listener), an order workflow (``done.state`` from final children
of a compound and of a parallel state, ``error.execution``, a raising validator, eventless
transitions, automatic and guarded) and a generated chart of 134 states. Each is checked
against python-statemachine itself: the same events (and data, and model changes between
them) sent to an instance and to the compiled run must leave the same configuration, the same
refusals and errors and the same ordered log of callbacks.
"""

from __future__ import annotations

import importlib
import random
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from statemachine import State, StateMachine
from statemachine.exceptions import TransitionNotAllowed

from calexec.machines.chart_contracts import contracts_checked, precondition
from calexec.machines.chartref import ChartRefError, load_chart
from calexec.machines.compiled import (
    JOB,
    ChartRun,
    ChartTransitionError,
    EventDataRun,
    GuardRejected,
    compiled,
)
from calexec.machines.coverage import recording, report

FIXTURES = Path(__file__).parent / "data" / "charts3"


CHARTS = {"media_player": "media_player:MediaPlayer", "order_flow": "order_flow:OrderFlow",
          "big_chart": "big_chart:BigChart"}


def fixture(module: str) -> ModuleType:
    """The fixture module, imported as the commands import it (``load_chart``, from its
    directory)."""
    load_chart(CHARTS[module], cwd=str(FIXTURES))
    return importlib.import_module(module)


# ---- the flat run's send with event data --------------------------------------------------


class Payment(StateMachine):
    """A flat chart whose guard reads event data, with an unguarded fallback."""

    created = State(initial=True)
    large = State()
    small = State()
    settled = State(final=True)

    pay = created.to(large, cond="big") | created.to(small)
    settle = large.to(settled, cond="cleared") | small.to(settled)


class Till:
    def big(self, amount: int = 0) -> bool:
        return amount > 10

    def cleared(self) -> bool:
        return True


class NosyTill(Till):
    def big(self, event: str = "", amount: int = 0) -> bool:  # type: ignore[override]
        return amount > 10


def _answer(send: Any, *args: object, **data: object) -> object:
    try:
        send(*args, **data)
    except (TransitionNotAllowed, ChartTransitionError):
        return "refused"
    return "taken"


@pytest.mark.parametrize("args, data", [((), {"amount": 20}), ((), {"amount": 5}), ((30,), {}),
                                        ((), {"amount": 20, "note": "x"}), ((), {})])
def test_a_flat_runs_send_with_event_data_answers_as_python_statemachine(
        args: tuple[object, ...], data: dict[str, object]) -> None:
    machine = Payment(Till())
    run = compiled(Payment).run(Till())
    assert isinstance(run, EventDataRun)
    assert _answer(run.send, "pay", *args, **data) == _answer(machine.send, "pay", *args, **data)
    assert run.state == machine.current_state_value
    assert run.can("settle", *args, **data) is True
    assert _answer(run.send, "settle", *args, **data) == _answer(machine.send, "settle", *args,
                                                                  **data)
    assert run.state == machine.current_state_value == "settled"


def test_a_flat_run_with_data_refuses_what_the_chart_refuses() -> None:
    run = compiled(Payment).run(Till())
    run.send("pay", amount=20)
    with pytest.raises(ChartTransitionError, match="Payment: event 'pay' is not allowed"):
        run.send("pay", amount=20)
    assert run.can("pay", amount=20) is False


def test_a_guard_taking_what_only_an_instance_injects_is_refused_naming_chart_event_guard(
) -> None:
    run = compiled(Payment).run(NosyTill())
    with pytest.raises(TypeError) as raised:
        run.send("pay", amount=20)
    message = str(raised.value)
    for part in ("Payment", "'pay'", "amount=20", "'created'", "'big'", "NosyTill.big takes event",
                 "StatechartRun(compiled(Payment), model)"):
        assert part in message
    assert run.state == "created"


def test_a_guard_refusing_with_data_is_guard_rejected() -> None:
    class Never(Till):
        def cleared(self) -> bool:
            return False

    run = compiled(Payment).run(Never())
    run.send("pay", amount=50)
    with pytest.raises(GuardRejected, match="cleared"):
        run.send("settle", amount=1)


class Guarded(StateMachine):
    """``Payment`` with a contract: a large payment is never settled uncleared."""

    created = State(initial=True)
    large = State()
    small = State()
    settled = State(final=True)

    pay = created.to(large, cond="big") | created.to(small)
    settle = large.to(settled, cond="cleared") | small.to(settled)

    @precondition("settle")
    def settles_only_what_was_paid(till: Till) -> bool:
        return getattr(till, "paid", True)


def test_a_send_with_data_is_recorded_by_coverage_and_checked_by_contracts() -> None:
    with recording([Payment]) as recorder:
        run = compiled(Payment).run(Till())
        run.send("pay", amount=20)
        run.send("settle", amount=20)
    (coverage,) = report([Payment], recorder)
    assert coverage.covered == 2 and {t.target for t in coverage.untaken} == {"small", "settled"}
    till = Till()
    till.paid = False  # type: ignore[attr-defined]
    with contracts_checked(Guarded, raise_on_violation=False) as monitor:
        run = compiled(Guarded).run(till)
        run.send("pay", amount=20)
        run.send("settle", amount=20)
    assert [v.contract for v in monitor.violations] == ["settles_only_what_was_paid"]


def test_calexecs_own_charts_keep_the_keyword_free_send_of_the_hot_path() -> None:
    """A deliberate decision (docs/framework.md): the executor sends its charts no data, and a
    ``**data`` parameter costs every send of the hot path; any other flat chart takes data."""
    run = JOB.run(object())
    assert type(run) is ChartRun
    with pytest.raises(TypeError, match="unexpected keyword argument 'amount'"):
        run.send("admit", amount=1)  # type: ignore[call-arg]


# ---- differential: the fixtures against python-statemachine ---------------------------------


def _ids(machine: Any) -> tuple[str, ...]:
    return tuple(state.id for state in machine.configuration)


def _outcome(send: Any, event: str, data: dict[str, object]) -> tuple[object, ...]:
    try:
        return ("ok", repr(send(event, **data)))
    except (TransitionNotAllowed, ChartTransitionError):
        return ("refused",)
    except Exception as err:  # noqa: BLE001 - compared, type and message
        return ("error", type(err).__name__, str(err))


def _differential(chart: Any, model: Any, events: list[tuple[str, dict[str, object]]],
                  changes: list[tuple[str, object]], seed: int, length: int = 30) -> int:
    """Random events (and model changes between them) to an instance and to the compiled run;
    returns how many events were taken, asserting both agree after each."""
    rnd = random.Random(seed)
    ours, theirs = model(), model()
    machine = chart(model=theirs)
    run = compiled(chart).run(ours)
    assert _ids(machine) == tuple(run.configuration)
    history: list[object] = []
    taken = 0
    for _ in range(length):
        if rnd.random() < 0.25:
            name, value = rnd.choice(changes)
            setattr(ours, name, value)
            setattr(theirs, name, value)
            history.append((name, value))
            continue
        event, data = rnd.choice(events)
        history.append((event, data))
        expected = _outcome(machine.send, event, data)
        got = _outcome(run.send, event, data)
        assert got == expected, history
        assert tuple(run.configuration) == _ids(machine), history
        assert ours.log == theirs.log, history
        taken += expected[0] == "ok"
        if machine.is_terminated:
            break
    return taken


MEDIA_EVENTS = ["play", "pause", "resume", "back", "stop", "seek", "sought", "tick", "restart",
                "buffered", "starve", "plug", "unplug", "wake", "sleep", "wake_again"]


@pytest.mark.parametrize("seed", range(40))
def test_the_media_player_runs_as_python_statemachine_runs_it(seed: int) -> None:
    media = fixture("media_player")
    changes = [(flag, value) for flag in ("licensed", "network", "offline_mode", "battery_low")
               for value in (True, False)]
    _differential(media.MediaPlayer, media.Player, [(e, {}) for e in MEDIA_EVENTS], changes,
                  seed)


def test_history_and_self_transitions_of_the_media_player_land_where_an_instance_does() -> None:
    media = fixture("media_player")
    script = ["play", "buffered", "plug", "tick", "pause", "resume", "restart", "seek", "sought",
              "pause", "stop", "play", "pause", "back", "wake", "wake_again"]
    machine = media.MediaPlayer(model=media.Player())
    run = compiled(media.MediaPlayer).run(media.Player())
    for event in script:
        machine.send(event)
        run.send(event)
        assert tuple(run.configuration) == _ids(machine), event
    # the deep history restored the decoder and the headphones after pause/resume; the
    # external self transition re-entered the track (its children back to their initial)
    assert run.model.log == machine.model.log
    assert ("restart",) in run.model.log and ("tick",) in run.model.log


ORDER_EVENTS: list[tuple[str, dict[str, object]]] = [
    ("submit", {}), ("review", {}), ("pack", {}), ("pack", {"weight": 0}), ("charge", {}),
    ("charge", {"amount": -1}), ("deliver", {}), ("retry", {})]


@pytest.mark.parametrize("seed", range(40))
def test_the_order_flow_runs_as_python_statemachine_runs_it(seed: int) -> None:
    orders = fixture("order_flow")
    changes: list[tuple[str, object]] = [("items", 0), ("items", 1), ("fraud", True),
                                         ("fraud", False), ("vip", True), ("vip", False)]
    _differential(orders.OrderFlow, orders.Order, ORDER_EVENTS, changes, seed)


def test_the_generated_chart_of_134_states_runs_as_python_statemachine_runs_it() -> None:
    big = fixture("big_chart")

    class Model(big.Model):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.log: list[object] = []

    events = [(e, {}) for e in ["go", "advance", "finish", "back",
                                *[f"next{i}" for i in range(12)], *[f"skip{i}" for i in range(12)]]]
    assert len(compiled(big.BigChart).states) == 134
    for seed in range(10):
        _differential(big.BigChart, Model, events, [("quick", True), ("quick", False)], seed,
                      length=80)


@pytest.mark.parametrize("ref", ["bad_chart:Broken", "bad_chart:Light"])
def test_a_chart_class_python_statemachine_refuses_is_named_with_its_problem(ref: str) -> None:
    """python-statemachine's own message names the problem, not the class: with two charts in
    the module (``Light`` fine, ``Broken`` refused) the reader could not tell which one."""
    with pytest.raises(ChartRefError) as raised:
        load_chart(ref, cwd=str(FIXTURES))
    message = str(raised.value)
    assert ref in message and "InvalidDefinition in chart class Broken at bad_chart.py:14" in message
    assert "Disconnected states: ['orphan']" in message and "\n" not in message
