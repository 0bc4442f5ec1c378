"""Stop 65, a newcomer's leftovers with the statechart toolkit: the interleaving explorer given
a chart whose callback blocks outside the scheduler, ``charts paths`` given a chart file that
does not exist, and ``charts draw`` refusing an invoked ``timeout()`` without a remedy."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from statemachine import State, StateChart

from calexec.cli import main as cli
from calexec.drivers.tools import explore
from calexec.drivers.tools.interleave import explore_threads, replay_threads


def _door(held: threading.Event) -> type[StateChart]:  # type: ignore[type-arg]
    """A newcomer's chart whose entry action waits for a signal (``threading``'s own event,
    which nothing sets in the test): it blocks wherever the chart is driven."""

    class Door(StateChart):  # type: ignore[type-arg]
        closed = State(initial=True)
        opening = State()
        open_ = State(final=True)
        press = closed.to(opening)
        done = opening.to(open_)

        def on_enter_opening(self) -> None:
            held.wait(5.0)  # (bounded: the old code waited it out, then passed)

    return Door


@pytest.mark.parametrize("where", ["the scenario", "the final check", "the invariant"])
def test_a_chart_blocking_outside_the_threads_fails_the_schedule_naming_it(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A chart driven by the scenario itself, its final check or an invariant (all run before
    or after the controlled threads, in the explorer's driver) whose callback blocked hung the
    caller for as long as it blocked, for ever on ``held.wait()``: the watchdog covered the
    controlled threads only. It now fails the schedule after ``watchdog_s`` real seconds
    without a scheduling point, naming who blocked, where, and how to raise the bound."""
    monkeypatch.setattr(explore, "WATCHDOG_S", 0.3)  # (the old code's only knob)
    held = threading.Event()
    door = _door(held)

    def scenario(clock):
        lock = clock.lock()

        def step() -> None:
            with lock:
                pass
        clock.start_thread(step, "t")
        if where == "the scenario":
            door().send("press")
        if where == "the final check":
            return lambda: door().send("press") and True
        return None

    calls = []

    def invariant() -> bool:
        calls.append(1)
        if len(calls) == 1:  # (checked first before any thread runs)
            door().send("press")
        return True

    try:
        found = explore_threads(scenario, seeds=[0],
                                invariant=invariant if where == "the invariant" else None)
    finally:
        held.set()
    assert found.failure is not None, "the blocked driver passed the schedule"
    message = found.failure.message
    assert message.startswith(f"watchdog: {where} did not return within 0.3s real time"), message
    assert "watchdog_s=120" in message and "CALEXEC_EXPLORE_WATCHDOG_S=120" in message, message
    assert "on_enter_opening" in message and "held.wait" in message, message  # its stack


def test_the_watchdog_is_an_argument_of_the_exploration_and_the_replay() -> None:
    """The bound was ``$CALEXEC_EXPLORE_WATCHDOG_S`` alone (or a module attribute): a test could
    not say how long its own scenario may block. ``watchdog_s=`` sets it for one call, a bad
    one refused naming it before any schedule; a controlled thread's failure says how to
    raise it."""
    held = threading.Event()
    ran: list[int] = []

    def stuck(clock):
        ran.append(1)
        clock.start_thread(lambda: held.wait(5.0), "stuck")
    try:
        found = explore_threads(stuck, seeds=[0], watchdog_s=0.25)
        assert found.failure is not None
        assert found.failure.message.startswith(
            "watchdog: thread stuck did not reach a scheduling point within 0.25s"), (
            found.failure.message)
        assert "raise the bound: explore_threads(..., watchdog_s=120)" in found.failure.message
        again = replay_threads(stuck, found.failure.choices, watchdog_s=0.25)
        assert again is not None and again.message.startswith("watchdog: thread stuck")
    finally:
        held.set()
    ran.clear()
    for bad, error in [(0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                       ("5", TypeError), (True, TypeError)]:
        with pytest.raises(error, match=rf"^watchdog_s={bad!r}: the real seconds"):
            explore_threads(stuck, seeds=[0], watchdog_s=bad)
        with pytest.raises(error, match=rf"^watchdog_s={bad!r}: the real seconds"):
            replay_threads(stuck, [], watchdog_s=bad)
    assert ran == []


def test_a_chart_file_that_does_not_exist_is_named_as_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``calexec charts paths nope.py`` (no such file) answered "did you mean 'nope:py'?", its
    extension offered as a class; the existing file was fixed at this stop."""
    monkeypatch.chdir(tmp_path)
    for given, stem in (("nope.py", "nope"), ("src/nope.py", "nope"), ("./nope.py", "nope")):
        assert cli(["charts", "paths", given]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "did you mean" not in line, line
        assert line.endswith(f"{given!r} is no file in {tmp_path} (nor a module): name the "
                             f"module that declares the chart, as imported from there, and "
                             f"the class after a colon, e.g. {stem}:CLASS for {stem}.py"), line
    # with its class: "cannot import module 'nope.py' ... No module named 'nope'"
    assert cli(["charts", "paths", "nope.py:Door"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(f"'nope.py:Door': 'nope.py' is no file in {tmp_path} (nor a module): "
                         f"name the module that declares the chart, as imported from there, "
                         f"without .py (e.g. nope:Door for nope.py)"), line


TIMED = '''
from statemachine import State, StateChart
from statemachine.contrib.timeout import timeout


class Gate(StateChart):
    waiting = State(initial=True, invoke=timeout(5, on="expired"))
    closed = State(final=True)
    expired = waiting.to(closed)
'''


def test_charts_draw_refusing_an_invoked_timeout_says_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``charts draw`` of a chart with ``invoke=timeout(5, on="expired")`` said only "does not
    support yet: invoke timeout(5, on='expired') on state 'waiting'"."""
    name = f"gate_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(TIMED, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli(["charts", "draw", f"{name}:Gate", "--out", str(tmp_path / "d")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "invoke timeout(5, on='expired') on state 'waiting' (an invoke runs as its state is "\
        "entered" in line, line
    assert line.endswith("drop invoke= and send that event from your own code, e.g. for "
                         "timeout(5, on='expired') keep the transition on 'expired' and have a "
                         "timer of yours call send('expired') 5 s after the state is entered)"), line
