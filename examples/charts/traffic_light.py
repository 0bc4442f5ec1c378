"""A traffic light with a pedestrian crossing: the hierarchical example of docs/framework.md.

``operating`` is a parallel state of two regions: the cars' lights (green, yellow, red) and the
pedestrians' signal (don't walk, waiting, walk), both driven by the controller's ``tick``. A
pedestrian's ``press`` (with the side of the street as event data) makes the cars' green turn
yellow at the next tick; the walk signal only shows while the cars have red. A ``fault`` sends
the junction to ``flashing`` (a compound state blinking yellow); ``repair`` resumes the cars'
lights where they were (a history state of the ``cars`` region) while the pedestrians' signal
starts over at don't walk. ``retire`` from ``off`` is final.

The guards are questions to the model (``Junction``); the actions (entering and leaving red,
a press, the walk signal) record on it what happened, in order.
"""

from __future__ import annotations

from statemachine import HistoryState, State, StateChart


class Junction:
    """The model: what the controller knows about the junction, and a log of what it did."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.cars_halted = False
        self.log: list[str] = []

    def pedestrian_waiting(self) -> bool:
        return bool(self.requests)

    def cars_stopped(self) -> bool:
        return self.cars_halted


class TrafficLight(StateChart):
    class operating(State.Parallel):
        class cars(State.Compound):
            green = State(initial=True)
            yellow = State()
            red = State()
            tick = (green.to(yellow, cond="pedestrian_waiting") | yellow.to(red)
                    | red.to(green))
            h = HistoryState()

        class pedestrians(State.Compound):
            dont_walk = State(initial=True)
            waiting = State()
            walk = State()
            press = dont_walk.to(waiting) | waiting.to.itself(internal=True)
            step = waiting.to(walk, cond="cars_stopped") | walk.to(dont_walk)

    class flashing(State.Compound):
        flash_on = State(initial=True)
        flash_off = State()
        blink = flash_on.to(flash_off) | flash_off.to(flash_on)

    off = State(initial=True)
    retired = State(final=True)

    power_on = off.to(operating)
    power_off = operating.to(off) | flashing.to(off)
    fault = operating.to(flashing)
    repair = flashing.to(operating.cars.h)
    retire = off.to(retired)

    def on_enter_red(self, model: Junction) -> None:
        model.cars_halted = True
        model.log.append("cars stop")

    def on_exit_red(self, model: Junction) -> None:
        model.cars_halted = False
        model.log.append("cars go")

    def on_press(self, model: Junction, side: str = "north") -> None:
        model.requests.append(side)
        model.log.append(f"pressed on the {side} side")

    def on_enter_walk(self, model: Junction) -> None:
        model.requests.clear()
        model.log.append("beep beep: walk")

    def on_enter_flashing(self, model: Junction) -> None:
        model.log.append("fault: flashing yellow")
