"""Found at stop 66 driving the toolkit as a newcomer team on its own charts: a pedestrian
crossing (parallel regions, eventless transitions, a final state in a compound, history), a
document approval (model properties and methods as guards, ``unless=``, validators) and a
door chart inside a package. Each test failed on the code before its fix."""

from __future__ import annotations

from statemachine import State, StateChart

from calexec.drivers.tools.interleave import explore_threads, replay_threads
from calexec.machines.clock import Clock
from calexec.machines.compiled import compiled


class Till(StateChart):  # type: ignore[type-arg]
    """An async action that raises: python-statemachine's async engine makes it
    error.execution, which no transition takes."""

    idle = State(initial=True)
    open_ = State()
    go = idle.to(open_)
    back = open_.to(idle)

    async def on_go(self) -> None:
        raise RuntimeError("drawer jammed")


class Recovering(StateChart):  # type: ignore[type-arg]
    """Takes error.execution, but the action of that transition raises too."""

    idle = State(initial=True)
    broken = State(final=True)
    go = idle.to.itself()
    error_execution = idle.to(broken, on="recover")

    def on_go(self) -> None:
        raise RuntimeError("first")

    def recover(self) -> None:
        raise RuntimeError("while recovering")


class Model:
    pass


def _sending(make: object, event: str) -> object:
    def scenario(clock: Clock) -> None:
        machine = make()  # type: ignore[operator]
        clock.start_thread(lambda: machine.send(event), "clerk")

    return scenario


def test_an_async_charts_dropped_error_fails_the_schedule() -> None:
    result = explore_threads(_sending(Till, "go"), seeds=range(2))
    assert result.failure is not None, "an async chart's dropped error passed the exploration"
    message = result.failure.message
    assert "unhandled error.execution: Till" in message
    assert "RuntimeError: drawer jammed" in message and "'on_go'" in message
    again = replay_threads(_sending(Till, "go"), result.failure.choices)
    assert again is not None and "drawer jammed" in again.message


def test_an_error_raised_while_handling_error_execution_fails_the_schedule() -> None:
    result = explore_threads(_sending(Recovering, "go"), seeds=range(2))
    assert result.failure is not None, "the error of the error handler was dropped unseen"
    message = result.failure.message
    assert "Recovering" in message and "RuntimeError: while recovering" in message
    assert "'recover'" in message and "while the chart handled error.execution" in message


def test_a_compiled_run_dropping_an_error_of_its_error_handler_is_heard_too() -> None:
    def make() -> object:
        return compiled(Recovering).run(Model())

    result = explore_threads(_sending(make, "go"), seeds=range(2))
    assert result.failure is not None
    assert "RuntimeError: while recovering" in result.failure.message


def test_the_opt_out_lets_both_pass() -> None:
    for chart in (Till, Recovering):
        result = explore_threads(_sending(chart, "go"), seeds=range(2),
                                 ignore_unhandled_errors=True)
        assert result.failure is None and result.schedules == 2
