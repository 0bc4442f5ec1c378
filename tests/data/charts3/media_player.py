"""A media player (StateChart): a parallel root of two regions, history (shallow and deep)
inside compounds, a parallel state nested in a compound inside the parallel root, internal
and external self transitions, one event with several prioritised transitions, cond lists
plus ``unless``, a model object, and a class-level listener."""

from __future__ import annotations

from statemachine import Event, HistoryState, State, StateChart


class Audit:
    """A class-level listener: records every transition it hears on the model."""

    def after_transition(self, event: str, source: State, target: State, model: object) -> None:
        model.log.append(("audit", str(event), source.id, target.id))  # type: ignore[attr-defined]


class Player:
    """The model: guards by name, the log every callback appends to."""

    def __init__(self) -> None:
        self.log: list[tuple[object, ...]] = []
        self.licensed = True
        self.network = True
        self.offline_mode = False
        self.battery_low = False

    def has_license(self) -> bool:
        return self.licensed

    def network_up(self) -> bool:
        return self.network

    def offline(self) -> bool:
        return self.offline_mode

    def low_battery(self) -> bool:
        return self.battery_low


class MediaPlayer(StateChart):
    listeners = [Audit]

    class device(State.Parallel):
        class media(State.Compound):
            stopped = State(initial=True)

            class playing(State.Compound):
                class track(State.Parallel):
                    class decoder(State.Compound):
                        buffering = State(initial=True)
                        decoding = State()
                        buffered = buffering.to(decoding)
                        starve = decoding.to(buffering)

                    class output(State.Compound):
                        speakers = State(initial=True)
                        headphones = State()
                        plug = speakers.to(headphones)
                        unplug = headphones.to(speakers)

                seeking = State()
                hist = HistoryState(type="deep")
                seek = track.to(seeking)
                sought = seeking.to(track)
                # internal vs external self transitions on a compound
                tick = track.to.itself(internal=True, on="count_tick")
                restart = track.to.itself(on="count_restart")

            paused = State()
            last = HistoryState()  # shallow
            # one event, several transitions, tried in order; cond lists plus unless
            play = Event(
                stopped.to(playing, cond=["has_license", "network_up"], unless="low_battery")
                | stopped.to(playing, cond=["has_license", "offline"])
                | stopped.to(paused),
                name="Play")
            pause = playing.to(paused)
            resume = paused.to(playing.hist)
            back = paused.to(last)
            stop = playing.to(stopped) | paused.to(stopped)

        class screen(State.Compound):
            dark = State(initial=True)
            lit = State()
            wake = dark.to(lit)
            sleep = lit.to(dark)
            wake_again = lit.to.itself(on="count_wake")

    def count_tick(self, model: Player) -> None:
        model.log.append(("tick",))

    def count_restart(self, model: Player) -> None:
        model.log.append(("restart",))

    def count_wake(self, model: Player) -> None:
        model.log.append(("wake again",))

    def on_enter_state(self, model: Player, state: State) -> None:
        model.log.append(("enter", state.id))

    def on_exit_state(self, model: Player, state: State) -> None:
        model.log.append(("exit", state.id))
