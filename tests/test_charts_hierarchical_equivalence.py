"""The general compiled run (machines/statechart_run.py) is proven equal to python-statemachine.

Random event sequences, each event with random data (``amount``, ``flag``), are sent to a real
python-statemachine instance and to the compiled run of the same chart class, each with its own
model. After every event both must agree on: the active configuration (ids, in order), whether
the event was refused and how (``StateMachine``: raised, ``TransitionNotAllowed`` on one side,
``IllegalTransition``/``GuardRejected`` on the other; ``StateChart``: ignored), any other
error's type and message (a raising validator), the value ``send`` returns, whether the run
terminated, and the exact ordered list of the callbacks called with the arguments they were
given (state enter/exit, transition before/on/after, naming-convention and generic callbacks,
guards and validators themselves).

The charts cover: compound states with an initial child, a parallel state with three regions,
shallow and deep history, final states and the ``done.state.<id>`` events of compound and
parallel states, transitions from ancestors, eventless transitions, guards as names, ``unless``,
boolean expressions and callables, validators raising, ``error.execution`` from a raising
action (``StateChart``) and the same error raised to the caller (``StateMachine``); callbacks
that reach the machine (``In('id')`` guards, ``raise_``/``send``/an event method from an
action, ``machine.configuration``, ``event_data``), an event of several ids and a transition
bound to two events, class-level listeners.

Size: ``CALEXEC_HIER_EXAMPLES`` examples per chart (default 60: a few seconds), sequences of up
to 30 events; a longer run: ``CALEXEC_HIER_EXAMPLES=5000``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from statemachine import Event, HistoryState, State, StateChart, StateMachine
from statemachine.exceptions import TransitionNotAllowed

from calexec.machines.compiled import (
    ChartTransitionError,
    GuardRejected,
    IllegalTransition,
    compile_chart,
)

EXAMPLES = int(os.environ.get("CALEXEC_HIER_EXAMPLES", "60"))


class Recorder:
    """The model: every callback appends what it was called with to ``log``."""

    def __init__(self) -> None:
        self.log: list[tuple[object, ...]] = []
        self.armed = False
        self.refund = False  # Checkout's eventless transition is enabled while this holds

    def is_armed(self, model: Recorder) -> bool:
        model.log.append(("guard is_armed", model.armed))
        return model.armed


def _ids(states: object) -> tuple[str, ...]:
    return tuple(s.id for s in states)  # type: ignore[attr-defined]


def big_enough(amount: int = 0) -> bool:
    """A callable guard (not a name)."""
    return amount >= 3


class Player(StateChart):
    """StateChart semantics: compound, parallel (three regions), deep history, done events,
    error.execution from a raising action, guards of every form."""

    class on(State.Compound):
        class playback(State.Parallel):
            class audio(State.Compound):
                loud = State(initial=True)
                muted = State()
                mute = loud.to(muted, cond="not quiet_hours")
                unmute = muted.to(loud)

            class video(State.Compound):
                frames = State(initial=True)
                ended = State(final=True)
                finish = frames.to(ended, cond=big_enough)
                skip = frames.to(ended, cond="is_armed and flag_set", on="note_skip")

            class subtitles(State.Compound):
                hidden = State(initial=True)
                shown = State()
                toggle = hidden.to(shown) | shown.to(hidden, unless="flag_set")

        paused = State()
        h = HistoryState(type="deep")
        pause = playback.to(paused)
        resume = paused.to(playback)
        arm = paused.to.itself(on="set_armed")
        explode = paused.to(playback, on="boom")

    off = State(initial=True)
    broken = State()
    power = off.to(on) | on.to(off)
    back = off.to(on.h)
    done_state_video = on.to(off, on="credits")
    error_execution = on.to(broken)
    repair = broken.to(off)

    def quiet_hours(self, amount: int = 0) -> bool:
        return amount < 0

    def flag_set(self, flag: bool = False) -> bool:
        return flag

    def set_armed(self, model: Recorder, flag: bool = False) -> None:
        model.armed = flag
        model.log.append(("set_armed", flag))

    def note_skip(self, model: Recorder, event: str, amount: int = 0) -> str:
        model.log.append(("note_skip", str(event), amount))
        return f"skipped {amount}"

    def boom(self, model: Recorder) -> None:
        model.log.append(("boom",))
        raise RuntimeError("boom")

    def credits(self, model: Recorder, event: str, source: State, target: State) -> None:
        model.log.append(("credits", str(event), source.id, target.id))

    def on_enter_state(self, model: Recorder, state: State, event: str, amount: int = 0) -> None:
        model.log.append(("enter", state.id, str(event), amount))

    def on_exit_state(self, model: Recorder, state: State, event: str) -> None:
        model.log.append(("exit", state.id, str(event)))

    def before_transition(self, model: Recorder, event: str, source: State, *args: object,
                          **kwargs: object) -> None:
        model.log.append(("before", str(event), source.id, args,
                          tuple(sorted(k for k in kwargs if k in ("amount", "flag")))))

    def after_transition(self, model: Recorder, event: str, source: State,
                         target: State | None) -> None:
        model.log.append(("after", str(event), source.id, target.id if target else None))

    def on_enter_paused(self, model: Recorder) -> None:
        model.log.append(("on_enter_paused",))

    def on_power(self, model: Recorder, flag: bool = False) -> str:
        model.log.append(("on_power", flag))
        return "powered"


class Checkout(StateMachine):
    """StateMachine semantics: a refused event raises; compound states with shallow history,
    a validator that raises, an eventless transition, transitions from an ancestor, a final
    state, unless guards and expressions."""

    class shopping(State.Compound):
        browsing = State(initial=True)
        class cart(State.Compound):
            empty = State(initial=True)
            filled = State()
            add = empty.to(filled) | filled.to.itself(internal=True)
            clear = filled.to(empty)
        h = HistoryState()
        look = browsing.to(cart)
        leave = cart.to(browsing)

    class paying(State.Compound):
        entering = State(initial=True)
        authorised = State()
        authorise = entering.to(authorised, validators="positive", cond="is_armed or flag_set")
        authorised.to(entering, cond="refund_due")  # not assigned: an eventless transition

    done = State(final=True)
    idle = State(initial=True)

    start = idle.to(shopping)
    checkout = shopping.to(paying, unless="quiet_hours and not flag_set")
    back = paying.to(shopping.h)
    arm = idle.to.itself(on="set_armed") | shopping.to.itself(on="set_armed")
    confirm = paying.to(done, cond="is_armed")

    def positive(self, model: Recorder, amount: int = 0) -> None:
        model.log.append(("validator positive", amount))
        if amount <= 0:
            raise ValueError(f"amount must be positive, got {amount}")

    def refund_due(self, model: Recorder) -> bool:
        model.log.append(("guard refund_due", model.refund))
        return model.refund

    def quiet_hours(self, amount: int = 0) -> bool:
        return amount < 0

    def flag_set(self, flag: bool = False) -> bool:
        return flag

    def set_armed(self, model: Recorder, flag: bool = False) -> None:
        model.armed = flag
        model.log.append(("set_armed", flag))

    def on_enter_state(self, model: Recorder, state: State, source: State, event: str) -> None:
        model.log.append(("enter", state.id, source.id if source else None, str(event)))

    def on_exit_state(self, model: Recorder, state: State, target: State | None) -> None:
        model.log.append(("exit", state.id, target.id if target else None))

    def on_transition(self, model: Recorder, event: str, transition: object,
                      previous_configuration: object = None,
                      new_configuration: object = None) -> None:
        model.log.append(("on", str(event), str(transition),
                          previous_configuration and _ids(previous_configuration),
                          new_configuration and _ids(new_configuration)))

    def on_authorise(self, amount: int, model: Recorder) -> int:
        model.log.append(("on_authorise", amount))
        return amount * 2


class Faulty(StateMachine):
    """StateMachine semantics: an action error reaches the caller and the configuration is
    rolled back; a shallow history inside a parallel region."""

    class running(State.Parallel):
        class engine(State.Compound):
            cold = State(initial=True)
            hot = State()
            h = HistoryState()
            heat = cold.to(hot)
            cool = hot.to(cold, on="crash_if_flagged")

        class lights(State.Compound):
            dark = State(initial=True)
            lit = State(final=True)
            light = dark.to(lit)

    stopped = State(initial=True)
    go = stopped.to(running)
    stop = running.to(stopped)
    resume = stopped.to(running.engine.h)

    def crash_if_flagged(self, model: Recorder, flag: bool = False) -> None:
        model.log.append(("crash_if_flagged", flag))
        if flag:
            raise RuntimeError("crashed while cooling")

    def on_enter_state(self, model: Recorder, state: State) -> None:
        model.log.append(("enter", state.id))

    def on_exit_state(self, model: Recorder, state: State) -> None:
        model.log.append(("exit", state.id))


class Audit:
    """A class-level listener: made and set up per instance, answering a guard and logging."""

    def setup(self, sm: StateChart) -> None:
        self.chart = type(sm).__name__

    def belt_ok(self, model: Recorder, amount: int = 0) -> bool:
        model.log.append(("audit belt_ok", self.chart, amount))
        return amount != 2

    def after_transition(self, model: Recorder, event: str, source: State) -> None:
        model.log.append(("audit after", str(event), source.id))


class Relay(StateChart):
    """Callbacks that reach the machine: ``In('id')`` guards, ``raise_`` (the internal queue:
    within the macrostep), ``send`` and an event called as a method (the external queue: after
    it), ``machine.configuration`` read from a callback, ``event_data`` injected; an event
    of several ids and a transition bound to two events; a class-level listener."""

    listeners = [Audit]

    class line(State.Parallel):
        class feed(State.Compound):
            waiting = State(initial=True)
            loaded = State()
            jammed = State()
            load = waiting.to(loaded, on="announce")
            jam = loaded.to(jammed, cond="In('running')")
            clear = jammed.to(waiting, event="clear reset")

        class motor(State.Compound):
            stopped = State(initial=True)
            running = State()
            spin = Event(stopped.to(running, cond="In('loaded') or flag_set"), id="spin go")
            halt = running.to(stopped, cond="belt_ok")

    idle = State(initial=True)
    power = idle.to(line, on="chain") | line.to(idle)
    ping = line.to.itself(internal=True, on="relay_ping")
    pong = line.to.itself(internal=True, on="note_pong")

    def flag_set(self, flag: bool = False) -> bool:
        return flag

    def chain(self, model: Recorder, flag: bool = False) -> str:
        model.log.append(("chain", flag))
        if flag:
            self.raise_("spin", amount=7, flag=True)  # internal: taken within this macrostep
        return "chained"

    def announce(self, model: Recorder, machine: StateChart, event_data: object,
                 amount: int = 0) -> None:
        model.log.append(("announce", str(event_data.event),  # type: ignore[attr-defined]
                          _ids(machine.configuration), amount))
        if amount > 3:
            self.send("halt")  # external: after this macrostep
            self.ping(amount=amount)

    def relay_ping(self, model: Recorder, amount: int = 0) -> str:
        model.log.append(("ping", amount, _ids(self.configuration)))
        if amount % 2:
            self.raise_("pong", amount=amount + 1)
        return "pinged"

    def note_pong(self, model: Recorder, amount: int = 0) -> None:
        model.log.append(("pong", amount))

    def on_enter_state(self, model: Recorder, state: State, event: str, amount: int = 0) -> None:
        model.log.append(("enter", state.id, str(event), amount))


CHARTS = [Player, Checkout, Faulty, Relay]

#: sequences every run checks besides the random ones: the ones where deep and shallow history
#: differ, done events, error.execution, a validator raising, a rolled-back action error
SCENARIOS: dict[type[StateChart], list[list[tuple[str, int, bool]]]] = {
    Player: [
        [("power", 0, True), ("mute", 1, False), ("toggle", 0, False), ("power", 0, False),
         ("back", 2, False)],  # deep history restores muted + shown inside the parallel state
        [("power", 0, False), ("finish", 4, False), ("power", 0, False)],  # done.state.video
        [("power", 0, False), ("pause", 0, False), ("arm", 0, True), ("back", 0, False),
         ("resume", 0, False), ("skip", 3, True)],
        [("power", 0, False), ("pause", 0, False), ("explode", 0, False),
         ("repair", 0, False)],  # error.execution -> broken
    ],
    Checkout: [
        [("start", 0, False), ("look", 0, False), ("add", 0, False), ("add", 1, False),
         ("checkout", 1, False), ("back", 0, False)],  # shallow history: cart, not filled
        [("start", 0, False), ("arm", 0, True), ("checkout", 0, True), ("authorise", 0, True),
         ("authorise", 2, True), ("confirm", 0, False), ("start", 0, False)],  # validator, final
        [("start", 0, False), ("checkout", -1, False), ("checkout", -1, True),
         ("authorise", 5, True)],  # unless expression; eventless transition after the refund
    ],
    Relay: [
        [("power", 0, True), ("load", 5, False), ("jam", 0, False), ("reset", 0, False)],
        [("power", 0, False), ("load", 1, False), ("go", 0, False), ("jam", 0, False),
         ("clear", 0, False), ("ping", 3, False), ("power", 0, False)],
    ],
    Faulty: [
        [("go", 0, False), ("heat", 0, False), ("cool", 0, True), ("light", 0, False),
         ("stop", 0, False), ("resume", 0, False)],  # rolled back, then shallow history
    ],
}


def _outcome(target: object, event: str, amount: int, flag: bool) -> tuple[object, ...]:
    """What ``target.send(event, amount=..., flag=...)`` did: ("ok", result) or how it
    failed."""
    try:
        return ("ok", target.send(event, amount=amount, flag=flag))  # type: ignore[attr-defined]
    except (TransitionNotAllowed, ChartTransitionError):
        return ("refused",)
    except Exception as error:  # noqa: BLE001 - compared across the two runs
        return ("error", type(error).__name__, str(error))


def events_for(chart: type[StateChart]) -> st.SearchStrategy[tuple[str, int, bool]]:
    names = sorted({i for e in chart.events for i in e.id.split()}  # each id of an event
                   | {str(e) for e in chart.events} - {"error_execution", "done_state_video"})
    return st.tuples(st.sampled_from([*names, "not_an_event"]), st.integers(-2, 5),
                     st.booleans())


@pytest.mark.parametrize("chart", CHARTS, ids=[c.__name__ for c in CHARTS])
def test_compiled_run_equals_python_statemachine(chart: type[StateChart]) -> None:
    compiled_chart = compile_chart(chart)
    assert compiled_chart.general  # these charts take the general run, not the flat fast path

    @settings(max_examples=EXAMPLES, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(steps=st.lists(events_for(chart), max_size=30))
    def check(steps: list[tuple[str, int, bool]]) -> None:
        real_model, compiled_model = Recorder(), Recorder()
        real = chart(model=real_model)
        run = compiled_chart.run(compiled_model)
        assert run.configuration == tuple(real.configuration_values)
        assert compiled_model.log == real_model.log
        for index, (event, amount, flag) in enumerate(steps):
            real_model.refund = compiled_model.refund = amount == 5
            expected = _outcome(real, event, amount, flag)
            got = _outcome(run, event, amount, flag)
            where = f"step {index}: send({event!r}, amount={amount}, flag={flag})"
            assert got == expected, where
            assert run.configuration == tuple(real.configuration_values), where
            assert compiled_model.log == real_model.log, where
            assert run.final == real.is_terminated, where

    for steps in SCENARIOS[chart]:
        check = example(steps=steps)(check)
    check()


def test_a_refused_event_raises_with_statemachine_semantics_and_names_the_guards() -> None:
    run = compile_chart(Checkout).run(Recorder())
    run.send("start")
    run.send("look")
    with pytest.raises(IllegalTransition, match="'confirm' is not allowed"):
        run.send("confirm")  # no transition of the active states names it
    run.send("checkout", amount=1, flag=False)
    with pytest.raises(GuardRejected, match=r"rejected by guard\(s\) is_armed"):
        run.send("confirm")


def test_a_refused_event_is_ignored_with_statechart_semantics() -> None:
    run = compile_chart(Player).run(Recorder())
    assert run.send("mute") is None and run.configuration == ("off",)
