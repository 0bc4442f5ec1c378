"""What a newcomer's mistake on a compiled run says (stop 44): a typo'd or non-string event,
a model without the guard, a guard that needs event data. Each names the chart, the event and
what is wrong, on the flat fast path (``ChartRun``) as on the general run, and costs the flat
run's success path nothing (machines/compiled.py: the context is built only once it raised)."""

from __future__ import annotations

import pytest
from statemachine import State, StateMachine

from calexec.machines.compiled import ChartTransitionError, IllegalTransition, compiled
from calexec.machines.statechart_run import StatechartRun


class Till(StateMachine):
    """A flat chart of named guards: its compiled run is the flat fast path."""

    idle = State(initial=True)
    open_ = State()
    closed = State(final=True)

    start = idle.to(open_, cond="has_float")
    pay = open_.to.itself(cond="big")  # type: ignore[no-untyped-call]
    close = open_.to(closed)


class Model:
    def has_float(self) -> bool:
        return True

    def big(self, amount: int = 0) -> bool:
        return amount > 10


def _runs(model: object) -> list:
    flat = compiled(Till).run(model)
    assert type(flat).__name__ == "EventDataRun"  # (the flat fast path of a user's chart)
    return [flat, StatechartRun(compiled(Till), model)]


@pytest.mark.parametrize("kind", ["flat", "general"])
def test_a_typod_event_is_named_with_the_event_it_probably_meant(kind):
    run = _runs(Model())[kind == "general"]
    with pytest.raises(IllegalTransition) as raised:
        run.send("strat")
    text = str(raised.value)
    assert text.startswith("Till: event 'strat' is not allowed in state 'idle'"), text
    assert "Till has no event 'strat' (did you mean 'start'?)" in text, text
    with pytest.raises(IllegalTransition, match=r"Till has no event 'zzz' \(its events: start, "
                                                r"pay, close\)"):
        run.send("zzz")


@pytest.mark.parametrize("kind", ["flat", "general"])
@pytest.mark.parametrize("event", [["start"], None, {"event": "start"}],
                         ids=["list", "none", "dict"])
def test_an_event_that_is_not_a_string_is_an_illegal_transition_naming_it(kind, event):
    """It was a bare ``TypeError: unhashable type: 'list'`` (flat) or ``attribute name must
    be string`` (general), naming neither the chart nor the event."""
    run = _runs(Model())[kind == "general"]
    with pytest.raises(IllegalTransition) as raised:
        run.send(event)
    text = str(raised.value)
    assert text.startswith(f"Till: event {event!r} is not allowed in state 'idle'"), text
    assert f"not {type(event).__name__} {event!r} (start, pay, close)" in text, text


def test_a_model_without_the_guard_is_named_with_the_chart_event_and_guard():
    """It was ``AttributeError: 'Bare' object has no attribute 'has_float'``."""
    class Bare:
        pass

    run = compiled(Till).run(Bare())
    with pytest.raises(AttributeError, match=r"^Till: event 'start' in state 'idle': guard "
                                             r"'has_float': the model, Bare, has no attribute "
                                             r"'has_float'"):
        run.send("start")
    assert run.state == "idle"
    with pytest.raises(AttributeError, match="has no attribute 'has_float'"):
        run.can("start")  # not a refusal: can() does not answer False for a missing guard


def test_a_guard_that_needs_event_data_names_it_and_the_general_run():
    """It was ``TypeError: Strict.big() missing 1 required positional argument: 'amount'``."""
    class Strict(Model):
        def big(self, amount: int) -> bool:  # type: ignore[override]
            return amount > 10

    model = Strict()
    run = compiled(Till).run(model)
    run.send("start")
    with pytest.raises(TypeError) as raised:
        run.send("pay")
    text = str(raised.value)
    assert text.startswith("Till: event 'pay' in state 'open_': guard 'big': Strict.big cannot "
                           "be called with no argument (missing a required argument: "
                           "'amount')"), text
    assert "StatechartRun(compiled(Till), model)" in text
    general = StatechartRun(compiled(Till), model)  # what the message says to do
    general.send("start")
    general.send("pay", amount=20)
    assert general.state == "open_"


def test_an_error_a_guard_raises_itself_keeps_its_type_and_gains_where():
    class Raising(Model):
        def has_float(self) -> bool:
            raise TypeError("float drawer jammed")

    run = compiled(Till).run(Raising())
    with pytest.raises(TypeError, match="^float drawer jammed") as raised:
        run.send("start")
    assert raised.value.__notes__ == [
        "(raised evaluating Till: event 'start' in state 'idle': guard 'has_float')"]
    assert not isinstance(raised.value, ChartTransitionError)


@pytest.mark.parametrize("error", [ValueError, ZeroDivisionError, RuntimeError, KeyError])
def test_a_guard_s_own_error_of_any_type_gains_where_on_send_without_data(error):
    """Only a guard's ``AttributeError``/``TypeError`` gained the note naming the chart, the
    event, the state and the guard on the flat run's ``send(event)``: a ``ValueError`` (or a
    ``ZeroDivisionError``, ...) came out bare, while ``can(event)`` and ``send(event, x=1)``
    (which evaluate the guards another way) noted it. Every error a guard raises is noted
    now, on each of the three."""
    class Raising(Model):
        def has_float(self) -> bool:
            raise error("float drawer jammed")

    note = "(raised evaluating Till: event 'start' in state 'idle': guard 'has_float')"
    run = compiled(Till).run(Raising())
    with pytest.raises(error) as raised:
        run.send("start")
    assert raised.value.__notes__ == [note]
    assert run.state == "idle"
    with pytest.raises(error) as raised:
        run.can("start")
    assert raised.value.__notes__ == [note.replace("'start' in", "'start' with data () in")]
