"""The interleaving explorer fails a schedule in which a ``StateChart`` callback raised and no
transition took the ``error.execution`` event python-statemachine made of it (stop 65,
explore2): until then the error was dropped and the schedule passed, so a check-then-act race
whose action raises went unseen by a newcomer exploring their own chart."""

from __future__ import annotations

import pytest
from statemachine import State, StateChart

from calexec.drivers.tools.interleave import explore_threads, replay_threads
from calexec.machines.clock import Clock
from calexec.machines.compiled import compiled
from calexec.machines.error_events import watch_unhandled_errors


class Stock:
    def __init__(self) -> None:
        self.seats = 1


class Ticket:
    """One booking's model (python-statemachine keeps its state there) on a shared stock."""

    def __init__(self, stock: Stock) -> None:
        self.stock = stock


class Booking(StateChart):  # type: ignore[type-arg]
    """Books a seat; ``take`` raises when none is left."""

    idle = State(initial=True)
    booked = State(final=True)
    book = idle.to(booked, on="take")

    def take(self, model: Ticket) -> None:
        if model.stock.seats <= 0:
            raise RuntimeError("sold out")
        model.stock.seats -= 1


class HandledBooking(StateChart):  # type: ignore[type-arg]
    """The same, declaring where the error goes (from the state the failed action leads to:
    python-statemachine completes the transition, then takes error.execution)."""

    idle = State(initial=True)
    booked = State()
    failed = State(final=True)
    book = idle.to(booked, on="take")
    release = booked.to(idle)
    error_execution = booked.to(failed)

    def take(self, model: Ticket) -> None:
        Booking.take(self, model)  # type: ignore[arg-type]


class PartlyHandled(StateChart):  # type: ignore[type-arg]
    """Declares error.execution, but only from ``idle``: the error comes in ``booked``."""

    idle = State(initial=True)
    booked = State()
    failed = State(final=True)
    book = idle.to(booked, on="take")
    release = booked.to(idle)
    error_execution = idle.to(failed)

    def take(self, model: Ticket) -> None:
        Booking.take(self, model)  # type: ignore[arg-type]


def _race(chart: type[StateChart]) -> object:  # type: ignore[type-arg]
    """Two clerks check the stock, then book: both may see the last seat."""

    def scenario(clock: Clock) -> None:
        stock = Stock()
        lock = clock.lock()

        def clerk() -> None:
            with lock:
                free = stock.seats > 0
            if free:
                with lock:
                    chart(model=Ticket(stock)).send("book")

        clock.start_thread(clerk, "a")
        clock.start_thread(clerk, "b")

    return scenario


def test_a_callback_error_no_transition_takes_fails_the_schedule_naming_it() -> None:
    found = explore_threads(_race(Booking), seeds=range(60))
    failure = found.failure
    assert failure is not None and failure.seed is not None
    assert "unhandled error.execution" in failure.message
    assert "Booking (states ['booked'])" in failure.message
    assert "callback 'take' (test_explore_unhandled_errors.py:" in failure.message
    assert "RuntimeError: sold out" in failure.message
    assert "ignore_unhandled_errors=True" in failure.message
    alone = explore_threads(_race(Booking), seeds=[failure.seed]).failure
    assert alone is not None and alone.message == failure.message
    again = replay_threads(_race(Booking), failure.choices)
    assert again is not None and again.message == failure.message


def test_the_opt_out_passes_every_schedule_of_a_chart_that_drops_its_errors() -> None:
    found = explore_threads(_race(Booking), seeds=range(60), ignore_unhandled_errors=True)
    assert found.failure is None and found.schedules == 60
    failing = explore_threads(_race(Booking), seeds=range(60)).failure
    assert failing is not None
    assert replay_threads(_race(Booking), failing.choices, ignore_unhandled_errors=True) is None


def test_a_chart_whose_transition_takes_error_execution_passes() -> None:
    found = explore_threads(_race(HandledBooking), seeds=range(60))
    assert found.failure is None and found.schedules == 60


def test_an_error_execution_declared_but_not_taken_where_it_happens_fails() -> None:
    failure = explore_threads(_race(PartlyHandled), seeds=range(60)).failure
    assert failure is not None
    assert "PartlyHandled (states ['booked']): callback 'take'" in failure.message
    assert "RuntimeError: sold out" in failure.message


def test_a_compiled_general_run_dropping_an_error_is_heard_too() -> None:
    monitor = watch_unhandled_errors()
    try:
        stock = Stock()
        compiled(Booking).run(Ticket(stock)).send("book")
        assert monitor.unhandled == []
        compiled(Booking).run(Ticket(stock)).send("book")  # none left: take raises
    finally:
        monitor.disable()
    assert len(monitor.unhandled) == 1
    assert "RuntimeError: sold out" in str(monitor.unhandled[0])
    assert "callback 'take'" in str(monitor.unhandled[0])


def test_an_error_outside_an_exploration_is_not_heard_by_a_disabled_monitor() -> None:
    monitor = watch_unhandled_errors()
    monitor.disable()
    stock = Stock()
    stock.seats = 0
    Booking(model=Ticket(stock)).send("book")  # dropped, as python-statemachine does
    assert monitor.unhandled == []


@pytest.mark.parametrize("flag", ["false", 0, None])
def test_an_opt_out_that_is_not_a_bool_is_refused_naming_it(flag: object) -> None:
    with pytest.raises(TypeError, match="ignore_unhandled_errors="):
        explore_threads(_race(Booking), seeds=range(1),
                        ignore_unhandled_errors=flag)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ignore_unhandled_errors="):
        replay_threads(_race(Booking), [], ignore_unhandled_errors=flag)  # type: ignore[arg-type]
